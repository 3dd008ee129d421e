"""Run real coding agents against Colibri, one task each, and check that each completed a
turn with a tool call and its result.

- Claude Code (the CLI bundled in PyPI's `claude-agent-sdk`), `claude -p`, Messages API;
- Codex CLI (PyPI's `openai-codex-cli-bin`), `codex exec` with a custom provider on the
  Responses API;
- mini-swe-agent (PyPI's `mini-swe-agent`), `mini`, chat completions with tools.

Installs nothing: `pip install claude-agent-sdk openai-codex-cli-bin mini-swe-agent` first (an
agent that is not installed is reported as skipped). Each agent runs with its default settings
in a temporary HOME, against a server in this process on 127.0.0.1.

The model is the bundled demo model converted with a 64k-token context and a chat template
that renders tools, calls and results: the agents' prompts are tens of thousands of tokens.
Its words are nonsense, so the server, for this run only, forces the calls that make the turn:
the first request of a conversation that offers tools gets tool_choice naming a harmless tool
(Claude Code: Read, Codex: exec_command, mini-swe-agent: bash), with that tool's arguments
constrained to fixed values (the project's README.md, `ls`, `ls`; then mini-swe-agent's `echo
COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`, which is how it ends a task). Everything else — the
agents' requests, the tool definitions they render, streaming, the tool results — is theirs.

    python scripts/run_agents.py [--agents claude,codex,mini] [--workdir DIR] [--keep]

Exit status 0 when every installed agent passed. The requests each agent made (path, status,
forced tool, whether it carried a tool result, the body as received) are written to
WORKDIR/requests-AGENT.json, and its output to WORKDIR/output-AGENT.txt.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from colibri.app.middleware import replay_body  # noqa: E402
from tests.server_helpers import InProcessServer, tool_template_model  # noqa: E402

KEY = "sk-agents"
MODEL = "colibri-agent"
CONTEXT = 65536
TASK = "List the markdown files in this folder."
AGENT_TIMEOUT_S = 900

Body = dict[str, Any]


# -- the forced first call -------------------------------------------------------------------
def _const_object(**values: Any) -> dict[str, Any]:
    return {"type": "object", "properties": {k: {"const": v} for k, v in values.items()},
            "required": list(values), "additionalProperties": False}


def force_claude(project: Path, path: str, body: Body) -> str | None:
    """Messages API: the first request with tools reads the project's README.md."""
    if path != "/v1/messages" or not body.get("tools"):
        return None
    msgs = body.get("messages") or []
    if any(isinstance(b, dict) and b.get("type") == "tool_result"
           for m in msgs if isinstance(m.get("content"), list) for b in m["content"]):
        return None
    for tool in body["tools"]:
        if tool.get("name") == "Read":
            tool["input_schema"] = _const_object(file_path=str(project / "README.md"))
            body["tool_choice"] = {"type": "tool", "name": "Read"}
            return "Read"
    return None


def force_codex(project: Path, path: str, body: Body) -> str | None:
    """Responses API: the first request with tools runs `ls` (in Codex's sandbox)."""
    if path != "/v1/responses" or not body.get("tools"):
        return None
    items = body.get("input") if isinstance(body.get("input"), list) else []
    if any(i.get("type") == "function_call_output" for i in items):
        return None
    for tool in body["tools"]:
        if tool.get("type") == "function" and tool.get("name") == "exec_command":
            tool["parameters"] = _const_object(cmd="ls")
            body["tool_choice"] = {"type": "function", "name": "exec_command"}
            return "exec_command: ls"
    return None


def force_mini(project: Path, path: str, body: Body) -> str | None:
    """Chat completions: `ls`, then (once its result is in) the command that ends the task."""
    if path != "/v1/chat/completions" or not body.get("tools"):
        return None
    done = any(m.get("role") == "tool" for m in body.get("messages") or [])
    command = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" if done else "ls"
    for tool in body["tools"]:
        fn = tool.get("function") or {}
        if fn.get("name") == "bash":
            fn["parameters"] = _const_object(command=command)
            body["tool_choice"] = {"type": "function", "function": {"name": "bash"}}
            return f"bash: {command}"
    return None


@dataclass
class Record:
    """One request an agent made."""

    method: str
    path: str
    status: int = 0
    forced: str | None = None
    has_tool_result: bool = False
    body: Body | None = field(default=None, repr=False)


def _has_tool_result(body: Body) -> bool:
    text = json.dumps(body)
    return any(k in text for k in ('"tool_result"', '"function_call_output"', '"role": "tool"'))


class Forcing:
    """ASGI wrapper: applies a force_* rewrite to POST bodies and records every request."""

    def __init__(self, app: Any, rewrite: Callable[[str, Body], str | None]) -> None:
        self.app, self.rewrite = app, rewrite
        self.records: list[Record] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] == "/ready":
            await self.app(scope, receive, send)
            return
        rec = Record(scope["method"], scope["path"])
        self.records.append(rec)
        if scope["method"] == "POST":
            chunks = []
            while True:
                message = await receive()
                chunks.append(message.get("body", b""))
                if not message.get("more_body"):
                    break
            raw = b"".join(chunks)
            try:
                body = json.loads(raw)
            except ValueError:
                body = None
            if isinstance(body, dict):
                rec.forced = self.rewrite(scope["path"], body)
                rec.has_tool_result = _has_tool_result(body)
                rec.body = body
                raw = json.dumps(body).encode()
            scope = dict(scope, headers=[(k, v) for k, v in scope["headers"]
                                         if k != b"content-length"]
                         + [(b"content-length", str(len(raw)).encode())])
            receive = replay_body(raw, receive)

        async def send_status(message: Any) -> None:
            if message["type"] == "http.response.start":
                rec.status = int(message["status"])
            await send(message)

        await self.app(scope, receive, send_status)


# -- the model and the server ----------------------------------------------------------------
def make_model(folder: Path) -> Path:
    """The demo model with a 64k context and a template that renders tools."""
    model = tool_template_model(folder)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = CONTEXT
    (model / "config.json").write_text(json.dumps(config, indent=2))
    return model


def start_server(model: Path, rewrite: Callable[[str, Body], str | None],
                 cache: Path) -> tuple[InProcessServer, Forcing]:
    from colibri.app.server import create_app
    from colibri.app.settings import Settings

    settings = Settings(model=str(model), served_model_name=MODEL, api_key=KEY,  # type: ignore[call-arg]
                        accept_any_model=True, n_ctx=CONTEXT, cache_dir=str(cache))
    app = Forcing(create_app(settings), rewrite)
    server = InProcessServer(app).start()
    end = time.monotonic() + 300
    import httpx

    while httpx.get(server.url + "/ready", timeout=5).status_code != 200:
        if time.monotonic() > end:
            raise RuntimeError("the server did not get ready")
        time.sleep(0.5)
    return server, app


# -- the agents ------------------------------------------------------------------------------
@dataclass
class Agent:
    name: str
    package: str
    rewrite: Callable[[Path, str, Body], str | None]  # (project folder, path, body)
    path: str  # the endpoint it speaks

    def executable(self) -> Path | None:
        try:
            dist = metadata.distribution(self.package)
        except metadata.PackageNotFoundError:
            return None
        site = Path(str(dist.locate_file("")))
        candidates = {"claude": site / "claude_agent_sdk" / "_bundled" / "claude",
                      "codex": site / "codex_cli_bin" / "bin" / "codex",
                      "mini": Path(sys.executable).parent / "mini"}
        exe = candidates[self.name]
        return exe if exe.exists() else None

    def command(self, exe: Path, url: str) -> tuple[list[str], dict[str, str]]:
        if self.name == "claude":
            return ([str(exe), "-p", TASK, "--model", MODEL],
                    {"ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": KEY})
        if self.name == "codex":
            provider = (f'{{name="Colibri", base_url="{url}/v1", env_key="COLIBRI_API_KEY", '
                        'wire_api="responses"}')
            return ([str(exe), "exec", "--skip-git-repo-check", "-m", MODEL,
                     "-c", "model_provider=colibri", "-c", f"model_providers.colibri={provider}",
                     TASK], {"COLIBRI_API_KEY": KEY})
        return ([str(exe), "-y", "--exit-immediately", "-m", f"openai/{MODEL}", "-t", TASK],
                {"OPENAI_API_KEY": KEY, "OPENAI_API_BASE": url + "/v1",
                 # the answers to its first-run questions, and no price list to look up
                 "MSWEA_CONFIGURED": "true", "MSWEA_COST_TRACKING": "ignore_errors",
                 "LITELLM_LOCAL_MODEL_COST_MAP": "True"})

    def version(self, exe: Path) -> str:
        try:
            out = subprocess.run([str(exe), "--version"], capture_output=True, text=True,
                                 timeout=60)
            text = (out.stdout or out.stderr).strip().splitlines()
        except (OSError, subprocess.TimeoutExpired):
            text = []
        return f"{self.package} {metadata.version(self.package)}" + (
            f" ({text[0]})" if text else "")


AGENTS = [Agent("claude", "claude-agent-sdk", force_claude, "/v1/messages"),
          Agent("codex", "openai-codex-cli-bin", force_codex, "/v1/responses"),
          Agent("mini", "mini-swe-agent", force_mini, "/v1/chat/completions")]


def verdict(agent: Agent, code: int, records: list[Record]) -> list[str]:
    """What failed (empty: passed): exit 0, a forced call answered 200 and a later request
    on the same endpoint carrying the tool result back."""
    problems = []
    if code != 0:
        problems.append(f"exit status {code}")
    calls = [i for i, r in enumerate(records) if r.path == agent.path and r.forced]
    if not calls or records[calls[0]].status != 200:
        problems.append("no forced tool call answered 200")
    elif not any(r.path == agent.path and r.has_tool_result and r.status == 200
                 for r in records[calls[0] + 1:]):
        problems.append("no later request carried the tool result back")
    bad = [f"{r.method} {r.path} {r.status}" for r in records
           if r.path.startswith(agent.path) and r.status >= 400]
    if bad:
        problems.append("error answers: " + ", ".join(bad))
    return problems


def run_agent(agent: Agent, model: Path, work: Path) -> bool:
    exe = agent.executable()
    if exe is None:
        print(f"{agent.name}: skipped ({agent.package} is not installed)")
        return True
    print(f"{agent.name}: {agent.version(exe)}", flush=True)
    home = work / f"home-{agent.name}"
    project = work / f"project-{agent.name}"
    server, forcing = start_server(model, functools.partial(agent.rewrite, project),
                                   work / "cache")
    for d in (home, project):
        d.mkdir(parents=True, exist_ok=True)
    (project / "README.md").write_text("# A project\n")
    cmd, extra = agent.command(exe, server.url)
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(home), "LANG": "C.UTF-8", **extra}
    started = time.monotonic()
    try:
        run = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True,
                             timeout=AGENT_TIMEOUT_S, stdin=subprocess.DEVNULL)
        code, out = run.returncode, run.stdout + run.stderr
    except subprocess.TimeoutExpired as exc:
        code, out = 124, f"timed out after {AGENT_TIMEOUT_S} s: {exc}"
    finally:
        server.stop()
    took = time.monotonic() - started
    (work / f"output-{agent.name}.txt").write_text(out)
    (work / f"requests-{agent.name}.json").write_text(json.dumps(
        [vars(r) for r in forcing.records], indent=1))
    problems = verdict(agent, code, forcing.records)
    print(f"{agent.name}: {' '.join(cmd[:2])} ... exit {code} in {took:.0f} s; requests: "
          + ", ".join(f"{r.method} {r.path} {r.status}"
                      + (f" [forced {r.forced}]" if r.forced else "")
                      + (" [tool result]" if r.has_tool_result else "")
                      for r in forcing.records))
    print(f"{agent.name}: {'PASSED' if not problems else 'FAILED: ' + '; '.join(problems)}",
          flush=True)
    return not problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", default="claude,codex,mini",
                        help="comma-separated: claude, codex, mini")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where the model, homes and logs go (default: a temporary "
                             "folder, removed unless --keep)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.agents.split(",") if n.strip()]
    unknown = set(names) - {a.name for a in AGENTS}
    if unknown:
        parser.error(f"unknown agents: {', '.join(sorted(unknown))}")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="colibri-agents-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"work folder: {work}", flush=True)
    try:
        model = make_model(work / "model")
        results = [run_agent(a, model, work) for a in AGENTS if a.name in names]
    finally:
        if args.workdir is None and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())

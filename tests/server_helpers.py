"""Helpers for the server tests (not a test file): tiny models, servers in a subprocess or
in this process, metrics.

Subprocess servers run `python -m colibri.app serve` (what `colibri serve` runs) on 127.0.0.1 with
a free port, in a temporary working folder (so no stray .env applies), with a temporary
conversion cache, on the C core (COLIBRI_DEVICE=cpu unless a test sets it). In-process
servers run the real app and the real LLM in a uvicorn thread; `PacedLLM` wraps the real LLM
so a test decides when each engine step may run (deterministic queueing and disconnect tests),
`fail_next` makes the next step fail.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_TINY: dict[str, Path] = {}  # overrides -> an untouched build, copied to each caller


def tiny_model(out_dir: Path, **overrides: Any) -> Path:
    """A tiny random Mixtral checkpoint (real ChatML tokenizer) written to out_dir: a copy of
    one build per set of overrides (the caller may change its copy), as building one takes
    seconds and a copy milliseconds. remove_tiny_models() deletes the builds."""
    import json
    import shutil
    import tempfile

    from tests.tiny_models import make_checkpoint

    if (out_dir / "config.json").exists():
        return out_dir
    key = json.dumps(overrides, sort_keys=True)
    if key not in _TINY:
        build = Path(tempfile.mkdtemp(prefix="colibri-test-tiny-"))
        _TINY[key] = make_checkpoint("mixtral", build, seed=0, **overrides)
    shutil.copytree(_TINY[key], out_dir, dirs_exist_ok=True)
    return out_dir


def remove_tiny_models() -> None:
    """Delete the builds tiny_model copies from (at the end of the test session)."""
    import shutil

    for build in _TINY.values():
        shutil.rmtree(build, ignore_errors=True)
    _TINY.clear()


# A Qwen-style template that renders tools, earlier calls and tool results (Hermes calls in
# <tool_call> blocks), as agents' models have; the bundled model's own template renders none.
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n"
    "{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}{% if not (loop.first and m.role == 'system') %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{% if m.content %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}\n<tool_call>\n"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n"
    "</tool_call>{% endfor %}<|im_end|>\n{% endif %}{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tool_template_model(out_dir: Path) -> Path:
    """The bundled demo model (a Hugging Face folder) with TOOL_TEMPLATE as its template."""
    import shutil

    from colibri.engine.demo import default_model_path

    if not (out_dir / "config.json").exists():
        shutil.copytree(default_model_path(), out_dir,
                        ignore=shutil.ignore_patterns("*.gz", "README.md"))
        (out_dir / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    return out_dir


def parse_metrics(text: str) -> dict[str, float]:
    """Samples of a Prometheus text exposition: {'name{labels}': value}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def rss_kb(pid: int) -> int:
    """The resident set of process pid, in KiB (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for process {pid}")


def child_processes(pid: int, module: str) -> set[int]:
    """The children of process pid that run `python -m module` (Linux)."""
    out = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                cmd = Path(f"/proc/{child}/cmdline").read_bytes()
            except OSError:
                continue
            if module.encode() in cmd:
                out.add(int(child))
    return out


def wait_for(pred: Any, timeout: float = 10.0, what: str = "condition") -> None:
    """Poll pred() until true; fail after timeout seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


class SubprocessServer:
    """`python -m colibri.app serve` in a child process (in a session of its own with
    new_session, so that everything it starts can be found by its process group)."""

    poll_s = 0.1  # between two readiness checks

    def __init__(self, model: Path | None, workdir: Path, *args: str,
                 env: dict[str, str] | None = None, port: int | None = None,
                 new_session: bool = False) -> None:
        self.port = free_port() if port is None else port
        self.url = f"http://127.0.0.1:{self.port}"
        workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = workdir / "server.log"
        full_env = dict(os.environ)
        full_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (os.environ.get("PYTHONPATH", ""), str(ROOT)) if p)
        full_env.setdefault("COLIBRI_CACHE_DIR", str(workdir / "cache"))
        # the C core on any machine, a GPU one included (the torch backend has tests of its
        # own); --device auto would also import torch at each start to look for a GPU, which
        # costs more than the rest of a tiny model's start
        full_env.setdefault("COLIBRI_DEVICE", "cpu")
        full_env.update(env or {})
        cmd = [sys.executable, "-m", "colibri.app", "serve", "--port", str(self.port), *args]
        if model is not None:
            cmd += ["--model", str(model)]
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, cwd=workdir, env=full_env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=new_session)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def ready(self) -> bool:
        """Whether the server says it is ready (an HTTP error counts as not yet)."""
        return httpx.get(self.url + "/ready", timeout=1.0).status_code == 200

    def wait_ready(self, timeout: float = 120.0) -> SubprocessServer:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if self.ready():
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(self.poll_s)
        raise AssertionError(f"server not ready after {timeout}s:\n{self.log()}")

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.url + "/metrics", timeout=5.0).text)

    def wait_exit(self, timeout: float = 120.0) -> int:
        """The exit code of a server that was already signalled, once it exits by itself.
        Sending it another signal would cut its drain short (uvicorn takes a second
        SIGTERM as "exit now"), so this only waits; a server still running after timeout
        is killed and the test fails on its exit code."""
        try:
            return int(self.proc.wait(timeout))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"server still running {timeout}s after the signal:\n"
                                 f"{self.log()}") from None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return int(self.proc.returncode)


class ExplodingConstraint:
    """A constraint whose first use raises, as a bug in a grammar engine would; its message
    names internals a client must never see."""

    def apply(self, logits: Any) -> None:
        raise RuntimeError("constraint exploded in kernel.c")

    def accept(self, token: int) -> None:
        pass

    def is_finished(self) -> bool:
        return False


class _FailingModel:
    """A model whose forward pass raises, for one step."""

    def __init__(self, model: Any) -> None:
        self._model = model

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def forward_paged(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("secret internal detail /opt/colibri/kernel.c:42")


def _paced_core(real: Any, paced: PacedLLM) -> Any:
    """The real EngineCore (same state), but each step waits for a permit from the test.

    Without a permit the step does nothing and returns at once, so the engine thread keeps
    applying aborts and new requests between the steps the test allows."""
    from colibri.engine.core.engine import EngineCore

    class PacedCore(EngineCore):
        def step(self) -> list[Any]:
            if not paced.permits.acquire(timeout=0.01):
                return []
            paced.started.set()
            model = self.model
            if paced.fail_next:
                paced.fail_next = False
                self.model = _FailingModel(model)
            try:
                outs = super().step()
            finally:
                self.model = model
            paced.produced += sum(1 for o in outs if o.token_id >= 0)
            paced.steps += 1
            return outs

    core = object.__new__(PacedCore)
    core.__dict__ = real.__dict__  # one state: the real core's
    return core


class PacedLLM:
    """The real LLM, but each engine step waits for a permit from the test; `fail_next`
    makes the next step's forward pass raise (its requests fail, the engine goes on)."""

    def __init__(self, llm: Any) -> None:
        self._llm = llm
        self.permits = threading.Semaphore(0)
        self.produced = 0
        self.steps = 0  # steps the test let run
        self.started = threading.Event()
        self.fail_next = False
        self.core = _paced_core(llm.core, self)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)

    def drain(self) -> None:
        """Take back permits a previous test released but did not use."""
        while self.permits.acquire(blocking=False):
            pass

    def release(self, n: int) -> None:
        for _ in range(n):
            self.permits.release()


class InProcessServer:
    """The app (with any loader) served by uvicorn on a thread of this process."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                http="h11", loop="asyncio", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> InProcessServer:
        self.thread.start()
        wait_for(lambda: self.server.started, 30.0, "uvicorn to start")
        return self

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.url + "/metrics", timeout=5.0).text)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30.0)

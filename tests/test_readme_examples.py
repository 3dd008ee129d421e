"""The README's examples, run as printed against `colibri serve` as the README starts it.

The curl and openai-SDK code blocks are read out of README.md, so they cannot drift from
what works: a block that starts with a `colibri serve ...` line runs against a server
started with exactly those options, the others against a server started with none (the
bundled demo model). The one substitution is the port (127.0.0.1:8000 -> a free port), so
the test never collides with a server already running. The README's lists of refused and
ignored request fields are read too and checked field by field; GET /tokenizer_info is
checked the way lm-evaluation-harness' remote tokenizer uses it.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from colibri.engine.format.modelcheck import bundled_model_path
from tests.server_helpers import ROOT, SubprocessServer

README = (ROOT / "README.md").read_text(encoding="utf-8")
DEFAULT_URL = "127.0.0.1:8000"
MODEL = "demo_model"  # the bundled model's folder name: what the default server serves


def code_blocks(lang: str, must_contain: str) -> list[str]:
    blocks = re.findall(r"^```(\w*)\n(.*?)^```", README, flags=re.S | re.M)
    return [body for kind, body in blocks if kind == lang and must_contain in body]


class Servers:
    """Servers started on demand, one per distinct set of `colibri serve` options."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.running: dict[tuple[str, ...], SubprocessServer] = {}

    def get(self, args: tuple[str, ...] = ()) -> SubprocessServer:
        if args not in self.running:
            workdir = self.root / f"srv{len(self.running)}"
            self.running[args] = SubprocessServer(None, workdir, *args).wait_ready()
        return self.running[args]

    def stop(self) -> None:
        for srv in self.running.values():
            assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    s = Servers(tmp_path_factory.mktemp("readme"))
    yield s
    s.stop()


def _split_serve(block: str) -> tuple[tuple[str, ...], str]:
    """(options of a leading `colibri serve` line, the rest of the block)."""
    lines = block.splitlines()
    args: tuple[str, ...] = ()
    if lines and lines[0].startswith("colibri serve"):
        args = tuple(shlex.split(lines[0])[2:])
        lines = lines[1:]
    return args, "\n".join(lines) + "\n"


def _on_port(text: str, srv: SubprocessServer) -> str:
    assert DEFAULT_URL in text
    return text.replace(DEFAULT_URL, f"127.0.0.1:{srv.port}")


def test_readme_stays_a_page_and_links_docs_that_exist() -> None:
    """The README is for users: at most 300 lines, the rest in docs/ (every docs/ page it
    names exists)."""
    assert len(README.splitlines()) <= 300
    for page in set(re.findall(r"docs/[\w-]+\.md", README)):
        assert (ROOT / page).is_file(), page


def test_readme_has_the_examples() -> None:
    assert len(code_blocks("bash", "curl http")) >= 2
    assert len(code_blocks("python", "from openai import OpenAI")) >= 1


@pytest.mark.parametrize("index", range(len(code_blocks("bash", "curl http"))))
def test_curl_block_runs_as_printed(servers: Servers, index: int) -> None:
    args, script = _split_serve(code_blocks("bash", "curl http")[index])
    srv = servers.get(args)
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", _on_port(script, srv)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert '"error"' not in r.stdout, r.stdout
    n_calls = script.count("curl ")
    assert r.stdout.count('"choices"') >= n_calls, r.stdout
    if "stream" in script:
        assert "data: [DONE]" in r.stdout and '"usage"' in r.stdout


@pytest.mark.parametrize("index", range(len(code_blocks("python", "from openai import OpenAI"))))
def test_openai_sdk_block_runs_as_printed(servers: Servers, index: int) -> None:
    args, script = _split_serve(code_blocks("python", "from openai import OpenAI")[index])
    srv = servers.get(args)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", _on_port(script, srv)], capture_output=True,
                       text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert len([line for line in r.stdout.splitlines() if line.strip()]) >= 2, r.stdout


# -- the README's lists of refused and ignored fields -------------------------------------

def _readme_fields(lead: str) -> list[str]:
    """The field names a README paragraph starting with `lead` lists (first name per item)."""
    start = README.index(lead) + len(lead)
    para = README[start:README.index("\n\n", start)]
    para = re.sub(r"\([^)]*\)", "", para)  # explanations in parentheses name other fields
    names = [re.search(r"`([^`]+)`", item) for item in para.split(",")]
    return [m.group(1) for m in names if m]


CHAT = [{"role": "user", "content": "Good morrow!"}]
FUNCTION = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
REFUSED: dict[str, tuple[str, dict[str, Any]]] = {
    "chat_template": ("chat", {"chat_template": "{{ messages[0].content }}"}),
    "suffix": ("completions", {"suffix": " The end."}),
    "best_of": ("completions", {"best_of": 2}),
    "audio": ("chat", {"audio": {"voice": "alloy", "format": "wav"}}),
    "modalities": ("chat", {"modalities": ["text", "audio"]}),
    "prediction": ("chat", {"prediction": {"type": "content", "content": "x"}}),
    "web_search_options": ("chat", {"web_search_options": {}}),
    "functions": ("chat", {"functions": [FUNCTION["function"]]}),
    "function_call": ("chat", {"function_call": "auto"}),
}
IGNORED: dict[str, dict[str, Any]] = {
    "user": {"user": "user-1"},
    "name": {"messages": [{"role": "user", "content": "Good morrow!", "name": "juliet"}]},
    "store": {"store": False},
    "metadata": {"metadata": {"k": "v"}},
    "service_tier": {"service_tier": "auto"},
    "prompt_cache_key": {"prompt_cache_key": "k1"},
    "safety_identifier": {"safety_identifier": "s1"},
}


def _post(srv: SubprocessServer, kind: str, extra: dict[str, Any]) -> httpx.Response:
    if kind == "chat":
        body: dict[str, Any] = {"model": MODEL, "messages": CHAT, "max_tokens": 8, "seed": 3}
        path = "/v1/chat/completions"
    else:
        body = {"model": MODEL, "prompt": "ROMEO.\n", "max_tokens": 8, "seed": 3}
        path = "/v1/completions"
    return httpx.post(srv.url + path, json={**body, **extra}, timeout=120)


def test_readme_field_lists_are_the_tested_ones() -> None:
    assert _readme_fields("Refused with a 400 that names the field:") == list(REFUSED)
    assert _readme_fields("Ignored (accepted, no effect):") == list(IGNORED)


@pytest.mark.parametrize("field", list(REFUSED))
def test_refused_field_is_a_400_naming_it(servers: Servers, field: str) -> None:
    kind, extra = REFUSED[field]
    r = _post(servers.get(), kind, extra)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


@pytest.mark.parametrize("field", [*IGNORED, "a_field_from_the_future"])
def test_ignored_field_changes_nothing(servers: Servers, field: str) -> None:
    srv = servers.get()
    extra = IGNORED.get(field, {field: 1})
    base = _post(srv, "chat", {})
    r = _post(srv, "chat", extra)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"] == base.json()["choices"][0]["message"]


# -- GET /tokenizer_info, as lm-evaluation-harness' remote tokenizer reads it --------------

def test_tokenizer_info_for_lm_eval(servers: Servers) -> None:
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from transformers import AutoTokenizer

    srv = servers.get()
    hf = AutoTokenizer.from_pretrained(bundled_model_path())
    # the harness strips /v1/completions from base_url and probes the server root
    base = (srv.url + "/v1/completions").replace("/v1/completions", "")
    info = httpx.get(base + "/tokenizer_info", timeout=30).json()
    assert info["eos_token"] == hf.eos_token and info["bos_token"] == hf.bos_token
    assert info["pad_token"] == hf.pad_token
    assert info["model_max_length"] == info["max_model_len"] > 0

    def encode(text: str) -> list[int]:
        r = httpx.post(base + "/tokenize", json={"prompt": text, "add_special_tokens": False},
                       timeout=30)
        return list(r.json()["tokens"])

    assert encode("test") == hf("test", add_special_tokens=False)["input_ids"]
    assert encode(info["eos_token"])[0] == hf.eos_token_id == info["eos_token_id"]
    # inside longer text, special-token text stays plain, as in generation
    assert hf.eos_token_id not in encode("x" + info["eos_token"])
    ids = encode("Wherefore art thou?")
    text = httpx.post(base + "/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
    assert text == "Wherefore art thou?"
    rendered = ImmutableSandboxedEnvironment().from_string(info["chat_template"]).render(
        messages=CHAT, add_generation_prompt=True)
    assert rendered == hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)


def test_accept_any_model(servers: Servers) -> None:
    strict = _post(servers.get(), "chat", {"model": "llama3:latest"})
    assert strict.status_code == 404 and strict.json()["error"]["param"] == "model"
    lax = servers.get(("--accept-any-model",))
    r = _post(lax, "chat", {"model": "llama3:latest"})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == MODEL  # the response names the model that answered
    assert httpx.get(lax.url + "/v1/models/llama3:latest", timeout=30).status_code == 200


def test_tokenizer_info_needs_the_key_when_one_is_set(servers: Servers) -> None:
    srv = servers.get(("--served-model-name", "my-moe", "--api-key", "sk-local"))
    assert httpx.get(srv.url + "/tokenizer_info", timeout=30).status_code == 401
    r = httpx.get(srv.url + "/tokenizer_info", headers={"Authorization": "Bearer sk-local"},
                  timeout=30)
    assert r.status_code == 200 and r.json()["eos_token"]

"""Client chat templates (opt-in) stay inside their size, memory and time limits and stop
when their client leaves: they render in a separate, killable process."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine.template_sandbox import TemplateStoppedError
from engine.tokenizer import ChatTemplateError, Tokenizer
from tests.server_helpers import SubprocessServer, tiny_model, wait_for

MSG = [{"role": "user", "content": "hi"}]
HOSTILE = [
    "{% set s='a'|center(500000000) %}{{ s|length }}",
    "{% set ns=namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}{{ ns.s|length }}",
    "{{ '{:>900000000}'.format('a')|length }}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{{ lipsum(n=100000) }}",
    "{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}",
]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("tpl") / "model")


@pytest.mark.parametrize("template", HOSTILE)
def test_hostile_templates_are_stopped(model: Path, template: str) -> None:
    tok = Tokenizer.from_dir(model)
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template(MSG, chat_template=template, allow_custom_template=True,
                                render_timeout_s=1.0)


def test_cancel_stops_a_running_render(model: Path) -> None:
    tok = Tokenizer.from_dir(model)
    cancel = threading.Event()
    threading.Timer(0.3, cancel.set).start()
    with pytest.raises(TemplateStoppedError, match="client left"):
        tok.apply_chat_template(MSG, chat_template=HOSTILE[3], allow_custom_template=True,
                                render_timeout_s=60.0, cancel=cancel)


def test_client_template_still_renders_like_in_process(model: Path) -> None:
    tok = Tokenizer.from_dir(model)
    tpl = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
    ids = tok.apply_chat_template(MSG, chat_template=tpl, allow_custom_template=True)
    assert tok.decode(ids, skip_special_tokens=False) == "<|user|>hi"


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _render_children(pid: int) -> set[int]:
    out = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                cmd = Path(f"/proc/{child}/cmdline").read_bytes()
            except OSError:
                continue
            if b"engine.template_sandbox" in cmd:
                out.add(int(child))
    return out


@pytest.fixture(scope="module")
def server(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SubprocessServer]:
    srv = SubprocessServer(model, tmp_path_factory.mktemp("run"),
                           "--allow-client-chat-template",
                           env={"COLIBRI_CLIENT_TEMPLATE_TIMEOUT_S": "60"}).wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log()


def test_server_memory_stays_flat(server: SubprocessServer) -> None:
    url = server.url + "/v1/chat/completions"
    body = {"messages": MSG, "max_tokens": 1}
    before = _rss_kb(server.proc.pid)
    for tpl in HOSTILE[:3]:
        r = httpx.post(url, json={**body, "chat_template": tpl}, timeout=120)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] in ("chat_template", "messages")
    r = httpx.post(url, json={**body, "chat_template": "{% set s='a'|center(50000000) %}"
                              "{{ s|length }}"}, timeout=120)
    assert r.status_code in (200, 400), r.text
    assert _rss_kb(server.proc.pid) - before < 40_000  # the 50 MB string lived elsewhere


def test_render_stops_when_the_client_leaves(server: SubprocessServer) -> None:
    url = server.url + "/v1/chat/completions"
    ok = httpx.post(url, json={"messages": MSG, "max_tokens": 1,
                               "chat_template": "{{ messages[0].content }}"}, timeout=60)
    assert ok.status_code == 200
    idle = _render_children(server.proc.pid)
    assert idle, "no render process after a client template"
    with pytest.raises(httpx.TimeoutException):
        httpx.post(url, json={"messages": MSG, "chat_template": HOSTILE[3]}, timeout=1.0)
    # the render (60 s budget) was running in one of those processes: it is killed now
    wait_for(lambda: not (idle & _render_children(server.proc.pid)), 20, "render killed")
    after = httpx.post(url, json={"messages": MSG, "max_tokens": 1,
                                  "chat_template": "{{ messages[0].content }}"}, timeout=60)
    assert after.status_code == 200
    assert os.path.exists(f"/proc/{server.proc.pid}")

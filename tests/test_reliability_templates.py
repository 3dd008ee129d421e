"""Chat templates stay inside their size, memory and time limits and stop when their client
leaves: client templates (opt-in) and the model's own template render in a separate,
killable process. A client template past a limit is a 400; the model's template past a
limit is a 500 naming the model's template, and the next request is served."""

from __future__ import annotations

import json
import os
import resource
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from colibri.engine.text.errors import ChatTemplateError, ModelTemplateError, TemplateLimitError
from colibri.engine.text.template_sandbox import TemplateStoppedError
from colibri.engine.text.tokenizer import Tokenizer
from tests.server_helpers import (
    SubprocessServer,
    child_processes,
    rss_kb,
    tiny_model,
    wait_for,
)

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


def test_a_client_template_is_never_evaluated_in_the_server_process(model: Path) -> None:
    """Reading which variables a template uses must not compile it here: jinja2's compiler
    folds constants, and `'a' * 10**9` would be built in this process, outside the render
    limits (seconds and a gigabyte)."""
    tok = Tokenizer.from_dir(model)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(TemplateLimitError) as err:
        tok.apply_chat_template(MSG, chat_template="{{ 'a' * 1000000000 }}",
                                allow_custom_template=True, render_timeout_s=2.0)
    assert err.value.param == "chat_template" and "size cap" in str(err.value)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000


def test_cancel_stops_a_running_render(model: Path) -> None:
    tok = Tokenizer.from_dir(model)
    cancel = threading.Event()
    threading.Timer(0.3, cancel.set).start()
    with pytest.raises(TemplateStoppedError, match="client left"):
        tok.apply_chat_template(MSG, chat_template=HOSTILE[3], allow_custom_template=True,
                                render_timeout_s=60.0, cancel=cancel)


def test_a_render_starved_of_cpu_is_slowed_not_stopped() -> None:
    """The time limit is the render's CPU time: a render process that gets no CPU for longer
    than the limit (stopped here, as on a machine busy with other work) finishes once it
    runs, while a render that burns its CPU budget is still stopped."""
    import signal
    import time

    from colibri.engine.text.template_sandbox import TemplateBudgetError, TemplateSandbox

    sandbox = TemplateSandbox()
    try:
        assert sandbox.render("{{ 'ready' }}", {}, 100) == "ready"
        (worker,) = sandbox._pool._idle  # the render process the next call reuses
        os.kill(worker.proc.pid, signal.SIGSTOP)
        threading.Timer(1.5, os.kill, (worker.proc.pid, signal.SIGCONT)).start()
        start = time.monotonic()
        assert sandbox.render("{{ 'late' }}", {}, 100, timeout_s=0.5) == "late"
        assert time.monotonic() - start >= 1.5
        start = time.monotonic()
        with pytest.raises(TemplateBudgetError, match="within 0.5 s"):
            sandbox.render(HOSTILE[3], {}, 100, timeout_s=0.5)
        assert time.monotonic() - start < 5.0
    finally:
        sandbox.close()


def test_client_template_still_renders_like_in_process(model: Path) -> None:
    tok = Tokenizer.from_dir(model)
    tpl = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
    ids = tok.apply_chat_template(MSG, chat_template=tpl, allow_custom_template=True)
    assert tok.decode(ids, skip_special_tokens=False) == "<|user|>hi"


def _renderers(pid: int) -> set[int]:
    return child_processes(pid, "colibri.engine.text.template_sandbox")


@pytest.fixture(scope="module")
def server(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SubprocessServer]:
    srv = SubprocessServer(model, tmp_path_factory.mktemp("run"),
                           "--allow-client-chat-template",
                           env={"COLIBRI_CLIENT_TEMPLATE_TIMEOUT_S": "60"}).wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.mark.slow  # seconds: left out of the quick pass, run by the whole suite
def test_server_memory_stays_flat(server: SubprocessServer) -> None:
    url = server.url + "/v1/chat/completions"
    body = {"messages": MSG, "max_tokens": 1}
    before = rss_kb(server.proc.pid)
    for tpl in HOSTILE[:3]:
        r = httpx.post(url, json={**body, "chat_template": tpl}, timeout=120)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] in ("chat_template", "messages")
    r = httpx.post(url, json={**body, "chat_template": "{% set s='a'|center(50000000) %}"
                              "{{ s|length }}"}, timeout=120)
    assert r.status_code in (200, 400), r.text
    assert rss_kb(server.proc.pid) - before < 40_000  # the 50 MB string lived elsewhere


def test_render_stops_when_the_client_leaves(server: SubprocessServer) -> None:
    url = server.url + "/v1/chat/completions"
    ok = httpx.post(url, json={"messages": MSG, "max_tokens": 1,
                               "chat_template": "{{ messages[0].content }}"}, timeout=60)
    assert ok.status_code == 200
    idle = _renderers(server.proc.pid)
    assert idle, "no render process after a client template"
    with pytest.raises(httpx.TimeoutException):
        httpx.post(url, json={"messages": MSG, "chat_template": HOSTILE[3]}, timeout=1.0)
    # the render (60 s budget) was running in one of those processes: it is killed now
    wait_for(lambda: not (idle & _renderers(server.proc.pid)), 20, "render killed")
    after = httpx.post(url, json={"messages": MSG, "max_tokens": 1,
                                  "chat_template": "{{ messages[0].content }}"}, timeout=60)
    assert after.status_code == 200
    assert os.path.exists(f"/proc/{server.proc.pid}")


# -- the model's own template: same process, limits and stop as a client's --------------------
SPIN = ("{% if messages[0].content == 'spin' %}{% for i in range(100000) %}"
        "{% for j in range(100000) %}{% endfor %}{% endfor %}{% endif %}")


@pytest.fixture(scope="module")
def spinning_model(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a chat_template.jinja that loops for hours on one message and
    renders its usual ChatML for every other."""
    folder = Path(shutil.copytree(model, tmp_path_factory.mktemp("spin") / "model"))
    usual = json.loads((folder / "tokenizer_config.json").read_text())["chat_template"]
    (folder / "chat_template.jinja").write_text(SPIN + usual)
    return folder


def test_model_template_is_stopped_at_its_time_limit(spinning_model: Path) -> None:
    tok = Tokenizer.from_dir(spinning_model)
    with pytest.raises(ModelTemplateError, match="model's chat template.*within 0.5 s"):
        tok.apply_chat_template([{"role": "user", "content": "spin"}], render_timeout_s=0.5)
    ids = tok.apply_chat_template(MSG, render_timeout_s=0.5)
    assert tok.decode(ids, skip_special_tokens=False).endswith(
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_model_template_past_its_output_cap_is_a_model_error(model: Path,
                                                             tmp_path: Path) -> None:
    folder = Path(shutil.copytree(model, tmp_path / "model"))
    (folder / "chat_template.jinja").write_text("{% for i in range(100000) %}"
                                                "{{ 'x' * 100000 }}{% endfor %}")
    with pytest.raises(ModelTemplateError, match="output exceeds") as exc:
        Tokenizer.from_dir(folder).apply_chat_template(MSG, render_timeout_s=60.0)
    assert not isinstance(exc.value, ValueError)  # not the request's fault (that is a 400)


@pytest.mark.parametrize("template,words", [
    ("{{ raise_exception.__globals__['os'] }}", "__globals__"),
    ("{% include 'other.jinja' %}", "other.jinja"),
    ("{% for m in messages %}{{ m.content ", "does not compile"),
])
def test_model_template_at_fault_whatever_the_input_is_a_model_error(
        model: Path, tmp_path: Path, template: str, words: str) -> None:
    """The model folder's template reaching past the sandbox or not compiling is the model's
    fault (500), not the client's (it was a 400 naming `messages`)."""
    folder = Path(shutil.copytree(model, tmp_path / "model"))
    (folder / "chat_template.jinja").write_text(template)
    with pytest.raises(ModelTemplateError, match="model's chat template") as exc:
        Tokenizer.from_dir(folder).apply_chat_template(MSG)
    assert words in str(exc.value) and not isinstance(exc.value, ValueError)


def test_model_template_refusing_the_messages_is_the_requests_error(model: Path,
                                                                     tmp_path: Path) -> None:
    """`raise_exception` is the template refusing what it was given: still a 400."""
    folder = Path(shutil.copytree(model, tmp_path / "model"))
    (folder / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message must "
        "come first') }}{% endif %}{{ messages[0]['content'] }}")
    with pytest.raises(ChatTemplateError, match="a system message must come first") as exc:
        Tokenizer.from_dir(folder).apply_chat_template(MSG)
    assert exc.value.param == "messages"


@pytest.mark.slow  # seconds: left out of the quick pass, run by the whole suite
def test_server_answers_500_for_a_spinning_model_template_and_keeps_serving(
        spinning_model: Path, tmp_path: Path) -> None:
    srv = SubprocessServer(spinning_model, tmp_path / "run",
                           env={"COLIBRI_MODEL_TEMPLATE_TIMEOUT_S": "1"}).wait_ready()
    try:
        spin = [{"role": "user", "content": "spin"}]
        # the loop runs for hours: without the limit these requests would hit the client's
        # 60 s timeout instead of answering
        for path, body in (("/v1/chat/completions", {"messages": spin, "max_tokens": 1}),
                           ("/tokenize", {"messages": spin})):
            r = httpx.post(srv.url + path, json=body, timeout=60)
            assert r.status_code == 500, r.text
            err = r.json()["error"]
            assert err["code"] == "model_chat_template_failed", err
            assert err["type"] == "internal_error"
            assert "model's chat template" in err["message"]
            assert "did not render within 1 s" in err["message"]
            assert "chat_template.jinja" in err["message"]
        # the stopped render left nothing behind: the next requests are served (seeded: an
        # unseeded draw of the tiny random model ends on its EOS within two tokens about 2%
        # of the time)
        ok = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                        json={"messages": MSG, "max_tokens": 2, "seed": 1})
        assert ok.status_code == 200, ok.text
        assert ok.json()["choices"][0]["finish_reason"] == "length"
        assert httpx.get(srv.url + "/ready", timeout=10).status_code == 200
    finally:
        rc = srv.stop()
    assert rc == 0, srv.log()
    assert "Traceback" not in srv.log()
    assert "model's chat template could not be rendered" in srv.log()

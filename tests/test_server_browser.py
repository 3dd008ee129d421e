"""End to end in a browser: the chat page at / in headless Chromium (Debian `chromium`),
driven over the DevTools protocol, streams a reply to a message.

The page must show the text as it streams (several partial renders before the reply ends,
watched by a MutationObserver) and end with exactly the text the API returns for the same seed.
A long conversation must never overflow the context (older turns left out, the reply capped),
a failed turn must not be sent again, and "New chat" must start over. The status line gives a
tokens/s rate only over enough tokens and time to mean something (a reply of a few tokens
shows its count and time instead).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.browser_helpers import DevTools, chromium_page
from tests.server_helpers import SubprocessServer, tiny_model, wait_for

MODEL = "tiny-chat"
N_CTX = 512
SETTINGS = {"seed": 42, "temperature": 0.8, "max-tokens": 120}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SubprocessServer]:
    tmp = tmp_path_factory.mktemp("browser")
    model = tiny_model(tmp / "model", max_position_embeddings=N_CTX)
    srv = SubprocessServer(model, tmp / "run", "--served-model-name", MODEL,
                           "--n-ctx", str(N_CTX)).wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevTools]:
    with chromium_page(tmp_path_factory.mktemp("chromium-profile")) as devtools:
        yield devtools


def test_chat_page_streams_a_reply(server: SubprocessServer, page: DevTools) -> None:
    page.call("Page.enable")
    page.call("Page.navigate", url=server.url + "/")
    wait_for(lambda: page.eval("document.readyState") == "complete", 30, "page load")
    wait_for(lambda: page.eval("document.getElementById('model').textContent") == MODEL,
             30, "the model name on the page")
    for field, value in SETTINGS.items():
        page.eval(f"document.getElementById({field!r}).value = {json.dumps(str(value))}")
    page.eval("""
        window.updates = [];
        new MutationObserver(() => {
            const m = document.querySelector('.msg.assistant');
            if (m) window.updates.push([m.dataset.done, m.textContent.length]);
        }).observe(document.getElementById('log'),
                   {childList: true, subtree: true, characterData: true});
        document.getElementById('input').value = 'Tell me about the river.';
        document.getElementById('form').requestSubmit();
    """)
    done = "document.querySelector('.msg.assistant') && " \
           "document.querySelector('.msg.assistant').dataset.done === 'true'"
    t0 = time.monotonic()
    wait_for(lambda: page.eval(done), 60, "the reply to finish")
    shown = page.eval("document.querySelector('.msg.assistant').textContent")
    status = page.eval("document.getElementById('status').textContent")
    updates = page.eval("window.updates")
    assert page.eval("document.querySelector('.msg.assistant').className") == "msg assistant"
    assert status.startswith("done"), status

    # the same request through the API, not streamed
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Tell me about the river."}],
        "temperature": SETTINGS["temperature"], "max_tokens": SETTINGS["max-tokens"],
        "seed": SETTINGS["seed"], "stream": False})
    expected = r.json()["choices"][0]["message"]["content"]
    assert shown == expected and len(expected) > 0

    # streamed: the text grew over several renders while the reply was still coming, not
    # in one go at the end (how far apart they are depends on the machine, so not checked)
    lengths = [n for _, n in updates if n > 0]
    assert len(set(lengths)) >= 3, updates
    partial = {n for done, n in updates if done == "false" and 0 < n < len(shown)}
    assert len(partial) >= 2, updates
    assert time.monotonic() - t0 < 60


def _open_page(server: SubprocessServer, page: DevTools) -> None:
    page.call("Page.enable")
    page.call("Page.navigate", url=server.url + "/")
    wait_for(lambda: page.eval("document.readyState") == "complete", 30, "page load")
    wait_for(lambda: page.eval("document.getElementById('model').textContent") == MODEL,
             30, "the model name on the page")


def _say(page: DevTools, text: str) -> dict[str, Any]:
    """Send text from the page; wait for the reply; its element's class, text and status."""
    n = page.eval("document.querySelectorAll('.msg.assistant, .msg.error').length")
    page.eval(f"document.getElementById('input').value = {json.dumps(text)};"
              "document.getElementById('form').requestSubmit();")
    last = "[...document.querySelectorAll('.msg.assistant, .msg.error')].at(-1)"
    wait_for(lambda: page.eval(f"document.querySelectorAll('.msg.assistant, .msg.error')"
                               f".length > {n} && {last}.dataset.done === 'true'"),
             120, "the reply to finish")
    return {"class": page.eval(f"{last}.className"), "text": page.eval(f"{last}.textContent"),
            "status": page.eval("document.getElementById('status').textContent"),
            "request": page.eval("window.lastRequest")}


# the page's thresholds for a rate (app/static/app.js)
RATE_MIN_TOKENS, RATE_MIN_MS = 8, 250
SPEED = re.compile(r", (\d+) tokens?(?:, ([\d.]+) tok/s| in ([\d.]+) s)")


def _check_speed(status: str) -> int:
    """The status names the reply's tokens, with a rate only over enough of them; returns
    how many tokens it names."""
    m = SPEED.search(status)
    assert m is not None, status
    n = int(m.group(1))
    if m.group(2) is not None:
        assert n - 1 >= RATE_MIN_TOKENS, status
    return n


def _prompt_tokens(server: SubprocessServer, messages: list[dict[str, str]]) -> int:
    r = httpx.post(server.url + "/tokenize", json={"messages": messages}, timeout=30)
    return int(r.json()["count"])


LONG = " ".join(["The teacher wrote a long sentence on the blackboard."] * 12)


def test_chat_page_never_overflows_the_context(server: SubprocessServer,
                                               page: DevTools) -> None:
    _open_page(server, page)
    assert page.eval("document.getElementById('ctx').textContent") == f"context {N_CTX} tokens"
    page.eval("document.getElementById('new-chat').click()")
    page.eval("document.getElementById('max-tokens').value = '200';"
              "document.getElementById('seed').value = '5';")
    firsts = []
    for turn in range(4):
        text = f"Turn {turn}. {LONG}"
        firsts.append(text)
        res = _say(page, text)
        # every turn succeeds: older turns are left out, or the reply is capped
        assert res["class"] == "msg assistant", res
        assert res["status"].startswith("done"), res
        req = res["request"]
        assert req["messages"][-1]["content"] == text
        n_prompt = _prompt_tokens(server, req["messages"])
        assert n_prompt + req["max_tokens"] <= N_CTX, (n_prompt, req["max_tokens"])
        _check_speed(res["status"])
    # by now the first turns no longer fit: they were left out, and shown as such
    assert firsts[0] not in [m["content"] for m in req["messages"]]
    assert "left out" in res["status"], res["status"]
    assert page.eval("document.querySelectorAll('.msg.trimmed').length") >= 2


def test_failed_turn_is_dropped_and_new_chat_starts_over(server: SubprocessServer,
                                                         page: DevTools) -> None:
    _open_page(server, page)
    page.eval("document.getElementById('new-chat').click()")
    page.eval("document.getElementById('max-tokens').value = '16';")
    ok = _say(page, "Hello!")
    assert ok["class"] == "msg assistant", ok
    too_long = " ".join([LONG] * 6)  # longer than the whole context alone
    assert _prompt_tokens(server, [{"role": "user", "content": too_long}]) > N_CTX
    bad = _say(page, too_long)
    assert bad["class"] == "msg error" and "context" in bad["text"], bad
    after = _say(page, "Are you still there?")
    assert after["class"] == "msg assistant", after
    sent = [m["content"] for m in after["request"]["messages"]]
    assert sent[0] == "Hello!" and too_long not in sent and len(sent) == 3
    page.eval("document.getElementById('new-chat').click()")
    assert page.eval("document.getElementById('log').children.length") == 0
    fresh = _say(page, "A new start.")
    assert fresh["class"] == "msg assistant"
    assert [m["content"] for m in fresh["request"]["messages"]] == ["A new start."]


def test_a_rate_is_shown_only_over_enough_tokens_and_time(server: SubprocessServer,
                                                           page: DevTools) -> None:
    _open_page(server, page)

    def speed(n: int, sent: float, first: float, last: float) -> str:
        return str(page.eval(f"speed({{completion_tokens: {n}}}, {sent}, {first}, {last})"))

    # 5 tokens, the last 4 within 2.5 ms: "1600 tok/s" would say nothing about the model
    assert speed(5, 0, 100, 102.5) == ", 5 tokens in 0.10 s"
    assert speed(1, 0, 40, 40) == ", 1 token in 0.04 s"
    assert speed(8, 0, 100, 5100) == ", 8 tokens in 5.10 s"  # 7 after the first: too few
    assert speed(50, 0, 100, 300) == ", 50 tokens in 0.30 s"  # 200 ms: too short
    assert speed(50, 0, 100, 2100) == ", 50 tokens, 24.5 tok/s"
    assert speed(9, 0, 100, 350) == ", 9 tokens, 32.0 tok/s"  # just enough of both

    # a short reply end to end: its count and time, no rate
    page.eval("document.getElementById('new-chat').click()")
    page.eval("document.getElementById('max-tokens').value = '5';"
              "document.getElementById('seed').value = '3';")
    res = _say(page, "Hello!")
    assert res["class"] == "msg assistant", res
    assert "tok/s" not in res["status"], res["status"]
    assert 1 <= _check_speed(res["status"]) <= 5
    assert re.search(r" in [\d.]+ s", res["status"]), res["status"]

"""Reasoning through the Messages API, on the thinking-template model whose greedy reply is
scripted (tests/test_reasoning_serving.py has the chat and Responses side): the same reasoning
and answer as chat completions, as a thinking block and a text block (streamed as
thinking_delta and text_delta), `thinking: disabled` switching the template's thinking off,
`display: "omitted"` keeping the block without its text, and earlier thinking blocks sent
back as the assistant's reasoning."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.server_helpers import SubprocessServer
from tests.test_reasoning_serving import ANSWER, MESSAGES, RAW, REASONING, TEMPLATE
from tests.test_server_messages import _check_order, _events, _streamed
from tests.tiny_models import make_scripted_checkpoint

GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SubprocessServer]:
    tmp = tmp_path_factory.mktemp("messages-reasoning")
    model = make_scripted_checkpoint(tmp / "model", TEMPLATE, "assistant\n<think>\n", RAW)
    srv = SubprocessServer(model, tmp / "run", "--served-model-name", "m").wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server: SubprocessServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0,
                               timeout=60)


def _create(client: anthropic.Anthropic, **kw: Any) -> Any:
    return client.messages.create(model="m", max_tokens=64, messages=MESSAGES,
                                  extra_body={**GREEDY, **kw.pop("extra_body", {})}, **kw)


def test_thinking_and_text_blocks_match_chat(client: anthropic.Anthropic,
                                             server: SubprocessServer) -> None:
    chat = openai.OpenAI(base_url=server.url + "/v1", api_key="unused").chat.completions.create(
        model="m", messages=MESSAGES, temperature=0)
    msg = chat.choices[0].message
    assert (msg.reasoning_content, msg.content) == (REASONING, ANSWER)
    for thinking in (None, {"type": "adaptive"}, {"type": "enabled", "budget_tokens": 2048}):
        kw = {} if thinking is None else {"thinking": thinking}
        m = _create(client, **kw)
        assert [b.type for b in m.content] == ["thinking", "text"]
        assert (m.content[0].thinking, m.content[1].text) == (REASONING, ANSWER)
        assert m.stop_reason == "end_turn"
    events = _events(server, {"model": "m", "max_tokens": 64, "messages": MESSAGES,
                              "temperature": 0}, key="unused")
    _check_order(events)
    thinking, text = _streamed(events)
    assert (thinking["type"], thinking["thinking"], thinking["signature"]) == (
        "thinking", REASONING, "")
    assert (text["type"], text["text"]) == ("text", ANSWER)
    with client.messages.stream(model="m", max_tokens=64, messages=MESSAGES,
                                extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert (final.content[0].thinking, final.content[1].text) == (REASONING, ANSWER)


def test_thinking_disabled_reaches_the_template(client: anthropic.Anthropic) -> None:
    on = _create(client)
    off = _create(client, thinking={"type": "disabled"})
    # the template closed <think> itself (a longer prompt): the same words are all answer
    assert [b.type for b in off.content] == ["text"] and off.content[0].text == RAW
    n_on = client.messages.count_tokens(model="m", messages=MESSAGES)
    n_off = client.messages.count_tokens(model="m", messages=MESSAGES,
                                         thinking={"type": "disabled"})
    assert n_off.input_tokens > n_on.input_tokens
    for m, n in ((on, n_on), (off, n_off)):  # prompt tokens, the cached ones included
        assert m.usage.input_tokens + m.usage.cache_read_input_tokens == n.input_tokens
    # Claude Code's adaptive thinking with an effort keeps it on
    high = _create(client, thinking={"type": "adaptive"},
                   extra_body={"output_config": {"effort": "high"}})
    assert high.content[0].thinking == REASONING


def test_omitted_thinking_keeps_the_block_without_its_text(client: anthropic.Anthropic,
                                                           server: SubprocessServer) -> None:
    thinking = {"type": "adaptive", "display": "omitted"}
    m = _create(client, extra_body={"thinking": thinking})
    assert [(b.type, getattr(b, "thinking", None)) for b in m.content] == [
        ("thinking", ""), ("text", None)]
    assert m.content[1].text == ANSWER
    events = _events(server, {"model": "m", "max_tokens": 64, "messages": MESSAGES,
                              "temperature": 0, "thinking": thinking}, key="unused")
    _check_order(events)
    assert not any(d["delta"]["type"] == "thinking_delta" for n, d in events
                   if n == "content_block_delta")
    assert [b["type"] for b in _streamed(events)] == ["thinking", "text"]


def test_earlier_thinking_goes_back_as_reasoning(server: SubprocessServer) -> None:
    history = [*MESSAGES,
               {"role": "assistant", "content": [
                   {"type": "thinking", "thinking": REASONING, "signature": "sig"},
                   {"type": "redacted_thinking", "data": "opaque"},
                   {"type": "text", "text": ANSWER}]},
               {"role": "user", "content": "Again?"}]
    r = httpx.post(server.url + "/v1/messages", timeout=60, json={
        "model": "m", "max_tokens": 64, "temperature": 0, "messages": history})
    assert r.status_code == 200, r.text
    plain = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "m", "temperature": 0, "messages": [
            *MESSAGES, {"role": "assistant", "content": ANSWER,
                        "reasoning_content": REASONING},
            {"role": "user", "content": "Again?"}]}).json()
    usage = r.json()["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] \
        == plain["usage"]["prompt_tokens"]
    blocks = r.json()["content"]
    assert blocks[0]["thinking"] == plain["choices"][0]["message"]["reasoning_content"]

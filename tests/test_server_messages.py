"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) through the official
`anthropic` SDK and raw HTTP, against `python -m colibri.app serve` on the bundled model with a
template that renders tools (its words are Shakespeare; every tool input that validates does
so because the server constrains it).

Each answer is checked against what the same request gives on the chat path at temperature 0
(the same plan and generation), against Anthropic's documented shapes (event order, stop
reasons, usage, error bodies) and against the request's own schemas.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.server_helpers import SubprocessServer, tool_template_model

KEY = "sk-messages"
MODEL = "tiny"
N_CTX = 2048
GREEDY = {"temperature": 0}  # the SDK has no sampling arguments: they go in the body
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "Forecast", "input_schema": WEATHER},
         {"name": "get_time", "description": "Clock",
          "input_schema": {"type": "object", "properties": {}}}]
ASK = [{"role": "user", "content": "Weather in Verona for three days?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SubprocessServer]:
    tmp = tmp_path_factory.mktemp("messages")
    srv = SubprocessServer(tool_template_model(tmp / "model"), tmp / "run", "--api-key", KEY,
                           "--served-model-name", MODEL, "--n-ctx", str(N_CTX)).wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server: SubprocessServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oai(server: SubprocessServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _post(server: SubprocessServer, body: dict[str, Any], path: str = "/v1/messages",
          **headers: str) -> httpx.Response:
    headers = headers or {"x-api-key": KEY}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=120)


def _events(server: SubprocessServer, body: dict[str, Any],
            key: str = KEY) -> list[tuple[str, dict[str, Any]]]:
    """The (event name, data) pairs of a streamed answer, checking each `event:` line names
    its data's type."""
    events = []
    with httpx.stream("POST", server.url + "/v1/messages", json={**body, "stream": True},
                      headers={"x-api-key": key}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith(
            "text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                assert data["type"] == name
                events.append((name, data))
                name = None
    return events


def _check_order(events: list[tuple[str, dict[str, Any]]]) -> None:
    """message_start, ping, blocks (start, deltas, stop; indices 0, 1, ...), message_delta,
    message_stop: Anthropic's documented sequence."""
    names = [n for n, _ in events]
    assert names[:2] == ["message_start", "ping"]
    assert names[-2:] == ["message_delta", "message_stop"]
    index, open_block = -1, None
    for name, data in events[2:-2]:
        if name == "content_block_start":
            assert open_block is None and data["index"] == index + 1
            index, open_block = data["index"], data["content_block"]["type"]
        elif name == "content_block_delta":
            assert data["index"] == index and open_block is not None
            want = {"text": ("text_delta",), "tool_use": ("input_json_delta",),
                    "thinking": ("thinking_delta", "signature_delta")}[open_block]
            assert data["delta"]["type"] in want
        else:
            assert name == "content_block_stop" and data["index"] == index
            open_block = None
    assert open_block is None


def _streamed(events: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The content blocks a stream adds up to (tool inputs as their JSON text)."""
    blocks: list[dict[str, Any]] = []
    fields = {"text_delta": ("text", "text"), "input_json_delta": ("partial", "partial_json"),
              "thinking_delta": ("thinking", "thinking"),
              "signature_delta": ("signature", "signature")}
    for name, data in events:
        if name == "content_block_start":
            blocks.append(dict(data["content_block"], partial=""))
        elif name == "content_block_delta":
            key, field = fields[data["delta"]["type"]]
            blocks[-1][key] += data["delta"][field]
    return blocks


# -- plain messages -------------------------------------------------------------------------
def test_plain_message_is_the_chat_answer(client: anthropic.Anthropic,
                                          oai: openai.OpenAI) -> None:
    m = client.messages.create(model=MODEL, max_tokens=24, system="Speak plainly.",
                               messages=[{"role": "user", "content": "Good morrow!"}],
                               extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.model == MODEL and m.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    chat = oai.chat.completions.create(
        model=MODEL, max_tokens=24, temperature=0,
        messages=[{"role": "system", "content": "Speak plainly."},
                  {"role": "user", "content": "Good morrow!"}])
    assert m.content[0].text == chat.choices[0].message.content
    assert m.usage.output_tokens == chat.usage.completion_tokens
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason] \
        == m.stop_reason


def test_system_blocks_with_cache_control(client: anthropic.Anthropic) -> None:
    """Blocks are joined as sent, cache_control changes nothing; system messages inside
    messages are rendered where they stand."""
    blocks = [{"type": "text", "text": "Speak ", "cache_control": {"type": "ephemeral"}},
              {"type": "text", "text": "plainly.", "cache_control": {"type": "ephemeral",
                                                                    "ttl": "1h"}}]
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Good morrow!",
                                          "cache_control": {"type": "ephemeral"}}]}]
    a = client.messages.create(model=MODEL, max_tokens=12, system=blocks, messages=msgs,
                               extra_body=GREEDY)
    b = client.messages.create(model=MODEL, max_tokens=12, system="Speak plainly.",
                               messages=[{"role": "user", "content": "Good morrow!"}],
                               extra_body=GREEDY)
    assert a.content[0].text == b.content[0].text and a.usage == b.usage
    inner = [{"role": "system", "content": "Be brief."}, *msgs]
    n_plain = client.messages.count_tokens(model=MODEL, system=blocks, messages=msgs)
    n_inner = client.messages.count_tokens(model=MODEL, system=blocks, messages=inner)
    assert n_inner.input_tokens > n_plain.input_tokens


def test_stream_event_order_and_text(client: anthropic.Anthropic,
                                     server: SubprocessServer) -> None:
    body = {"model": MODEL, "max_tokens": 40, "temperature": 0,
            "messages": [{"role": "user", "content": "Tell me a tale."}]}
    events = _events(server, body)
    _check_order(events)
    final = _post(server, body).json()
    assert [b["text"] for b in _streamed(events)] == [final["content"][0]["text"]]
    start, delta = events[0][1]["message"], events[-2][1]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] == final["usage"]["input_tokens"]
    assert delta["delta"]["stop_reason"] == final["stop_reason"]
    assert delta["usage"]["output_tokens"] == final["usage"]["output_tokens"]
    # the SDK's own accumulation agrees
    with client.messages.stream(model=MODEL, max_tokens=40, extra_body=GREEDY,
                                messages=body["messages"]) as stream:
        text = "".join(stream.text_stream)
        message = stream.get_final_message()
    assert text == message.content[0].text == final["content"][0]["text"]


def test_stop_sequences(client: anthropic.Anthropic) -> None:
    free = client.messages.create(model=MODEL, max_tokens=40, extra_body=GREEDY,
                                  messages=[{"role": "user", "content": "Tell me a tale."}])
    text = free.content[0].text
    assert len(text) > 10
    stop = text[len(text) // 2:len(text) // 2 + 3]
    m = client.messages.create(model=MODEL, max_tokens=40, extra_body=GREEDY,
                               stop_sequences=[stop],
                               messages=[{"role": "user", "content": "Tell me a tale."}])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert text.startswith(m.content[0].text) and stop not in m.content[0].text


# -- tools ----------------------------------------------------------------------------------
def test_forced_tool_use_validates(client: anthropic.Anthropic,
                                   server: SubprocessServer) -> None:
    for seed_text in ("Weather in Verona?", "Rain in Mantua for a week?"):
        m = client.messages.create(
            model=MODEL, max_tokens=120, tools=TOOLS,
            tool_choice={"type": "tool", "name": "get_weather"},
            messages=[{"role": "user", "content": seed_text}])
        assert m.stop_reason == "tool_use"
        (block,) = m.content
        assert block.type == "tool_use" and block.name == "get_weather"
        assert block.id.startswith("toolu_")
        jsonschema.validate(block.input, WEATHER)
    body = {"model": MODEL, "max_tokens": 120, "tools": TOOLS, "temperature": 0,
            "tool_choice": {"type": "tool", "name": "get_weather"}, "messages": ASK}
    events = _events(server, body)
    _check_order(events)
    (streamed,) = _streamed(events)
    final = _post(server, body).json()
    assert json.loads(streamed["partial"]) == final["content"][0]["input"]
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_tool_choice_any_and_none(client: anthropic.Anthropic) -> None:
    m = client.messages.create(
        model=MODEL, max_tokens=200, tools=TOOLS, messages=ASK,
        tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert m.stop_reason == "tool_use" and len(m.content) == 1
    assert m.content[0].name in ("get_weather", "get_time")
    if m.content[0].name == "get_weather":
        jsonschema.validate(m.content[0].input, WEATHER)
    none = client.messages.create(model=MODEL, max_tokens=8, tools=TOOLS, messages=ASK,
                                  tool_choice={"type": "none"}, extra_body=GREEDY)
    assert none.stop_reason in ("end_turn", "max_tokens")
    assert all(b.type == "text" for b in none.content)


def test_tool_result_round_trip(client: anthropic.Anthropic) -> None:
    first = client.messages.create(model=MODEL, max_tokens=120, tools=TOOLS, messages=ASK,
                                   tool_choice={"type": "tool", "name": "get_weather"})
    call = first.content[0]

    def history(result: str) -> list[dict[str, Any]]:
        return [*ASK, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": call.id,
                     "content": [{"type": "text", "text": result}]},
                    {"type": "text", "text": "And tomorrow?"}]}]

    final = client.messages.create(model=MODEL, max_tokens=16, tools=TOOLS,
                                   messages=history("Rain, 12 C"))
    assert final.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # the call and its result are in the prompt: a longer result is a longer prompt
    short = client.messages.count_tokens(model=MODEL, tools=TOOLS, messages=history("Rain"))
    longer = client.messages.count_tokens(model=MODEL, tools=TOOLS,
                                          messages=history("Rain, then sun and wind"))
    bare = client.messages.count_tokens(model=MODEL, tools=TOOLS, messages=ASK)
    assert bare.input_tokens < short.input_tokens < longer.input_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens > short.input_tokens


# -- count_tokens ---------------------------------------------------------------------------
def test_count_tokens_is_the_rendered_prompt(client: anthropic.Anthropic,
                                             server: SubprocessServer) -> None:
    msgs = [{"role": "user", "content": "Good morrow!"}]
    n = client.messages.count_tokens(model=MODEL, system="Speak plainly.", messages=msgs)
    tok = httpx.post(server.url + "/tokenize", headers={"Authorization": f"Bearer {KEY}"},
                     json={"messages": [{"role": "system", "content": "Speak plainly."},
                                        *msgs]}, timeout=30).json()
    assert n.input_tokens == tok["count"]
    with_tools = client.messages.count_tokens(model=MODEL, system="Speak plainly.",
                                              messages=msgs, tools=TOOLS)
    assert with_tools.input_tokens > n.input_tokens + 20
    m = client.messages.create(model=MODEL, max_tokens=2, system="Speak plainly.",
                               messages=msgs, tools=TOOLS)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == with_tools.input_tokens


# -- auth and errors ------------------------------------------------------------------------
def test_both_auth_headers(server: SubprocessServer) -> None:
    body = {"model": MODEL, "max_tokens": 2, "messages": ASK}
    by_key = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)
    by_token = anthropic.Anthropic(base_url=server.url, auth_token=KEY, max_retries=0)
    assert by_key.messages.create(**body).type == "message"
    assert by_token.messages.create(**body).type == "message"
    assert _post(server, body, **{"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert _post(server, body, **{"x-api-key": KEY}).status_code == 200
    # one right value is enough when a client sends both
    assert _post(server, body, **{"x-api-key": KEY,
                                  "Authorization": "Bearer other"}).status_code == 200


def test_wrong_key_is_an_anthropic_authentication_error(server: SubprocessServer) -> None:
    wrong = anthropic.Anthropic(base_url=server.url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as err:
        wrong.messages.create(model=MODEL, max_tokens=2, messages=ASK)
    assert err.value.status_code == 401
    assert err.value.body == {"type": "error", "error": {
        "type": "authentication_error", "message": err.value.body["error"]["message"]}}
    r = _post(server, {"model": MODEL, "max_tokens": 2, "messages": ASK},
              path="/v1/messages/count_tokens", **{"x-api-key": "sk-wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    # the OpenAI routes keep OpenAI's shape
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK},
                   headers={"x-api-key": "sk-wrong"}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize(("body", "status", "kind", "words"), [
    ({"model": MODEL, "messages": ASK}, 400, "invalid_request_error", "max_tokens"),
    ({"model": MODEL, "max_tokens": 0, "messages": ASK}, 400, "invalid_request_error",
     "max_tokens"),
    ({"model": MODEL, "max_tokens": 4, "messages": []}, 400, "invalid_request_error",
     "messages"),
    ({"model": "claude-nope", "max_tokens": 4, "messages": ASK}, 404, "not_found_error",
     "claude-nope"),
    ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AA=="}}]}]}, 400, "invalid_request_error",
     "image"),
    ({"model": MODEL, "max_tokens": 4, "messages": ASK, "tools": TOOLS,
      "tool_choice": {"type": "tool", "name": "nope"}}, 400, "invalid_request_error", "nope"),
    ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": 5}]}]}, 400,
     "invalid_request_error", "content"),
    ({"model": MODEL, "max_tokens": 4, "system": [{"type": "image"}], "messages": ASK}, 400,
     "invalid_request_error", "text blocks"),
    ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user",
                                                     "content": "word " * N_CTX}]},
     400, "invalid_request_error", "prompt is too long"),
])
def test_errors_in_anthropic_shape(server: SubprocessServer, body: dict[str, Any],
                                   status: int, kind: str, words: str) -> None:
    r = _post(server, body)
    assert r.status_code == status, r.text
    data = r.json()
    assert set(data) == {"type", "error"} and data["type"] == "error"
    assert set(data["error"]) == {"type", "message"}
    assert data["error"]["type"] == kind and words in data["error"]["message"]


def test_guard_errors_in_anthropic_shape(server: SubprocessServer) -> None:
    """What the guard in front of the routes answers (a body over --max-body-bytes, an
    unknown path or method under /v1/messages) takes the shape too."""
    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": KEY}, timeout=60,
                   content=b"x" * ((1 << 20) + 1))
    assert r.status_code == 413
    assert r.json() == {"type": "error", "error": {"type": "request_too_large",
                                                   "message": r.json()["error"]["message"]}}
    r = httpx.post(server.url + "/v1/messages/nope", headers={"x-api-key": KEY}, json={})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(server.url + "/v1/messages", headers={"x-api-key": KEY})
    assert r.status_code == 405 and r.json()["type"] == "error"


@pytest.mark.parametrize(("status", "kind"), [
    (400, "invalid_request_error"), (401, "authentication_error"), (403, "permission_error"),
    (404, "not_found_error"), (413, "request_too_large"), (429, "rate_limit_error"),
    (500, "api_error"), (503, "overloaded_error"), (408, "invalid_request_error"),
    (502, "api_error")])
def test_status_to_anthropic_error_type(status: int, kind: str) -> None:
    from colibri.app.errors import anthropic_error_body

    assert anthropic_error_body(status, "m") == {"type": "error",
                                                 "error": {"type": kind, "message": "m"}}


def test_sdk_raises_its_own_errors(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-nope", max_tokens=4, messages=ASK)
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model=MODEL, max_tokens=4,
                               messages=[{"role": "user", "content": "word " * N_CTX}])
    assert err.value.body["error"]["message"].startswith("prompt is too long")


def test_max_tokens_past_the_context_is_clamped(client: anthropic.Anthropic,
                                                oai: openai.OpenAI) -> None:
    """32000 on a 2048-token context: what the chat path does with max_tokens left out (the
    rest of the context), not a refusal."""
    msgs = [{"role": "user", "content": "word " * (N_CTX - 60)}]
    m = client.messages.create(model=MODEL, max_tokens=32000, messages=msgs,
                               extra_body=GREEDY)
    chat = oai.chat.completions.create(model=MODEL, messages=msgs, temperature=0)
    assert m.content[0].text == chat.choices[0].message.content
    n_prompt = m.usage.input_tokens + m.usage.cache_read_input_tokens
    assert n_prompt == chat.usage.prompt_tokens and n_prompt + m.usage.output_tokens <= N_CTX
    if chat.choices[0].finish_reason == "length":
        assert m.stop_reason == "max_tokens" and n_prompt + m.usage.output_tokens == N_CTX
    else:
        assert m.stop_reason == "end_turn"


# -- what Claude Code sends -----------------------------------------------------------------
def _claude_code_request(n_words: int) -> dict[str, Any]:
    """The shape of Claude Code 2.1's requests: beta fields, system blocks with cache_control,
    a system message inside messages, 12 tools (one deferred), adaptive thinking and a
    max_tokens far past the context."""
    tools = [{"name": f"Tool{i}", "description": f"Tool number {i}.",
              "input_schema": {"type": "object", "properties": {"arg": {"type": "string"}},
                               "required": ["arg"], "$schema":
                               "http://json-schema.org/draft-07/schema#"}}
             for i in range(11)]
    tools.append({"name": "LateTool", "description": "Loaded on demand.",
                  "defer_loading": True, "input_schema": {"type": "object"}})
    cache = {"type": "ephemeral"}
    return {
        "model": MODEL, "max_tokens": 32000, "stream": True,
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "metadata": {"user_id": "user_abc_account__session_1"},
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1;"},
                   {"type": "text", "text": "You are a coding agent.", "cache_control": cache},
                   {"type": "text", "text": "Use the tools. " * n_words,
                    "cache_control": cache}],
        "messages": [
            {"role": "system", "content": "<system-reminder>Be terse.</system-reminder>"},
            {"role": "user", "content": [{"type": "text", "text": "List the files.",
                                          "cache_control": cache}]}],
        "tools": tools,
    }


def test_claude_code_request_is_accepted_and_clamped(server: SubprocessServer) -> None:
    def count(n_words: int) -> int:
        body = {k: v for k, v in _claude_code_request(n_words).items() if k != "stream"}
        r = _post(server, body, path="/v1/messages/count_tokens")
        return int(r.json()["input_tokens"])

    base, per_10 = count(0), count(10) - count(0)
    n_words = 10 * (N_CTX - 60 - base) // per_10  # a prompt that leaves about 60 tokens
    body = _claude_code_request(n_words)
    n_prompt = count(n_words)
    assert N_CTX - 80 < n_prompt < N_CTX
    headers = {"Authorization": f"Bearer {KEY}", "anthropic-version": "2023-06-01",
               "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,"
                                 "context-management-2025-06-27"}
    with httpx.stream("POST", server.url + "/v1/messages?beta=true", json=body,
                      headers=headers, timeout=300) as r:
        assert r.status_code == 200, r.read()
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    events = [json.loads(ln[len("data: "):]) for ln in lines]
    _check_order([(e["type"], e) for e in events])
    usage, stop = events[-2]["usage"], events[-2]["delta"]["stop_reason"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == n_prompt
    assert stop in ("max_tokens", "end_turn", "tool_use")
    assert n_prompt + usage["output_tokens"] <= N_CTX
    if stop == "max_tokens":
        assert n_prompt + usage["output_tokens"] == N_CTX

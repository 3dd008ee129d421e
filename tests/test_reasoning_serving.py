"""Reasoning through the server, on a thinking-template model whose greedy reply is scripted
(tiny_models.make_scripted_checkpoint): chat completions (whole and streamed, through the
openai SDK) and the Responses API (whole and streamed) return the same reasoning and answer,
and the switch (`chat_template_kwargs`, `reasoning_effort`, `reasoning.effort`) reaches the
template, which then closes `<think>` itself, so the same words come back as the answer."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.server_helpers import SubprocessServer
from tests.tiny_models import make_scripted_checkpoint

# Qwen3's switch: with enable_thinking false the template writes an empty think block
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}")
REASONING, ANSWER = "Capital of France?", "Paris."
RAW = REASONING + "</think>" + ANSWER  # what the model writes after "<think>\n"
MESSAGES = [{"role": "user", "content": "Which city?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SubprocessServer]:
    tmp = tmp_path_factory.mktemp("reasoning")
    # both prompts (thinking on and off) end with the same "\n" token, so the model writes
    # the same words either way; only the template's switch decides how they are read
    model = make_scripted_checkpoint(tmp / "model", TEMPLATE, "assistant\n<think>\n", RAW)
    srv = SubprocessServer(model, tmp / "run", "--served-model-name", "m").wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server: SubprocessServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)


def _chat(client: openai.OpenAI, **kw: Any) -> tuple[str | None, str | None, int]:
    r = client.chat.completions.create(model="m", messages=MESSAGES, temperature=0, **kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop"
    return getattr(msg, "reasoning_content", None), msg.content, r.usage.prompt_tokens


def _chat_stream(client: openai.OpenAI, **kw: Any) -> tuple[str, str]:
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(model="m", messages=MESSAGES, temperature=0,
                                                stream=True, **kw):
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
    return reasoning, content


def _responses(server: SubprocessServer, **kw: Any) -> dict[str, Any]:
    r = httpx.post(server.url + "/v1/responses", timeout=60,
                   json={"input": MESSAGES, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def _texts(output: list[dict[str, Any]]) -> tuple[str | None, str]:
    reasoning = [c["text"] for i in output if i["type"] == "reasoning" for c in i["content"]]
    answer = [c["text"] for i in output if i["type"] == "message" for c in i["content"]]
    return ("".join(reasoning) if reasoning else None), "".join(answer)


def test_chat_and_responses_agree_on_reasoning_and_answer(
        server: SubprocessServer, client: openai.OpenAI) -> None:
    reasoning, content, _ = _chat(client)
    assert (reasoning, content) == (REASONING, ANSWER)
    assert _chat_stream(client) == (REASONING, ANSWER)

    whole = _responses(server)
    assert [i["type"] for i in whole["output"]] == ["reasoning", "message"]
    assert _texts(whole["output"]) == (REASONING, ANSWER)
    sdk = client.responses.create(model="m", input="Which city?", temperature=0)
    assert sdk.output_text == ANSWER

    events = []
    with httpx.stream("POST", server.url + "/v1/responses", timeout=60,
                      json={"input": MESSAGES, "temperature": 0, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    kinds = [e["type"] for e in events]
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert (deltas, text) == (REASONING, ANSWER)
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert _texts(events[-1]["response"]["output"]) == (REASONING, ANSWER)


@pytest.mark.parametrize("switch", [{"chat_template_kwargs": {"enable_thinking": False}},
                                    {"reasoning_effort": "none"}])
def test_switch_reaches_the_template(client: openai.OpenAI, switch: dict[str, Any]) -> None:
    _, _, n_on = _chat(client)
    reasoning, content, n_off = _chat(client, extra_body=switch)
    # the template closed <think> itself (a longer prompt): the same words are all answer
    assert n_off > n_on
    assert (reasoning, content) == (None, RAW)
    assert _chat_stream(client, extra_body=switch) == ("", RAW)


def test_responses_effort_switch(server: SubprocessServer) -> None:
    on = _responses(server, reasoning={"effort": "high"})
    off = _responses(server, reasoning={"effort": "none"})
    assert _texts(on["output"]) == (REASONING, ANSWER)
    assert _texts(off["output"]) == (None, RAW)
    assert off["usage"]["input_tokens"] > on["usage"]["input_tokens"]


def test_unknown_effort_is_refused_by_name(server: SubprocessServer) -> None:
    r = httpx.post(server.url + "/v1/responses", timeout=60,
                   json={"input": "Hi", "reasoning": {"effort": "extreme"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning.effort", r.text
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"messages": MESSAGES, "reasoning_effort": "extreme"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort", r.text


def test_earlier_reasoning_goes_back_to_the_template(server: SubprocessServer) -> None:
    """A Responses reasoning item and a chat assistant's reasoning_content both reach the
    template as the assistant message's reasoning_content (this template does not render it,
    so the prompt is the same either way; the request is accepted)."""
    item = {"type": "reasoning", "id": "rs_1", "summary": [],
            "content": [{"type": "reasoning_text", "text": REASONING}]}
    history = [*MESSAGES, item, {"role": "assistant", "content": ANSWER},
               {"role": "user", "content": "Again?"}]
    out = _responses(server, input=history)
    assert _texts(out["output"]) == (REASONING, ANSWER)
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "temperature": 0, "messages": [*MESSAGES, {"role": "assistant", "content": ANSWER,
                                                   "reasoning_content": REASONING},
                                       {"role": "user", "content": "Again?"}]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["reasoning_content"] == REASONING


def test_non_thinking_model_has_no_reasoning_field(tmp_path: Path) -> None:
    from tests.server_helpers import tiny_model

    srv = SubprocessServer(tiny_model(tmp_path / "model"), tmp_path / "run").wait_ready()
    try:
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
            "messages": MESSAGES, "max_tokens": 4, "reasoning_effort": "high"})
        assert r.status_code == 200, r.text
        assert "reasoning_content" not in r.json()["choices"][0]["message"]
        out = httpx.post(srv.url + "/v1/responses", timeout=60, json={
            "input": "Hi", "max_output_tokens": 4}).json()
        assert [i["type"] for i in out["output"]] == ["message"]
    finally:
        assert srv.stop() == 0, srv.log()


@pytest.mark.parametrize("kwargs", [{"_clb_cap": 10}, {"namespace": "x"}, {"messages": []},
                                    {"eos_token": "<|im_start|>"}])
def test_template_variables_cannot_replace_the_renderers(server: SubprocessServer,
                                                         kwargs: dict[str, Any]) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": MESSAGES, "chat_template_kwargs": kwargs})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "chat_template_kwargs"

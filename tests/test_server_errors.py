"""Every error the server answers, over raw HTTP (httpx): status and OpenAI's error shape.

The server here requires an API key, so these tests also show that the key is checked and
that every other error still needs it first (except /health, /ready and /metrics).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.server_helpers import SubprocessServer, tiny_model

KEY = "sk-test-0123456789"
N_CTX = 256
MAX_BODY = 64 << 10
MSG = [{"role": "user", "content": "Hello!"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SubprocessServer]:
    tmp = tmp_path_factory.mktemp("errors")
    model = tiny_model(tmp / "model", max_position_embeddings=N_CTX)
    srv = SubprocessServer(model, tmp / "run", "--api-key", KEY, "--n-ctx", str(N_CTX),
                           "--max-body-bytes", str(MAX_BODY), "--max-n", "4").wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def http(server: SubprocessServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


def assert_error(r: httpx.Response, status: int, param: str | None = None,
                 code: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    assert "Traceback" not in r.text and "detail" not in body
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


# -- 401 ---------------------------------------------------------------------------------
def test_missing_and_wrong_api_key(server: SubprocessServer) -> None:
    body = {"messages": MSG, "max_tokens": 2}
    url = server.url + "/v1/chat/completions"
    assert_error(httpx.post(url, json=body), 401, code="invalid_api_key")
    assert_error(httpx.post(url, json=body, headers={"Authorization": "Bearer nope"}), 401)
    assert_error(httpx.post(url, json=body, headers={"Authorization": KEY}), 401)
    assert_error(httpx.post(url, json=body,
                            headers={"Authorization": f"Bearer {KEY}x"}), 401)
    assert_error(httpx.get(server.url + "/v1/models"), 401)
    assert_error(httpx.post(server.url + "/tokenize", json={"prompt": "a"}), 401)
    # even malformed requests are refused for the key first
    assert_error(httpx.post(url, content=b"{nope"), 401)
    ok = httpx.post(url, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert ok.status_code == 200


def test_health_ready_metrics_need_no_key(server: SubprocessServer) -> None:
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.url + "/ready").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200
    assert httpx.get(server.url + "/").status_code == 200


# -- 400: malformed and invalid fields -----------------------------------------------------
def test_malformed_json(http: httpx.Client) -> None:
    headers = {"Content-Type": "application/json"}
    for raw in (b"{nope", b"", b'{"messages": [', b"\xff\xfe"):
        assert_error(http.post("/v1/chat/completions", content=raw, headers=headers), 400)
    assert_error(http.post("/v1/completions", content=b"[1, 2]", headers=headers), 400)


CHAT_INVALID = [
    ({"messages": "hi"}, "messages"),
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0"),
    ({"messages": [{"role": "function", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user"}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
     "messages.0.content.0.type"),
    ({"messages": MSG, "max_tokens": "many"}, "max_tokens"),
    ({"messages": MSG, "max_tokens": 0}, "max_tokens"),
    ({"messages": MSG, "max_completion_tokens": -1}, "max_completion_tokens"),
    ({"messages": MSG, "temperature": 2.5}, "temperature"),
    ({"messages": MSG, "temperature": -0.1}, "temperature"),
    ({"messages": MSG, "top_p": 0}, "top_p"),
    ({"messages": MSG, "top_p": 1.5}, "top_p"),
    ({"messages": MSG, "top_k": -2}, "top_k"),
    ({"messages": MSG, "min_p": 1.5}, "min_p"),
    ({"messages": MSG, "presence_penalty": 2.5}, "presence_penalty"),
    ({"messages": MSG, "frequency_penalty": -3}, "frequency_penalty"),
    ({"messages": MSG, "repetition_penalty": 0}, "repetition_penalty"),
    ({"messages": MSG, "n": 0}, "n"),
    ({"messages": MSG, "n": 5}, "n"),
    ({"messages": MSG, "seed": "abc"}, "seed"),
    ({"messages": MSG, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"messages": MSG, "stop": ""}, "stop"),
    ({"messages": MSG, "stop": ["ok", ""]}, "stop"),
    ({"messages": MSG, "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"messages": MSG, "logit_bias": {"999999": 1}}, "logit_bias"),
    ({"messages": MSG, "logit_bias": {"5": 200}}, "logit_bias"),
    ({"messages": MSG, "logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    ({"messages": MSG, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": MSG, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": MSG, "tools": [{"type": "web_search"}]}, "tools.0"),
    ({"messages": MSG, "tools": [{"type": "function", "function": {"name": "a b"}}]},
     "tools.0.function.name"),
    ({"messages": MSG, "tool_choice": "required"}, "tool_choice"),
    ({"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"messages": MSG, "response_format": {"type": "regex"}}, "response_format.type"),
    ({"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "if": {"required": ["a"]}}}}},
     "response_format.json_schema.schema"),
    ({"messages": MSG, "audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"messages": MSG, "modalities": ["text", "audio"]}, "modalities"),
    ({"messages": MSG, "prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"messages": MSG, "functions": [{"name": "f"}]}, "functions"),
    ({"messages": MSG, "chat_template": "{{ messages }}"}, "chat_template"),
]


@pytest.mark.parametrize(("body", "param"), CHAT_INVALID,
                         ids=[p + f"-{i}" for i, (_, p) in enumerate(CHAT_INVALID)])
def test_chat_invalid_field(http: httpx.Client, body: dict[str, Any], param: str) -> None:
    assert_error(http.post("/v1/chat/completions", json=body), 400, param)


COMPLETION_INVALID = [
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [5, 999999]}, "prompt"),
    ({"prompt": [5, -1]}, "prompt"),
    ({"prompt": [[5], []]}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": "a", "logprobs": 50}, "logprobs"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "best_of": 3}, "best_of"),
    ({"prompt": "a", "suffix": "b"}, "suffix"),
    ({"prompt": "a", "max_tokens": -5}, "max_tokens"),
]


@pytest.mark.parametrize(("body", "param"), COMPLETION_INVALID,
                         ids=[p + f"-{i}" for i, (_, p) in enumerate(COMPLETION_INVALID)])
def test_completion_invalid_field(http: httpx.Client, body: dict[str, Any], param: str) -> None:
    assert_error(http.post("/v1/completions", json=body), 400, param)


def test_non_finite_numbers(http: httpx.Client) -> None:
    # Python's json (and so Starlette) reads NaN and Infinity literals
    for lit in (b"NaN", b"Infinity", b"-Infinity"):
        raw = b'{"prompt": "a", "temperature": ' + lit + b"}"
        assert_error(http.post("/v1/completions", content=raw,
                               headers={"Content-Type": "application/json"}), 400, "temperature")


def test_lone_surrogates(http: httpx.Client) -> None:
    headers = {"Content-Type": "application/json"}
    chat = b'{"messages": [{"role": "user", "content": "hi \\ud800 there"}]}'
    assert_error(http.post("/v1/chat/completions", content=chat, headers=headers), 400,
                 "messages.0.content")
    comp = b'{"prompt": "x\\udfff"}'
    assert_error(http.post("/v1/completions", content=comp, headers=headers), 400, "prompt")
    stop = b'{"prompt": "x", "stop": "\\ud83d"}'
    assert_error(http.post("/v1/completions", content=stop, headers=headers), 400, "stop")
    tok = b'{"prompt": "\\ud800"}'
    assert_error(http.post("/tokenize", content=tok, headers=headers), 400, "prompt")


def test_tokenize_detokenize_invalid(http: httpx.Client) -> None:
    assert_error(http.post("/tokenize", json={}), 400)
    assert_error(http.post("/tokenize", json={"prompt": "a", "messages": MSG}), 400)
    assert_error(http.post("/detokenize", json={"tokens": [999999]}), 400, "tokens")
    assert_error(http.post("/detokenize", json={"tokens": "abc"}), 400, "tokens")


def test_unknown_fields_and_nulls_are_accepted(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", json={
        "messages": MSG, "max_tokens": 2, "some_future_field": {"x": 1}, "temperature": None,
        "top_p": None, "n": None, "stop": None, "seed": None})
    assert r.status_code == 200, r.text


# -- 400: context length -------------------------------------------------------------------
def test_context_length_exceeded(http: httpx.Client) -> None:
    long_ids = [5] * (N_CTX + 1)
    assert_error(http.post("/v1/completions", json={"prompt": long_ids}), 400, "prompt",
                 "context_length_exceeded")
    assert_error(http.post("/v1/completions", json={"prompt": [5] * 10, "max_tokens": N_CTX}),
                 400, "prompt", "context_length_exceeded")
    assert_error(http.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": N_CTX}),
                 400, "messages", "context_length_exceeded")
    words = " ".join(["river"] * (N_CTX * 2))
    assert_error(http.post("/v1/chat/completions",
                           json={"messages": [{"role": "user", "content": words}]}),
                 400, "messages", "context_length_exceeded")
    # omitted max_tokens is what is left of the context: this fits
    r = http.post("/v1/completions", json={"prompt": [5] * (N_CTX - 3), "max_tokens": None,
                                           "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


# -- 404 / 405 -----------------------------------------------------------------------------
def test_unknown_model(http: httpx.Client) -> None:
    for path, body in (("/v1/chat/completions", {"messages": MSG}),
                       ("/v1/completions", {"prompt": "a"})):
        assert_error(http.post(path, json={**body, "model": "gpt-9"}), 404, "model",
                     "model_not_found")
    assert_error(http.get("/v1/models/gpt-9"), 404, "model", "model_not_found")


def test_unknown_route_and_method(http: httpx.Client) -> None:
    assert_error(http.get("/v1/nothing"), 404)
    assert_error(http.post("/v2/chat/completions", json={}), 404)
    assert_error(http.get("/v1/chat/completions"), 405)


# -- 413 / 431 -----------------------------------------------------------------------------
def test_oversized_body(http: httpx.Client) -> None:
    big = json.dumps({"prompt": "a" * (MAX_BODY + 10)}).encode()
    assert_error(http.post("/v1/completions", content=big,
                           headers={"Content-Type": "application/json"}), 413)

    def chunks() -> Iterator[bytes]:  # no Content-Length: the guard counts as it reads
        yield b'{"prompt": "'
        for _ in range(MAX_BODY // 1024 + 2):
            yield b"a" * 1024
        yield b'"}'

    assert_error(http.post("/v1/completions", content=chunks(),
                           headers={"Content-Type": "application/json"}), 413)


def test_oversized_headers(http: httpx.Client) -> None:
    r = http.get("/health", headers={"X-Padding": "p" * (20 << 10)})
    assert_error(r, 431)


# -- CORS off by default -------------------------------------------------------------------
def test_cors_is_off_by_default(http: httpx.Client) -> None:
    r = http.options("/v1/chat/completions", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in r.headers
    r = http.get("/v1/models", headers={"Origin": "http://evil.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_metrics_count_errors_by_status(server: SubprocessServer) -> None:
    m = server.metrics()
    assert m['colibri_requests_total{endpoint="/v1/chat/completions",status="400"}'] >= 10
    assert m['colibri_requests_total{endpoint="/v1/chat/completions",status="401"}'] >= 1
    assert m['colibri_requests_total{endpoint="unmatched",status="404"}'] >= 1

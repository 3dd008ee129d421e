"""Hostile and unlucky requests over raw HTTP: each answer is an OpenAI-shaped 400, never a
500 and never a silent coercion (strict types where OpenAI's schema is strict)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from colibri.engine.sample.sampler import GREEDY_TEMPERATURE, Sampler, SamplingParams
from tests.server_helpers import SubprocessServer, tiny_model
from tests.test_server_errors import assert_error

N_CTX = 128
MSG = [{"role": "user", "content": "Hello!"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SubprocessServer]:
    tmp = tmp_path_factory.mktemp("reliability")
    model = tiny_model(tmp / "model", max_position_embeddings=N_CTX)
    srv = SubprocessServer(model, tmp / "run", "--n-ctx", str(N_CTX)).wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def http(server: SubprocessServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


# -- tiny repetition penalties and lone surrogates in `model` are the client's mistake -----
@pytest.mark.parametrize("penalty", [1e-45, 1e-38, 1e-10, 0.0099])
def test_tiny_repetition_penalty_is_400(http: httpx.Client, penalty: float) -> None:
    for path, body in (("/v1/chat/completions", {"messages": MSG}),
                       ("/v1/completions", {"prompt": "Hello Hello Hello"})):
        r = http.post(path, json={**body, "max_tokens": 3, "repetition_penalty": penalty})
        assert_error(r, 400, "repetition_penalty")


def test_smallest_allowed_repetition_penalty_generates(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"prompt": "Hello Hello Hello", "max_tokens": 4,
                                           "repetition_penalty": 0.01})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": 2}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
    ("/tokenize", {"prompt": "Hi"}),
    ("/detokenize", {"tokens": [1, 2]}),
])
def test_lone_surrogate_model_is_400(http: httpx.Client, path: str, body: dict) -> None:
    raw = ('{"model": "\\ud800", ' + httpx.Request("POST", "/", json=body).content.decode()[1:])
    r = http.post(path, content=raw.encode(), headers={"content-type": "application/json"})
    assert_error(r, 400, "model")


# -- subnormal temperatures are greedy, whatever the seed ------------------------------------
def test_tiny_temperature_is_greedy(http: httpx.Client) -> None:
    base = {"prompt": "To be or not", "max_tokens": 8, "ignore_eos": True}
    greedy = http.post("/v1/completions", json={**base, "temperature": 0}).json()
    texts = set()
    for temp in (1e-306, 5e-324, 1e-300, GREEDY_TEMPERATURE / 2):
        for seed in (1, 2, 3):
            r = http.post("/v1/completions", json={**base, "temperature": temp, "seed": seed})
            assert r.status_code == 200, r.text
            texts.add(r.json()["choices"][0]["text"])
    assert texts == {greedy["choices"][0]["text"]}


def test_temperature_boundary_in_the_sampler() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=64).astype(np.float32) * 5
    best = int(np.argmax(logits))
    for temp in (5e-324, 1e-306, 1e-38, np.nextafter(GREEDY_TEMPERATURE, 0)):
        for seed in range(5):
            s = Sampler(SamplingParams(temperature=float(temp), seed=seed, logprobs=0), 64)
            res = s.sample(logits, [1])
            assert res.token_id == best and res.logprob is not None
            assert np.isfinite(res.logprob)
    # the batched sampler takes the same rule: below the boundary, the argmax, no draw and
    # no overflow in a division by a subnormal temperature
    from colibri.engine.sample.batch import sample_rows

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for temp in (5e-324, 1e-306, 1e-38, np.nextafter(GREEDY_TEMPERATURE, 0),
                     GREEDY_TEMPERATURE):
            params = SamplingParams(temperature=float(temp), seed=3, logprobs=0)
            solo = Sampler(params, 64).sample(logits, [1])
            row = sample_rows(logits[None], [Sampler(params, 64)], [[1]])[0].result
            assert row is not None and (row.token_id, row.logprob) == (solo.token_id,
                                                                       solo.logprob)
    # at and just above the boundary the draw runs, and with a logit gap this large it must
    # still pick the best token: nothing overflows into a degenerate distribution
    for temp in (GREEDY_TEMPERATURE, 2 * GREEDY_TEMPERATURE, 1e-3):
        for seed in range(5):
            s = Sampler(SamplingParams(temperature=temp, seed=seed), 64)
            assert s.sample(logits, [1]).token_id == best
    # a flat distribution at a small temperature still spreads over its tied tokens
    flat = np.zeros(64, dtype=np.float32)
    drawn = {Sampler(SamplingParams(temperature=1e-3, seed=s), 64).sample(flat, [1]).token_id
             for s in range(40)}
    assert len(drawn) > 5


# -- strict types ------------------------------------------------------------------------------
@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": MSG, "stream": "yes"}, "stream"),
    ("/v1/chat/completions", {"messages": MSG, "stream": 1}, "stream"),
    ("/v1/completions", {"prompt": "Hi", "stream": "true"}, "stream"),
    ("/v1/completions", {"prompt": [True, False]}, "prompt"),
    ("/v1/completions", {"prompt": [[1, True]]}, "prompt"),
    ("/v1/completions", {"prompt": "Hi", "echo": "yes"}, "echo"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": "4"}, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "n": 1.0}, "n"),
    ("/v1/chat/completions", {"messages": MSG, "logprobs": "true"}, "logprobs"),
    ("/v1/chat/completions", {"messages": MSG, "temperature": "0.5"}, "temperature"),
    ("/detokenize", {"tokens": [False]}, "tokens"),
    ("/detokenize", {"tokens": ["1"]}, "tokens"),
    ("/tokenize", {"prompt": "Hi", "add_special_tokens": "no"}, "add_special_tokens"),
    # nested objects are as strict: a number is not a boolean there either
    ("/v1/completions", {"prompt": "Hi", "response_format": {
        "type": "text", "json_schema": {"name": "x", "strict": 0.0}}}, "response_format"),
    ("/v1/chat/completions", {"messages": MSG, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object"}, "strict": "yes"}}]}, "tools"),
])
def test_strict_types(http: httpx.Client, path: str, body: dict, param: str) -> None:
    r = http.post(path, json={"max_tokens": 2, **body} if path.startswith("/v1") else body)
    err = assert_error(r, 400)
    assert (err["param"] or "").split(".")[0] == param, err


@pytest.mark.parametrize("key", [" 5 ", "\u0665", "+5", "5_0", "0x5", "-1", "", "5.0"])
def test_logit_bias_keys_are_ascii_digits(http: httpx.Client, key: str) -> None:
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2,
                                           "logit_bias": {key: 5}})
    assert_error(r, 400, "logit_bias")


def test_valid_logit_bias_and_ints_still_work(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2,
                                           "temperature": 1, "logit_bias": {"5": 100}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"] is None


# -- schemas the grammar engine cannot take were a 500 from inside the engine step ---------
def _nested_arrays(depth: int) -> dict:
    schema: dict = {"type": "array", "items": {"type": "integer"}}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


UNSUPPORTED_SCHEMAS = {
    "arrays 800 deep": (_nested_arrays(800), "nests deeper than"),
    "a million a's": ({"type": "string", "pattern": "^a{1000000}$"}, "repeats to 1000000"),
    "nested repeats": ({"type": "string", "pattern": "^((x{1000}){1000}){1000}$"},
                       "repeats to 1000000000"),
    "$ref cycle": ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                    "$ref": "#/$defs/a"}, "no output can match"),
    "$ref to itself": ({"$ref": "#"}, "no output can match"),
}


@pytest.mark.parametrize("name", sorted(UNSUPPORTED_SCHEMAS))
def test_schema_the_grammar_engine_cannot_take_is_400(http: httpx.Client, name: str) -> None:
    schema, words = UNSUPPORTED_SCHEMAS[name]
    r = http.post("/v1/chat/completions", json={
        "messages": MSG, "max_tokens": 8, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    err = assert_error(r, 400, "response_format.json_schema.schema")
    assert words in err["message"], err
    ok = http.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_schemas_within_the_limits_still_compile(http: httpx.Client) -> None:
    for schema in (_nested_arrays(40),
                   {"type": "string", "pattern": "^[a-z]{1,64}(-[0-9]{2,4}){0,8}$"}):
        r = http.post("/v1/chat/completions", json={
            "messages": MSG, "max_tokens": 4, "response_format": {
                "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
        assert r.status_code == 200, r.text


# -- /v1/responses took text parts that chat refuses ---------------------------------------
@pytest.mark.parametrize("part,why", [
    ({"type": "input_text", "text": 5}, "not int"),
    ({"type": "input_text"}, "needs a string 'text'"),
    ({"type": "output_text", "text": None}, "needs a string 'text'"),
])
def test_responses_text_part_without_string_text_is_400(http: httpx.Client, part: dict,
                                                        why: str) -> None:
    r = http.post("/v1/responses", json={"max_output_tokens": 4, "input": [
        {"type": "message", "role": "user", "content": [part]}]})
    err = assert_error(r, 400, "input.0.content.0.text")
    assert why in err["message"], err
    ok = http.post("/v1/responses", json={"max_output_tokens": 4, "input": [
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Hello"}]}]})
    assert ok.status_code == 200, ok.text


# -- /openapi.json allowed what the server then refused ------------------------------------
def test_openapi_says_what_the_server_refuses(http: httpx.Client) -> None:
    schemas = http.get("/openapi.json").json()["components"]["schemas"]

    def prop(model: str, name: str) -> dict:
        return schemas[model]["properties"][name]

    assert prop("ChatCompletionRequest", "messages")["minItems"] == 1
    assert prop("TokenizeRequest", "messages")["minItems"] == 1
    assert prop("DetokenizeRequest", "tokens")["minItems"] == 1
    prompt = prop("CompletionRequest", "prompt")["anyOf"]
    assert {"type": "string", "minLength": 1} in prompt
    assert all(p.get("minItems") == 1 for p in prompt if p["type"] == "array")
    assert prop("ResponsesRequest", "truncation")["enum"] == ["disabled", None]
    # and the server does refuse each
    for path, body in (("/v1/chat/completions", {"messages": []}),
                       ("/v1/completions", {"prompt": ""}), ("/v1/completions", {"prompt": []}),
                       ("/detokenize", {"tokens": []}), ("/tokenize", {"messages": []}),
                       ("/v1/responses", {"input": "Hi", "truncation": "auto"})):
        assert http.post(path, json=body).status_code == 400, (path, body)

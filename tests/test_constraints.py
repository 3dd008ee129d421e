"""Constrained decoding on the bundled model: every sampled output matches its JSON Schema
(checked with jsonschema, which knows nothing of the grammar engine), the end-of-sequence
token is allowed exactly when the grammar accepts, unsupported keywords are refused by name,
and prompt logprobs equal the log-softmax of LLM.logits."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import numpy as np
import pytest

from colibri.engine import LLM, ConstraintError, ConstraintSpec, SamplingParams
from colibri.engine.sample.constraints import ConstraintCompiler

S = {"type": "string"}
SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": S, "age": {"type": "integer"}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"address": {
        "type": "object", "properties": {"street": S, "city": S,
                                         "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["city", "zip"], "additionalProperties": False}},
     "required": ["address"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 5},
    {"enum": ["red", "green", "blue"]},
    {"anyOf": [{"type": "string", "maxLength": 10}, {"type": "integer"}]},
    {"type": "number", "minimum": -10, "maximum": 10},
    {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 100},
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": S, "c": {"type": "boolean"}},
     "required": ["a"], "additionalProperties": False},
    {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
    {"type": ["boolean", "null"]},
    {"type": "array", "maxItems": 4, "items": {
        "type": "object", "properties": {"kind": {"enum": ["cat", "dog"]},
                                         "legs": {"type": "integer", "minimum": 0,
                                                  "maximum": 8}},
        "required": ["kind", "legs"], "additionalProperties": False}},
    {"type": "array", "maxItems": 3,
     "items": {"type": "array", "maxItems": 3, "items": {"type": "number"}}},
    {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"},
                                                          "y": {"type": "number"}},
                         "required": ["x", "y"], "additionalProperties": False}},
     "type": "object", "properties": {"from": {"$ref": "#/$defs/point"},
                                      "to": {"$ref": "#/$defs/point"}},
     "required": ["from", "to"], "additionalProperties": False},
    {"type": "object", "properties": {"version": {"const": 2}, "ok": {"type": "boolean"}},
     "required": ["version", "ok"], "additionalProperties": False},
    {"type": "string", "minLength": 2, "maxLength": 8},
    {"type": "object", "properties": {"when": {"type": "string", "format": "date-time"}},
     "required": ["when"], "additionalProperties": False},
    {"oneOf": [
        {"type": "object", "properties": {"type": {"const": "circle"},
                                          "r": {"type": "number", "minimum": 0}},
         "required": ["type", "r"], "additionalProperties": False},
        {"type": "object", "properties": {"type": {"const": "square"},
                                          "side": {"type": "integer", "minimum": 1}},
         "required": ["type", "side"], "additionalProperties": False}]},
    {"allOf": [{"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]},
               {"properties": {"tag": {"enum": ["x", "y"]}}, "required": ["tag"]}]},
    {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 3},
    {"type": "array", "prefixItems": [S, {"type": "integer"}, {"type": "boolean"}],
     "items": False, "minItems": 3},
    {"type": "object", "properties": {
        "title": S, "rating": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 5},
                                         {"type": "null"}]},
        "tags": {"type": "array", "items": S, "maxItems": 3}},
     "required": ["title", "rating", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"email": {"type": "string", "format": "email"}},
     "required": ["email"], "additionalProperties": False},
]
SAMPLES = 10
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(None)


@pytest.fixture(scope="module")
def compiler(llm: LLM) -> ConstraintCompiler:
    return ConstraintCompiler.for_tokenizer(llm.tokenizer, llm.vocab_size)


def _generate(llm: LLM, compiler: ConstraintCompiler, spec: ConstraintSpec, seed: int,
              max_tokens: int = MAX_TOKENS) -> tuple[str, str | None]:
    prompt = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Answer in JSON."}])
    c = compiler.compile(spec, max_tokens=max_tokens)
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, constraint=c)
    outs = list(llm.generate_tokens(prompt, params))
    return "".join(o.text for o in outs), outs[-1].finish_reason


@pytest.mark.slow  # seconds: left out of the quick pass, run by the whole suite
def test_schemas_sampled_at_temperature_1_all_validate(llm: LLM,
                                                       compiler: ConstraintCompiler) -> None:
    assert len(SCHEMAS) >= 20
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    for i, schema in enumerate(SCHEMAS):
        validator = jsonschema.Draft202012Validator(schema, format_checker=checker)
        spec = ConstraintSpec("json_schema", schema)
        for seed in range(SAMPLES):
            text, finish = _generate(llm, compiler, spec, 1000 * i + seed)
            assert finish == "stop", (i, seed, finish, text)
            validator.validate(json.loads(text))


def test_json_object_mode(llm: LLM, compiler: ConstraintCompiler) -> None:
    for seed in range(3):
        text, _ = _generate(llm, compiler, ConstraintSpec("json_object"), seed)
        assert isinstance(json.loads(text), dict)


def test_regex_constraint(llm: LLM, compiler: ConstraintCompiler) -> None:
    import re

    for seed in range(3):
        text, finish = _generate(llm, compiler, ConstraintSpec("regex", r"(yes|no), [0-9]{2}"),
                                 seed)
        assert re.fullmatch(r"(yes|no), [0-9]{2}", text), text
        assert finish == "stop"


def test_eos_allowed_exactly_when_accepting(llm: LLM, compiler: ConstraintCompiler) -> None:
    eos = sorted(llm.tokenizer.eos_token_ids)
    c = compiler.compile(ConstraintSpec("json_schema", {"type": "integer"}), overlap=False)
    assert not c.mask()[eos].any()  # nothing written yet
    digit = llm.tokenizer.encode("7", add_special_tokens=False)
    assert len(digit) == 1
    c.accept(digit[0])
    mask = c.mask()
    assert mask[eos].all() and c.is_accepting()  # "7" is a whole integer; more digits may come
    assert mask[digit[0]]
    logits = np.zeros(llm.vocab_size, dtype=np.float32)
    c.apply(logits)
    assert np.isneginf(logits[~mask]).all() and (logits[mask] == 0).all()


def test_clone_is_independent(llm: LLM, compiler: ConstraintCompiler) -> None:
    c = compiler.compile(ConstraintSpec("regex", "ab|ac"))
    a = llm.tokenizer.encode("a", add_special_tokens=False)[0]
    b = llm.tokenizer.encode("b", add_special_tokens=False)[0]
    c.accept(a)
    d = c.clone()
    d.accept(b)
    assert d.is_finished() and not c.is_finished()
    assert c.mask()[b]


@pytest.mark.parametrize(("schema", "word"), [
    ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "if"),
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"type": "string", "format": "no-such-format"}, "no-such-format"),
    ({"not": {"type": "string"}}, "not"),
])
def test_unsupported_schema_is_refused_by_name(compiler: ConstraintCompiler,
                                               schema: dict[str, Any], word: str) -> None:
    with pytest.raises(ConstraintError) as err:
        compiler.compile(ConstraintSpec("json_schema", schema))
    assert word in err.value.message


def test_grammar_cached_once_per_schema(compiler: ConstraintCompiler) -> None:
    spec = ConstraintSpec("json_schema", {"type": "object", "properties": {"q": S}})
    assert compiler.grammar(spec) is compiler.grammar(
        ConstraintSpec("json_schema", {"properties": {"q": S}, "type": "object"}))


def test_prompt_logprobs_equal_log_softmax_of_logits(llm: LLM) -> None:
    prompt = llm.tokenizer.encode("ROMEO.\nBut soft, what light", add_special_tokens=True)
    outs = list(llm.generate_tokens(prompt, SamplingParams(max_tokens=0, prompt_logprobs=3)))
    assert len(outs) == 1 and outs[0].token_id == -1 and outs[0].finish_reason == "length"
    plp = outs[0].prompt_logprobs
    assert plp is not None and len(plp) == len(prompt) and plp[0] is None
    x = llm.logits(prompt).astype(np.float64)
    ref = x - x.max(axis=1, keepdims=True)
    ref -= np.log(np.exp(ref).sum(axis=1, keepdims=True))
    for i in range(1, len(prompt)):
        entry = plp[i]
        assert entry is not None
        assert abs(entry[0] - ref[i - 1, prompt[i]]) < 1e-9
        top = [t for t, _ in entry[1]]
        assert top == list(np.argsort(-ref[i - 1], kind="stable")[:3])
    # with generation too: the first output carries them, the rest do not
    outs = list(llm.generate_tokens(prompt, SamplingParams(max_tokens=3, temperature=0.0,
                                                           prompt_logprobs=0,
                                                           ignore_eos=True)))
    assert outs[0].prompt_logprobs is not None and outs[1].prompt_logprobs is None
    assert [o.token_id for o in outs] == llm.generate_ids(prompt, 3, ignore_eos=True)


def test_logprobs_are_of_the_masked_distribution(llm: LLM, compiler: ConstraintCompiler) -> None:
    prompt = llm.tokenizer.encode("ROMEO.\n", add_special_tokens=True)
    c = compiler.compile(ConstraintSpec("regex", "(yes|no)"))
    outs = list(llm.generate_tokens(prompt, SamplingParams(max_tokens=8, temperature=0.0,
                                                           logprobs=5, constraint=c)))
    text = "".join(o.text for o in outs)
    assert text in ("yes", "no")
    first = outs[0]
    assert first.top_logprobs is not None and first.logprob is not None
    assert first.top_logprobs[0][0] == first.token_id  # greedy: the best allowed token
    for tok, lp in first.top_logprobs:
        assert np.isfinite(lp)
        piece = llm.tokenizer.decode([tok])
        assert "yes".startswith(piece) or "no".startswith(piece), piece
    # renormalised over the allowed tokens: they hold all the probability
    allowed = int(compiler.compile(ConstraintSpec("regex", "(yes|no)")).mask().sum())
    assert len(first.top_logprobs) == min(5, allowed)
    if allowed <= 5:
        assert sum(np.exp(lp) for _, lp in first.top_logprobs) == pytest.approx(1.0, abs=1e-6)

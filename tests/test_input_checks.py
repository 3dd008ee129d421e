"""The shared input checks: one check of token ids behind every entry point, one mapping of
C statuses to exceptions, one way to join a message's text parts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from colibri.app.errors import APIError
from colibri.app.protocol import check_token_ids as http_check_token_ids
from colibri.engine import (
    SamplingParamError,
    SamplingParams,
    TokenIdError,
    check_token_ids,
    join_text_parts,
)
from colibri.engine.errors import ContextOverflowError, InputError
from colibri.engine.text.errors import TokenizerError
from colibri.engine.text.tokenizer import Tokenizer

DEMO = Path(__file__).resolve().parents[1] / "engine" / "demo_model"


def test_token_ids_accepted_as_ints() -> None:
    assert check_token_ids([0, np.int64(4), np.int32(9)], 10) == [0, 4, 9]
    assert all(type(t) is int for t in check_token_ids(np.arange(3), 10))
    assert check_token_ids([], 10, allow_empty=True) == []


@pytest.mark.parametrize("ids, message", [
    ([10], r"token id 10 is outside the vocabulary \(0..9\)"),
    ([-1], r"token id -1 is outside the vocabulary \(0..9\)"),
    ([True], "not a token id"),
    ([1.0], "not a token id"),
    (["3"], "not a token id"),
    ([], "prompt must not be empty"),
])
def test_token_ids_refused(ids: list, message: str) -> None:
    with pytest.raises(TokenIdError, match=message) as info:
        check_token_ids(ids, 10, "prompt")
    assert info.value.param == "prompt"
    assert isinstance(info.value, InputError) and isinstance(info.value, ValueError)


def test_every_entry_point_refuses_with_the_same_words() -> None:
    tok = Tokenizer.from_dir(DEMO)
    v = int(tok.vocab_size)
    words = f"token id {v} is outside the vocabulary (0..{v - 1})"
    with pytest.raises(TokenizerError) as dec:
        tok.decode([1, v])
    assert str(dec.value) == words and dec.value.param == "ids"
    with pytest.raises(APIError) as http:
        http_check_token_ids([v], v, "tokens")
    assert http.value.status == 400 and http.value.param == "tokens"
    assert http.value.message == words
    with pytest.raises(SamplingParamError) as bias:
        SamplingParams(logit_bias={v: 1.0}).validate(v)
    assert words in str(bias.value) and bias.value.param == "logit_bias"
    assert tok.decode([]) == ""


def test_text_parts_join_as_the_string_they_split() -> None:
    assert join_text_parts(["Hello! ", "What is your name?"]) == "Hello! What is your name?"
    assert join_text_parts(["one"]) == "one"
    tok = Tokenizer.from_dir(DEMO)
    parts = [{"type": "text", "text": "Hello! "}, {"type": "text", "text": "Who are you?"}]
    assert (tok.apply_chat_template([{"role": "user", "content": parts}])
            == tok.apply_chat_template([{"role": "user", "content": "Hello! Who are you?"}]))


def test_c_statuses_map_to_one_set_of_exceptions() -> None:
    from colibri.engine import _core as core

    with pytest.raises(InputError, match="cannot start a thread pool of 0 threads"):
        core.ThreadPool(0)
    with pytest.raises(InputError):  # CLB_E_ARG from the probe's own argument checks
        core.bandwidth_probe(0)
    with pytest.raises(InputError):  # interleaved rows come in whole groups of eight
        core.matmul_bench("q8x8", bytes(4 * 34), 4, 32, np.zeros((1, 32), np.float32))
    assert issubclass(ContextOverflowError, InputError)

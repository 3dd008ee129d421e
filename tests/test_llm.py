"""engine.LLM end to end on a tiny random Mixtral with a real tokenizer."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest

from tests.tiny_models import make_checkpoint


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("mixtral", tmp_path_factory.mktemp("hf") / "tiny-mixtral", seed=1)


@pytest.fixture(scope="module")
def llm(hf_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    from colibri.engine import LLM

    old = os.environ.get("COLIBRI_CACHE_DIR")
    os.environ["COLIBRI_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    try:
        yield LLM(hf_dir, threads=2, quant="f32", n_ctx=256)
    finally:
        if old is None:
            os.environ.pop("COLIBRI_CACHE_DIR", None)
        else:
            os.environ["COLIBRI_CACHE_DIR"] = old


def test_greedy_matches_transformers(llm, hf_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    ids = llm.tokenizer.encode("The quick brown fox", add_special_tokens=True)
    ours = llm.generate_ids(ids, max_tokens=12, ignore_eos=True)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model.generate(
            torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None,
            pad_token_id=0,
        )[0, len(ids):].tolist()
    assert ours == ref


def test_logits_shape_and_fresh_sequence(llm) -> None:
    ids = llm.tokenizer.encode("hello there", add_special_tokens=True)
    a = llm.logits(ids)
    b = llm.logits(ids)
    assert a.shape == (len(ids), llm.vocab_size) and a.dtype == np.float32
    np.testing.assert_array_equal(a, b)


def test_stream_equals_generate_and_seed_reproduces(llm) -> None:
    kw = dict(max_tokens=20, temperature=1.0, seed=123)
    text = llm.generate("Once upon a time", **kw)
    assert "".join(llm.stream("Once upon a time", **kw)) == text
    assert llm.generate("Once upon a time", **kw) == text
    ids = llm.tokenizer.encode("Once upon a time", add_special_tokens=True)
    out = llm.generate_ids(ids, max_tokens=20, temperature=1.0, seed=123)
    assert llm.tokenizer.decode(out) == text


def test_stop_string_cut_and_not_leaked(llm) -> None:
    full = llm.generate("Once upon a time", max_tokens=24, temperature=0.0, ignore_eos=True)
    assert len(full) > 6
    stop = full[3:6]
    cut = llm.generate("Once upon a time", max_tokens=24, temperature=0.0, ignore_eos=True,
                       stop=[stop])
    assert cut == full[: full.index(stop)]
    assert stop not in cut


def test_finish_reasons(llm) -> None:
    from colibri.engine import SamplingParams

    ids = llm.tokenizer.encode("A", add_special_tokens=True)
    outs = list(llm.generate_tokens(ids, SamplingParams(max_tokens=5, temperature=0.0,
                                                        ignore_eos=True)))
    assert len(outs) == 5
    assert [o.finish_reason for o in outs] == [None] * 4 + ["length"]


def test_context_errors(llm) -> None:
    from colibri.engine import ContextLengthError, SamplingParams

    with pytest.raises(ContextLengthError):
        list(llm.generate_tokens([1] * 300, SamplingParams(max_tokens=1)))
    with pytest.raises(ContextLengthError):
        list(llm.generate_tokens([1] * 200, SamplingParams(max_tokens=100)))
    from colibri.engine import TokenIdError

    with pytest.raises(TokenIdError, match="vocabulary"):
        list(llm.generate_tokens([llm.vocab_size + 5], SamplingParams(max_tokens=1)))
    with pytest.raises(TokenIdError, match="must not be empty"):
        llm.generate_tokens([], SamplingParams(max_tokens=1))


def test_abort_stops_within_one_token(llm) -> None:
    from colibri.engine import SamplingParams

    abort = threading.Event()
    ids = llm.tokenizer.encode("A", add_special_tokens=True)
    outs = []
    for out in llm.generate_tokens(ids, SamplingParams(max_tokens=50, temperature=0.0,
                                                       ignore_eos=True), abort=abort):
        outs.append(out)
        if len(outs) == 3:
            abort.set()
    assert len(outs) == 4 and outs[-1].finish_reason == "abort"

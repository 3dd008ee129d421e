"""Continuous batching on the real engine: scheduling, chunked prefill, preemption, abort,
n > 1, prefix reuse, and batch invariance (a request's tokens do not depend on what else
runs beside it) at f32, q8 and q4 weights with the default KV cache type."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests.server_helpers import ExplodingConstraint
from tests.tiny_models import make_checkpoint

PROMPTS = [
    "The quick brown fox",
    "Once upon a time there was a little hummingbird who lived in a garden full of red",
    "Water",
    "Question: what is the capital of France? Answer:",
    "One, two, three, four, five, six, seven, eight, nine, ten. 1 2 3 4 5 6 7 8 9 10 100",
    "Hello! How are you?",
    "The teacher wrote a long sentence on the blackboard, and the students",
    "Mixture of experts models route each token",
]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("hf") / "tiny-qwen3", seed=3)


@pytest.fixture(scope="module", autouse=True)
def _cache(own_cache_dir: Path) -> None:
    """Conversions of this module's checkpoints in a cache folder of their own."""


def _llm(hf_dir: Path, quant: str = "f32", **cfg: Any) -> Any:
    from colibri.engine import LLM, EngineConfig

    return LLM(hf_dir, threads=2, quant=quant, n_ctx=256, config=EngineConfig(**cfg))


def _params(**kw: Any) -> Any:
    from colibri.engine import SamplingParams

    base = dict(max_tokens=20, temperature=0.0, ignore_eos=True)
    base.update(kw)
    return SamplingParams(**base)


def _ids(llm: Any, text: str) -> list[int]:
    return llm.tokenizer.encode(text, add_special_tokens=True)


def _alone(llm: Any, prompt: list[int], params: Any) -> list[int]:
    return llm.generate_batch([prompt], params)[0]


@pytest.fixture(scope="module")
def llm(hf_dir: Path) -> Any:
    return _llm(hf_dir, max_num_seqs=4, max_num_batched_tokens=32)


@pytest.mark.parametrize("quant", ["f32", "q8", "q4"])
def test_batch_invariance_greedy_and_seeded(hf_dir: Path, quant: str) -> None:
    """Each request run alone equals the same request among 7 others of other lengths."""
    llm = _llm(hf_dir, quant, max_num_seqs=8, max_num_batched_tokens=64)
    # the default KV type follows the weights
    assert llm.config.kv_cache_type == "auto"
    assert llm.model.kv_type == ("f32" if quant == "f32" else "f16")
    prompts = [_ids(llm, p) for p in PROMPTS]
    params = [_params(max_tokens=8 + 3 * i) if i % 2 == 0 else
              _params(max_tokens=8 + 3 * i, temperature=1.0, top_p=0.9, seed=100 + i)
              for i in range(len(prompts))]
    together = llm.generate_batch(prompts, params)
    assert llm.core.blocks.n_free == llm.core.blocks.n_blocks
    # alone: on an engine of its own, with no prefix cache that could hand it blocks the
    # batch computed
    solo = _llm(hf_dir, quant, max_num_seqs=8, max_num_batched_tokens=64,
                prefix_cache=False)
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        assert _alone(solo, prompt, p) == together[i], f"request {i} changed in the batch"


def test_a_step_samples_all_its_rows_in_one_call(llm: Any,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Sampling is batched: each step hands the logits of every request it finished a token
    for to one sample_rows call, as one [B, V] array."""
    import colibri.engine.core.engine as engine_core

    calls: list[tuple[int, int]] = []
    real = engine_core.sample_rows

    def spy(logits: Any, samplers: Any, histories: Any) -> Any:
        calls.append(logits.shape)
        return real(logits, samplers, histories)

    monkeypatch.setattr(engine_core, "sample_rows", spy)
    core = llm.core
    for i, p in enumerate(PROMPTS[:4]):
        core.add_request(f"rows{i}", _ids(llm, p),
                         _params(max_tokens=6, temperature=0.8, seed=i, top_k=20))
    widest = 0
    while core.has_work():
        n_calls = len(calls)
        sampled = [o for o in core.step() if o.token_id >= 0]
        assert len(calls) - n_calls == (1 if sampled else 0)
        if sampled:
            assert calls[-1] == (len(sampled), llm.vocab_size)
            widest = max(widest, len(sampled))
    assert widest == 4  # the four requests were sampled together
    assert core.blocks.n_free == core.blocks.n_blocks


def test_more_requests_than_seats_wait_and_all_finish(llm: Any) -> None:
    prompts = [_ids(llm, p) for p in PROMPTS]  # 8 requests, 4 seats
    core = llm.core
    for i, pr in enumerate(prompts):
        core.add_request(f"seat{i}", pr, _params(max_tokens=5))
    seen_running = []
    done: dict[str, list[int]] = {f"seat{i}": [] for i in range(len(prompts))}
    while core.has_work():
        outs = core.step()
        seen_running.append(core.n_running)
        for o in outs:
            done[o.request_id].append(o.token_id)
    assert max(seen_running) <= 4
    assert all(len(v) == 5 for v in done.values())
    for i, pr in enumerate(prompts):
        assert done[f"seat{i}"] == _alone(llm, pr, _params(max_tokens=5))
    assert core.blocks.n_free == core.blocks.n_blocks


def test_chunked_prefill_interleaves_with_decodes(llm: Any) -> None:
    """A long prompt is computed in chunks of the token budget while a running request
    keeps getting one token every step."""
    core = llm.core
    short = _ids(llm, "Water")
    long = _ids(llm, " ".join(PROMPTS) * 2)[:150]
    core.add_request("dec", short, _params(max_tokens=30))
    core.step()  # dec's prompt, and its first token
    core.add_request("pre", long, _params(max_tokens=3))
    steps = 0
    pre_req = core.requests["pre"][0]
    while pre_req.num_computed < len(long):
        outs = core.step()
        steps += 1
        assert [o.request_id for o in outs if o.request_id == "dec"] == ["dec"]
        assert pre_req.num_computed <= core.scheduler.config.max_num_batched_tokens * steps
    assert steps >= len(long) // 32  # chunks of at most the 32-token budget (minus decodes)
    while core.has_work():
        core.step()
    got = _alone(llm, long, _params(max_tokens=3))
    assert len(got) == 3


def test_prompt_chunks_shrink_while_others_decode(hf_dir: Path) -> None:
    """Alone, a prompt runs in chunks of the whole budget; while another request decodes, in
    chunks of prefill_tokens_while_decoding, and the decoding stream gets a token every step.
    The tokens are the same either way."""
    llm = _llm(hf_dir, max_num_seqs=4, max_num_batched_tokens=32,
               prefill_tokens_while_decoding=8, prefix_cache=False)
    core = llm.core
    long = _ids(llm, " ".join(PROMPTS) * 2)[:100]
    core.add_request("solo", long, _params(max_tokens=3))
    solo = core.requests["solo"][0]
    core.step()
    assert solo.num_computed == 32
    while core.has_work():
        core.step()
    alone = list(solo.output)

    core.add_request("dec", _ids(llm, "Water"), _params(max_tokens=60))
    core.step()  # dec's prompt and its first token: it decodes from now on
    core.add_request("pre", long, _params(max_tokens=3))
    pre = core.requests["pre"][0]
    steps = 0
    while not pre.prefill_done:
        before = pre.num_computed
        outs = core.step()
        steps += 1
        assert 0 < pre.num_computed - before <= 8
        assert [o.request_id for o in outs if o.request_id == "dec"] == ["dec"]
    assert steps >= len(long) // 8
    while core.has_work():
        core.step()
    assert pre.output == alone
    assert core.blocks.n_free == core.blocks.n_blocks


def test_sampled_rows_apart_in_the_logits(hf_dir: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt scored row by row (prompt_logprobs) sits between two decoding requests, so
    the rows a step samples are not next to each other in its logits: each request still gets
    its own row, and the same tokens and prompt logprobs as alone."""
    import colibri.engine.core.engine as engine_core

    llm = _llm(hf_dir, max_num_seqs=4, max_num_batched_tokens=32,
               prefill_tokens_while_decoding=8, prefix_cache=False)
    core = llm.core
    long = _ids(llm, " ".join(PROMPTS) * 2)[:60]
    first, last = _ids(llm, "Water"), _ids(llm, "The quick brown fox")
    scored = _params(max_tokens=2, prompt_logprobs=2)
    alone = {"first": _alone(llm, first, _params(max_tokens=40)),
             "last": _alone(llm, last, _params(max_tokens=30))}
    ref = list(llm.generate_tokens(long, scored))
    apart: list[int] = []
    real = engine_core.sample_rows

    def spy(logits: Any, samplers: Any, histories: Any) -> Any:
        apart.append(int(logits.base is None))  # a gathered copy, not a view of the step's
        return real(logits, samplers, histories)

    monkeypatch.setattr(engine_core, "sample_rows", spy)
    outs: dict[str, list[Any]] = {"first": [], "scored": [], "last": []}

    def step() -> None:
        for o in core.step():
            outs[o.request_id].append(o)

    core.add_request("first", first, _params(max_tokens=40))
    step()
    core.add_request("scored", long, scored)
    step()  # the scored prompt's first chunk
    core.add_request("last", last, _params(max_tokens=30))
    while core.has_work():
        step()
    assert sum(apart) > 0  # some step sampled rows that were apart
    for rid in ("first", "last"):
        assert [o.token_id for o in outs[rid]] == alone[rid]
    assert [o.token_id for o in outs["scored"]] == [o.token_id for o in ref]
    got = next(o.prompt_logprobs for o in outs["scored"] if o.prompt_logprobs is not None)
    assert got == ref[0].prompt_logprobs
    assert core.blocks.n_free == core.blocks.n_blocks


def test_preemption_recomputes_the_same_tokens(hf_dir: Path) -> None:
    """A KV pool too small for every request at once: the newest is preempted, recomputed
    later, and still produces exactly the tokens it produces alone."""
    from colibri.engine.core.block_manager import BLOCK_SIZE

    probe = _llm(hf_dir, max_num_seqs=1)
    block_mb = probe.model.kv_block_bytes() / (1024 * 1024)
    n_blocks = 256 // BLOCK_SIZE + 2  # one full context plus two blocks
    llm = _llm(hf_dir, max_num_seqs=6, max_num_batched_tokens=64,
               kv_cache_mb=block_mb * n_blocks + block_mb / 2)
    assert llm.core.blocks.n_blocks == n_blocks
    prompts = [_ids(llm, p) for p in PROMPTS[:6]]
    params = [_params(max_tokens=40, temperature=0.9, seed=7 + i) for i in range(6)]
    together = llm.generate_batch(prompts, params)
    assert llm.core.scheduler.n_preemptions > 0
    for pr, p, got in zip(prompts, params, together, strict=True):
        assert got == _alone(probe, pr, p)
    assert llm.core.blocks.n_free == n_blocks


def test_abort_frees_blocks_at_once(llm: Any) -> None:
    core = llm.core
    for i in range(3):
        core.add_request(f"ab{i}", _ids(llm, PROMPTS[i]), _params(max_tokens=50))
    core.add_request("ab-queued", _ids(llm, PROMPTS[3]), _params(max_tokens=50))
    for _ in range(3):
        core.step()
    assert core.blocks.n_free < core.blocks.n_blocks
    for i in range(3):
        assert core.abort(f"ab{i}")
    assert core.abort("ab-queued")
    assert not core.abort("never-was")
    assert not core.has_work()
    assert core.blocks.n_free == core.blocks.n_blocks


def test_n_choices_share_one_prefill(hf_dir: Path) -> None:
    llm = _llm(hf_dir, max_num_seqs=4, prefix_cache=False)
    prompt = _ids(llm, " ".join(PROMPTS))[:70]
    choices = [_params(max_tokens=6, temperature=1.0, seed=11 + i) for i in range(3)]
    core = llm.core
    core.add_request("nn", prompt, choices)
    outs: dict[int, list[int]] = {0: [], 1: [], 2: []}
    cached: dict[int, int] = {}
    while core.has_work():
        for o in core.step():
            outs[o.index].append(o.token_id)
            cached[o.index] = o.n_cached_tokens
    full = (len(prompt) - 1) // 16 * 16
    assert cached == {0: 0, 1: full, 2: full}  # choices 1 and 2 reused choice 0's blocks
    for i, p in enumerate(choices):
        assert outs[i] == _alone(llm, prompt, p)
    assert core.blocks.n_free == core.blocks.n_blocks


def test_prefix_cache_reuses_a_shared_system_prompt(llm: Any) -> None:
    system = _ids(llm, " ".join(PROMPTS))[:64]
    core = llm.core
    core.blocks.reset_prefix_cache()  # earlier tests ran the same text
    results = []
    for tail in ("Water", "Hello"):
        prompt = system + _ids(llm, tail)
        core.add_request(f"px-{tail}", prompt, _params(max_tokens=6))
        toks, cached = [], None
        while core.has_work():
            for o in core.step():
                toks.append(o.token_id)
                cached = o.n_cached_tokens
        results.append((prompt, toks, cached))
    assert results[0][2] == 0
    assert results[1][2] == 64  # four full blocks of the shared system prompt
    fresh = replace(llm.config, prefix_cache=False)
    from colibri.engine import LLM

    other = LLM(llm.path, threads=2, quant="f32", n_ctx=256, config=fresh)
    for prompt, toks, _ in results:
        assert toks == _alone(other, prompt, _params(max_tokens=6))


def test_prompt_longer_than_the_kv_pool_is_refused(hf_dir: Path) -> None:
    from colibri.engine import ContextLengthError

    probe = _llm(hf_dir, max_num_seqs=1)
    block_mb = probe.model.kv_block_bytes() / (1024 * 1024)
    llm = _llm(hf_dir, kv_cache_mb=block_mb * 4)  # 64 positions
    assert llm.core.max_request_tokens == 64
    prompt = _ids(llm, " ".join(PROMPTS))[:80]
    with pytest.raises(ContextLengthError, match="KV cache"):
        llm.core.add_request("big", prompt, _params(max_tokens=1))
    # omitted max_tokens: what is left of the pool
    llm.core.add_request("fits", prompt[:60], _params(max_tokens=None))
    assert llm.core.requests["fits"][0].max_new == 4
    llm.core.abort("fits")


def test_one_bad_request_fails_alone(llm: Any) -> None:
    """An exception while sampling one request fails that request; the others go on."""
    core = llm.core

    bad = _params(max_tokens=5)
    bad.constraint = ExplodingConstraint()  # type: ignore[attr-defined]
    core.add_request("good", _ids(llm, "Water"), _params(max_tokens=5))
    core.add_request("bad", _ids(llm, "Hello"), bad)
    results: dict[str, list[Any]] = {"good": [], "bad": []}
    while core.has_work():
        for o in core.step():
            results[o.request_id].append(o)
    assert [o.finish_reason for o in results["bad"]] == ["error"]
    assert "exploded" in str(results["bad"][0].error)
    assert len(results["good"]) == 5 and results["good"][-1].finish_reason == "length"
    assert core.blocks.n_free == core.blocks.n_blocks

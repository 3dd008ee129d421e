"""The step engine on a hybrid model (Qwen3-Next: gated DeltaNet linear-attention layers with a
recurrent state per sequence, between full-attention layers): every running sequence holds a
state slot beside its KV blocks, from admission to its end, abort or preemption; prefix caching
is off (and the log says so); n > 1 choices, preemption, chunked prefill and batching give the
tokens each sequence gives alone."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.tiny_models import make_checkpoint

PROMPTS = [
    "The quick brown fox",
    "Once upon a time there was a little hummingbird who lived in a garden full of red",
    "Water",
    "Question: what is the capital of France? Answer:",
    "One, two, three, four, five, six, seven, eight, nine, ten. 1 2 3 4 5 6 7 8 9 10 100",
    "Hello! How are you?",
]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    return make_checkpoint("qwen3_next", tmp_path_factory.mktemp("hf") / "tiny-qwen3-next",
                           seed=5)


@pytest.fixture(scope="module", autouse=True)
def _cache(own_cache_dir: Path) -> None:
    """Conversions of this module's checkpoints in a cache folder of their own."""


def _llm(hf_dir: Path, **cfg: Any) -> Any:
    from colibri.engine import LLM, EngineConfig

    return LLM(hf_dir, threads=2, quant="f32", n_ctx=256, config=EngineConfig(**cfg))


def _params(**kw: Any) -> Any:
    from colibri.engine import SamplingParams

    base = dict(max_tokens=12, temperature=0.0, ignore_eos=True)
    base.update(kw)
    return SamplingParams(**base)


def _ids(llm: Any, text: str) -> list[int]:
    return llm.tokenizer.encode(text, add_special_tokens=True)


@pytest.fixture(scope="module")
def probe(hf_dir: Path) -> Any:
    """One sequence at a time: what each request gives alone."""
    return _llm(hf_dir, max_num_seqs=1)


def _alone(probe: Any, prompt: list[int], params: Any) -> list[int]:
    return probe.generate_batch([prompt], params)[0]


def _all_free(core: Any) -> None:
    b = core.blocks
    assert b.n_free == b.n_blocks and not b.state_slots
    assert len(b._free_slots) == b.n_state_slots


def test_prefix_caching_is_off_and_said(hf_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="colibri.engine"):
        llm = _llm(hf_dir, max_num_seqs=3, prefix_cache=True)
    assert "prefix caching is off" in caplog.text
    core = llm.core
    assert core.hybrid and not core.blocks.enable_prefix_cache
    assert core.blocks.n_state_slots == 3 + 1 == core.model.kv.n_state_slots
    # the same prompt twice: computed twice, nothing read from a cache
    p = _ids(llm, PROMPTS[1] * 2)
    llm.generate_batch([p, p], _params(max_tokens=2))
    assert core.blocks.prefix_hits == 0
    _all_free(core)


def test_batched_and_chunked_requests_give_their_tokens_alone(hf_dir: Path, probe: Any) -> None:
    """Six prompts through four seats and 24-token steps: prompts are cut in chunks (longer
    than the conv window, not aligned to it) and run beside other sequences' decodes."""
    llm = _llm(hf_dir, max_num_seqs=4, max_num_batched_tokens=24)
    prompts = [_ids(llm, p) for p in PROMPTS]
    assert max(len(p) for p in prompts) > 24
    params = [_params(temperature=0.8, seed=3 + i) for i in range(len(prompts))]
    together = llm.generate_batch(prompts, params)
    for pr, p, got in zip(prompts, params, together, strict=True):
        assert got == _alone(probe, pr, p)
    _all_free(llm.core)


def test_preemption_recomputes_the_same_tokens(hf_dir: Path, probe: Any) -> None:
    """A KV pool too small for every request at once: the newest is preempted, its state slot
    freed with its blocks, recomputed later from its tokens, and still gives its own tokens."""
    from colibri.engine.core.block_manager import BLOCK_SIZE

    block_mb = probe.model.kv_block_bytes() / (1024 * 1024)
    n_blocks = 256 // BLOCK_SIZE + 2
    llm = _llm(hf_dir, max_num_seqs=6, max_num_batched_tokens=64,
               kv_cache_mb=block_mb * n_blocks + block_mb / 2)
    assert llm.core.blocks.n_blocks == n_blocks
    prompts = [_ids(llm, p) for p in PROMPTS]
    params = [_params(max_tokens=40, temperature=0.9, seed=7 + i) for i in range(6)]
    together = llm.generate_batch(prompts, params)
    assert llm.core.scheduler.n_preemptions > 0
    for pr, p, got in zip(prompts, params, together, strict=True):
        assert got == _alone(probe, pr, p)
    _all_free(llm.core)


@pytest.mark.parametrize("n_prompt", [70, 65, 1])
def test_n_choices_fork_and_give_their_tokens_alone(hf_dir: Path, probe: Any,
                                                    n_prompt: int) -> None:
    """n > 1: choice 0's prefill stops one token short of its prompt; the other choices fork
    there (its full blocks shared, a copy of the partly filled one and of its recurrent state
    in their own slots) and each computes the last prompt token itself. A prompt ending on a
    block edge (65: the fork at 64) shares every block; a one-token prompt has nothing to
    share and each choice computes it."""
    llm = _llm(hf_dir, max_num_seqs=4, max_num_batched_tokens=32)
    prompt = (_ids(llm, " ".join(PROMPTS)) * 2)[:n_prompt]
    choices = [_params(max_tokens=6, temperature=1.0, seed=11 + i) for i in range(3)]
    core = llm.core
    core.add_request("nn", prompt, choices)
    outs: dict[int, list[int]] = {0: [], 1: [], 2: []}
    cached: dict[int, int] = {}
    while core.has_work():
        for o in core.step():
            outs[o.index].append(o.token_id)
            cached[o.index] = o.n_cached_tokens
    fork = n_prompt - 1
    assert cached == {0: 0, 1: fork, 2: fork}
    for i, p in enumerate(choices):
        assert outs[i] == _alone(probe, prompt, p)
    _all_free(core)
    assert not core.blocks.pending_copies


def test_abort_and_score_return_the_state_slots(hf_dir: Path) -> None:
    llm = _llm(hf_dir, max_num_seqs=2)
    core = llm.core
    for i in range(3):
        core.add_request(f"ab{i}", _ids(llm, PROMPTS[i]), _params(max_tokens=50))
    for _ in range(3):
        core.step()
    assert len(core.blocks.state_slots) == 2
    for i in range(3):
        assert core.abort(f"ab{i}")
    _all_free(core)
    # scoring borrows a slot for the call: the logits of a fresh sequence
    ids = _ids(llm, PROMPTS[3])
    scored = core.score(ids)
    from colibri.engine.executor.model import Model

    fresh = Model.load(core.model_path, threads=2, n_ctx=256)
    want = fresh.forward(np.asarray(ids, np.int32), np.zeros(len(ids), np.int32),
                         np.arange(len(ids), dtype=np.int32))
    np.testing.assert_array_equal(scored, want)
    _all_free(core)


def test_served_with_an_expert_cache_over_its_moe_layers(hf_dir: Path) -> None:
    """Through the real app: completions, and the expert cache (the /experts page's data)
    counting the three MoE layers, not the dense one, whatever their token mixer."""
    import httpx

    from colibri.app.schemas import ExpertCacheInfo
    from colibri.app.server import create_app
    from colibri.app.settings import Settings
    from colibri.engine import LLM, EngineConfig
    from colibri.engine.core.options import ExpertCacheConfig
    from tests.server_helpers import InProcessServer, wait_for

    llm = LLM(hf_dir, threads=2, quant="q8", n_ctx=128, config=EngineConfig(
        expert_cache=ExpertCacheConfig(expert_cache_size=3, expert_pin=False)))
    app = create_app(Settings(_env_file=None), loader=lambda: llm.core)  # type: ignore[call-arg]
    srv = InProcessServer(app).start()
    try:
        wait_for(lambda: httpx.get(srv.url + "/ready").status_code == 200, 60, "ready")
        r = httpx.post(srv.url + "/v1/completions", json={
            "prompt": "The river runs", "max_tokens": 12, "temperature": 0, "n": 2},
            timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == 24
        assert body["choices"][0]["text"] == body["choices"][1]["text"]  # greedy: equal
        info = ExpertCacheInfo.model_validate(httpx.get(srv.url + "/v1/expert_cache").json())
        assert info.enabled and (info.n_layer, info.n_moe_layers) == (4, 3)
        assert info.dense_layers == [2]
        assert info.state is not None and info.layers is not None
        assert set(info.state[2]) == {0} and info.layers[2]["loads"] == 0
        for layer in (0, 1, 3):
            assert info.layers[layer]["loads"] > 0
    finally:
        srv.stop()
    _all_free(llm.core)

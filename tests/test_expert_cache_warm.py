"""Expert cache: prefetch on a nearly full cache.

A layer that holds all but a few of the experts its tokens use gets back whatever it evicts:
there a prefetch that evicts costs reads and saves no miss, so it must not add loads over
the same decode without prefetch, while in a small cache prefetch still turns misses into
hits (a random 16-expert Mixtral, tokens checked against the resident model's).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from colibri.engine.executor.model import Model

pytest.importorskip("transformers")

from tests.tiny_models import TinyCheckpoints  # noqa: E402

# the warm-up text, then the measured one: prompts of different tokens, greedy decodes
WARM_PROMPT = (np.arange(1, 17, dtype=np.int32) * 7) % 300
PROMPT = (np.arange(1, 17, dtype=np.int32) * 11 + 5) % 300
N_WARM, N_DECODE = 64, 96
# a random Mixtral shaped like the benchmark one in miniature: 16 experts, top-4, whose
# random router spreads the tokens nearly evenly (the hard case for a cache)
MIXTRAL_16 = dict(num_local_experts=16, num_experts_per_tok=4, num_hidden_layers=4)


@pytest.fixture(scope="module")
def mixtral16(checkpoints: TinyCheckpoints) -> Path:
    return checkpoints.get("mixtral", seed=3, **MIXTRAL_16).converted("q8")


def _decode(m: Model, prompt: np.ndarray, n: int) -> tuple[list[int], list[np.ndarray]]:
    """Prefill prompt as a fresh sequence, then n greedy steps; the tokens and the logits."""
    m.reset(0)
    lg = m.forward(prompt, np.zeros(prompt.size, np.int32),
                   np.arange(prompt.size, dtype=np.int32))
    logits = [lg[-1].copy()]
    tok, pos, out = int(np.argmax(lg[-1])), prompt.size, []
    for _ in range(n):
        out.append(tok)
        lg = m.forward(np.array([tok], np.int32), np.zeros(1, np.int32),
                       np.array([pos], np.int32))
        logits.append(lg[-1].copy())
        tok, pos = int(np.argmax(lg[-1])), pos + 1
    return out, logits


@pytest.fixture(scope="module")
def mixtral16_ref(mixtral16: Path) -> tuple[list[int], list[np.ndarray]]:
    return _decode(Model.load(mixtral16, n_seq=1, n_ctx=256), PROMPT, N_DECODE)


def _counts(path: Path, per_layer: int, prefetch: bool,
            ref: tuple[list[int], list[np.ndarray]]) -> dict[str, int]:
    """The cache's counters over the measured decode, after a warm-up decode of other text
    that fills every slot. Read-ahead as eager as it gets (two layers deep, never held back
    by busy storage), so that every prefetch the cache could issue is weighed."""
    m = Model.load(path, n_seq=1, n_ctx=256)
    m.core.enable_expert_cache(per_layer, load="pread", prefetch=prefetch, readers=2,
                               prefetch_depth=2, prefetch_busy_pct=100)
    _decode(m, WARM_PROMPT, N_WARM)
    s0 = m.core.expert_cache_stats()
    assert (s0["state"] >= 2).sum(axis=1).min() == per_layer  # warm: every slot filled
    tokens, logits = _decode(m, PROMPT, N_DECODE)
    s1 = m.core.expert_cache_stats()
    assert tokens == ref[0]
    for a, b in zip(logits, ref[1], strict=True):
        assert np.array_equal(a, b)
    assert ((s1["state"] >= 1).sum(axis=1) <= per_layer).all()
    return {k: int(s1[k].sum() - s0[k].sum())
            for k in ("hits", "misses", "loads", "prefetch_issued", "prefetch_spared")}


@pytest.mark.parametrize("missing", [1, 2])
def test_prefetch_adds_no_loads_to_a_nearly_full_cache(mixtral16: Path, mixtral16_ref: tuple,
                                                       missing: int) -> None:
    """All but one or two experts of each layer resident: whatever a prefetch would evict is
    soon missed, so a wrong prediction costs two reads (its own and the evicted expert's
    way back) and a right one saves none. The cache measures that (evicted experts come
    back) and spares them: it loads no more than without prefetch, give or take a tenth and
    a load per layer (which predictions are read in time depends on timing; before the
    cache measured that, prefetch added half the loads again here)."""
    e, n_layer = int(MIXTRAL_16["num_local_experts"]), int(MIXTRAL_16["num_hidden_layers"])
    off = _counts(mixtral16, e - missing, False, mixtral16_ref)
    on = _counts(mixtral16, e - missing, True, mixtral16_ref)
    assert off["loads"] > 0  # the warm cache still misses now and then
    assert on["loads"] <= off["loads"] * 1.1 + n_layer, (on, off)
    assert on["hits"] + on["misses"] == off["hits"] + off["misses"]
    assert on["prefetch_spared"] > 0, on


def test_prefetch_still_turns_misses_into_hits_in_a_small_cache(mixtral16: Path,
                                                                mixtral16_ref: tuple) -> None:
    """Half the experts resident: evicted experts rarely come back before the layer would
    have evicted them anyway, so predictions right more often than not are read ahead, and
    more uses find their expert resident than without prefetch."""
    e = int(MIXTRAL_16["num_local_experts"])
    off = _counts(mixtral16, e // 2, False, mixtral16_ref)
    on = _counts(mixtral16, e // 2, True, mixtral16_ref)
    assert on["prefetch_issued"] > 0
    assert on["hits"] > off["hits"] * 1.05, (on, off)

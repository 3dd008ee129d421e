"""Expert cache: prefetch on a nearly full cache, and the slots' memory faulted in ahead.

A layer that holds all but a few of the experts its tokens use gets back whatever it evicts:
there a prefetch that evicts costs reads and saves no miss, so it must not add loads over
the same decode without prefetch, while in a small cache prefetch still turns misses into
hits (a random 16-expert Mixtral, tokens checked against the resident model's). The slots'
pages are faulted in once, on a thread of their own, so that reads into them no longer
fault (minor faults counted with getrusage) and the process's anonymous memory holds the
whole budget before the first forward (the demo model).
"""

from __future__ import annotations

import resource
from pathlib import Path

import numpy as np
import pytest

from colibri.engine.demo import default_model_path
from colibri.engine.executor.model import Model
from colibri.engine.format.convert import ensure_converted

pytest.importorskip("transformers")

from tests.conftest import quick_params  # noqa: E402
from tests.parity_helpers import greedy_decode  # noqa: E402
from tests.tiny_models import TinyCheckpoints  # noqa: E402

PAGE = 4096
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


@pytest.fixture(scope="module")
def demo_dir() -> Path:
    """The trained demo model at q8 (64 experts, top-8)."""
    return ensure_converted(Path(default_model_path()), "q8", progress=False)


@pytest.fixture(scope="module")
def mixtral16_ref(mixtral16: Path) -> tuple[list[int], list[np.ndarray]]:
    return greedy_decode(Model.load(mixtral16, n_seq=1, n_ctx=256), PROMPT, N_DECODE)


def _counts(path: Path, per_layer: int, prefetch: bool,
            ref: tuple[list[int], list[np.ndarray]]) -> dict[str, int]:
    """The cache's counters over the measured decode, after a warm-up decode of other text
    that fills every slot. Read-ahead as eager as it gets (two layers deep, never held back
    by busy storage), so that every prefetch the cache could issue is weighed."""
    m = Model.load(path, n_seq=1, n_ctx=256)
    m.core.enable_expert_cache(per_layer, load="pread", prefetch=prefetch, readers=2,
                               prefetch_depth=2, prefetch_busy_pct=100)
    greedy_decode(m, WARM_PROMPT, N_WARM)
    s0 = m.core.expert_cache_stats()
    # warm: every slot holds an expert, resident or still being read (a prefetch issued by
    # the last layers of the warm-up decode may not have landed yet)
    assert (s0["state"] >= 1).sum(axis=1).min() == per_layer
    tokens, logits = greedy_decode(m, PROMPT, N_DECODE)
    s1 = m.core.expert_cache_stats()
    assert tokens == ref[0]
    for a, b in zip(logits, ref[1], strict=True):
        assert np.array_equal(a, b)
    assert ((s1["state"] >= 1).sum(axis=1) <= per_layer).all()
    return {k: int(s1[k].sum() - s0[k].sum())
            for k in ("hits", "misses", "loads", "prefetch_issued", "prefetch_spared")}


# two missing: the same rule where evicted experts come back a little less surely
@pytest.mark.parametrize("missing", quick_params([1, 2], [1]))
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


# -- the slots' memory faulted in ahead --------------------------------------------------------

def _rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def test_prefault_fills_the_budget_before_the_first_forward(demo_dir: Path) -> None:
    """With prefault, the slots of every layer count in the process's anonymous memory once
    the pre-fault thread ends, before any forward; without it they stay untouched. Slots on
    4 KiB pages, where every page counts alike."""
    cfg = Model.load(demo_dir).config
    per_layer = cfg.n_expert // 2
    grew: dict[bool, int] = {}
    # the first cache of the process also grows the allocator's and the threads' own memory
    # (much more under a sanitizer): a warm-up one first, then the same start without and
    # with prefault, whose difference is the slots
    for prefault in (False, False, True):
        m = Model.load(demo_dir, n_seq=1)
        before = _rss_anon()
        m.core.enable_expert_cache(per_layer, load="pread", prefetch=False, huge_pages=False,
                                   prefault=prefault, readers=2)
        pf = m.core.expert_cache_prefault(wait_s=30.0)
        grew[prefault] = _rss_anon() - before
        assert pf is not None and not pf["running"] and pf["error"] == ""
        if prefault:
            # every slot of every layer: at least one expert's bytes each
            assert pf["total_bytes"] >= cfg.n_layer * per_layer * m.core.expert_bytes
            assert pf["done_bytes"] == pf["total_bytes"]
            assert grew[True] >= pf["total_bytes"] * 0.95, (grew, pf)
            # without it, at most a twentieth of the slots had been touched
            assert grew[True] - grew[False] >= pf["total_bytes"] * 0.95, (grew, pf)
        else:
            assert pf["done_bytes"] == pf["total_bytes"] == 0
        del m


def test_reads_into_prefaulted_slots_do_not_fault(demo_dir: Path) -> None:
    """The same decode with and without prefault: without it, each page of a slot faults the
    first time a load writes into it (an expert's bytes, a page at a time, for every slot
    filled); with it those faults happened before, on the pre-fault thread. Counted as minor
    faults of the whole process (the readers included) around the decode."""
    probe = Model.load(demo_dir)
    cfg, expert_bytes = probe.config, probe.core.expert_bytes
    per_layer = cfg.n_expert  # every expert the text uses stays: one load, one slot each
    greedy_decode(Model.load(demo_dir, n_seq=1), PROMPT, 4)  # one-time costs of the process
    faults: dict[bool, int] = {}
    filled = 0
    for prefault in (False, True):
        m = Model.load(demo_dir, n_seq=1)
        m.core.enable_expert_cache(per_layer, load="pread", prefetch=False, huge_pages=False,
                                   readers=2, prefault=prefault)
        m.core.expert_cache_prefault(wait_s=30.0)
        r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        greedy_decode(m, PROMPT, 8)
        faults[prefault] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0
        st = m.core.expert_cache_stats()
        filled = int((st["state"] >= 2).sum())
        del m
    pages_per_slot = -(-expert_bytes // PAGE)
    assert filled > 0
    assert faults[False] - faults[True] >= 0.8 * filled * pages_per_slot, (faults, filled)


def test_mmap_mode_has_no_slots_to_prefault(demo_dir: Path) -> None:
    m = Model.load(demo_dir, n_seq=1)
    m.core.enable_expert_cache(16, load="mmap", prefetch=False)
    pf = m.core.expert_cache_prefault(wait_s=5.0)
    assert pf == {"done_bytes": 0, "total_bytes": 0, "running": False, "error": ""}
    assert Model.load(demo_dir).core.expert_cache_prefault() is None

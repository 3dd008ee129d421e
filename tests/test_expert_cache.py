"""Expert cache: placement decides speed, never tokens.

The reference is the same model with every expert resident (read through its mappings): at
every budget, load mode and prefetch setting, logits must be bit-identical, for single
decodes and for batches whose experts do not fit in one wave. Also: the budget holds after
every step, pinned experts stay, counters add up, the reader pool stops cleanly (also with
reads in flight), a file cut short under a running cache fails the call with the file's name,
and the start-up plan refuses budgets below one layer's top-k. Experts run as they land while
others load, read-ahead one or two layers deep is cancelled when no longer needed, and the
reader pool is sized from a storage probe. Prefetch reads fill only the storage's idle
time and never evict an expert likelier to be used than the one they read.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from colibri.engine.core.loader import EngineConfig, start_expert_cache
from colibri.engine.core.options import ExpertCacheConfig
from colibri.engine.demo import default_model_path
from colibri.engine.errors import ModelFaultError, WeightFileChangedError
from colibri.engine.executor.expert_cache import (
    DEFAULT_READERS,
    MAX_READERS,
    MIN_MARGIN_BYTES,
    MIN_READERS,
    PROBE_CHUNK,
    PROBE_CHUNKS,
    PROBE_DEPTHS,
    ROUTING_FILE,
    load_pinned,
    plan_cache,
    probe_readers,
    readers_for,
    resolve_load,
)
from colibri.engine.executor.model import Model
from colibri.engine.format.convert import convert, ensure_converted
from colibri.engine.llm import LLM

pytest.importorskip("transformers")

from tests.conftest import quick_params  # noqa: E402
from tests.parity_helpers import greedy_decode  # noqa: E402
from tests.tiny_models import make_checkpoint  # noqa: E402

PROMPT = (np.arange(1, 41, dtype=np.int32) * 7) % 300
N_DECODE = 12


@pytest.fixture(scope="module")
def demo_dir() -> Path:
    """The trained demo model at q8 (64 experts, top-8: realistic, skewed routing)."""
    return ensure_converted(Path(default_model_path()), "q8", progress=False)


@pytest.fixture(scope="module")
def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Qwen2-MoE with a shared expert, f32 (another file layout and architecture)."""
    root = tmp_path_factory.mktemp("xc_qwen2")
    hf = make_checkpoint("qwen2_moe", root / "hf", seed=5)
    return convert(hf, root / "f32", quant="f32", progress=False)


def _decode(m: Model, n: int = N_DECODE) -> tuple[list[int], list[np.ndarray]]:
    """Prefill PROMPT, then n greedy steps; the tokens and every step's logits."""
    return greedy_decode(m, PROMPT, n)


def _cached(path: Path, per_layer: int, **kw: object) -> Model:
    m = Model.load(path, n_seq=1)
    m.core.enable_expert_cache(per_layer, **kw)
    return m


@pytest.fixture(scope="module")
def demo_ref(demo_dir: Path) -> tuple[list[int], list[np.ndarray]]:
    return _decode(Model.load(demo_dir, n_seq=1))


# slots on 4 KiB or 2 MiB pages (mmap mode reads the mappings: no slots)
@pytest.mark.parametrize("load, huge", [("pread", False), ("pread", True), ("direct", False),
                                        ("direct", True), ("mmap", False)])
@pytest.mark.parametrize("share", quick_params([1.0, 0.5, 0.25, 0.0], [0.25, 0.0]))
@pytest.mark.parametrize("prefetch", quick_params([False, True], [True]))
def test_every_budget_gives_the_resident_output(demo_dir: Path, demo_ref: tuple, load: str,
                                                huge: bool, share: float,
                                                prefetch: bool) -> None:
    cfg = Model.load(demo_dir).config
    k, e = cfg.n_expert_used, cfg.n_expert
    per_layer = max(k, int(e * share))  # share 0: the minimum, one token's experts
    if load == "direct" and not _direct_ok(demo_dir):
        pytest.skip("this file system refuses O_DIRECT (tmpfs); pread and mmap still run")
    m = _cached(demo_dir, per_layer, load=load, prefetch=prefetch, huge_pages=huge)
    tokens, logits = _decode(m)
    ref_tokens, ref_logits = demo_ref
    assert tokens == ref_tokens
    for a, b in zip(logits, ref_logits, strict=True):
        assert np.array_equal(a, b)
    st = m.core.expert_cache_stats()
    assert st is not None
    # prefill and decode route T * k rows per layer: each acquired once per wave
    assert (st["hits"] + st["misses"]).min() > 0
    assert ((st["state"] >= 1).sum(axis=1) <= per_layer).all()
    if per_layer < e:
        assert st["evictions"].sum() > 0


def _evict_page_cache(path: Path) -> None:
    """Asks the kernel to drop the expert files' pages from the page cache (clean pages, no
    root needed), so that buffered misses need the storage and go to the reader threads."""
    for f in path.glob("experts/*.bin"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# any number of reads in flight, in any order of arrival, gives the same bits
@pytest.mark.parametrize("readers", quick_params([1, 2, 4], [2]))
@pytest.mark.parametrize("load", quick_params(["pread", "direct", "uring", "mmap"],
                                              ["pread", "uring"]))
@pytest.mark.parametrize("prefetch", [False, True])
def test_reader_pool_sizes_give_the_resident_output(demo_dir: Path, demo_ref: tuple,
                                                    readers: int, load: str,
                                                    prefetch: bool) -> None:
    if load in ("direct", "uring") and not _direct_ok(demo_dir):
        pytest.skip("this file system refuses O_DIRECT (tmpfs); pread and mmap still run")
    cfg = Model.load(demo_dir).config
    k, e = cfg.n_expert_used, cfg.n_expert
    for per_layer in (k, e // 4):  # the minimum (a wave per token's experts), a quarter
        _evict_page_cache(demo_dir)
        m = _cached(demo_dir, per_layer, load=load, prefetch=prefetch, readers=readers,
                    huge_pages=True)
        tokens, logits = _decode(m)
        assert tokens == demo_ref[0]
        for a, b in zip(logits, demo_ref[1], strict=True):
            assert np.array_equal(a, b)
        st = m.core.expert_cache_stats()
        assert st is not None
        assert ((st["state"] >= 1).sum(axis=1) <= per_layer).all()
        assert (st["prefetch_used"] + st["prefetch_wasted"] <= st["prefetch_issued"]).all()
        if not prefetch:
            assert st["prefetch_issued"].sum() == 0 and st["prefetch_cancelled"].sum() == 0
        if load in ("direct", "uring"):  # O_DIRECT misses need the storage: all on readers
            assert st["reader_loads"].sum() == st["misses"].sum() - st["prefetch_late"].sum()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_freed_with_reads_in_flight_leaves_no_thread_or_file(demo_dir: Path,
                                                            tmp_path: Path) -> None:
    """A read error ends the forward call while the rest of its wave is still being read (a
    layer hands all its misses to the readers at once): freeing the model right then waits for
    those reads, joins every reader and closes every expert file it opened; nothing hangs and
    nothing is left behind. The same straight after a call that queued prefetches."""
    copy = tmp_path / "m"
    shutil.copytree(demo_dir, copy)
    Model.load(copy, n_seq=1)  # what a first load starts for the whole process stays
    gc.collect()
    fds, threads = _open_fds(), _threads()
    for readers in (1, 4):
        _evict_page_cache(copy)
        m = Model.load(copy, n_seq=1)
        loaded = _threads()
        m.core.enable_expert_cache(16, load="pread", prefetch=True, readers=readers)
        assert not m.core.expert_cache_prefault(wait_s=30.0)["running"]  # its thread ended
        assert _threads() == loaded + readers
        _decode(m, 1)
        del m
        gc.collect()
        assert (_open_fds(), _threads()) == (fds, threads)
    # half the files cut short under the running cache: each wave's reads mix failures and
    # good reads
    for readers in (1, 4):
        shutil.rmtree(copy)
        shutil.copytree(demo_dir, copy)
        m = _cached(copy, 16, load="pread", prefetch=True, readers=readers)
        for f in sorted((copy / "experts").glob("*.bin"))[::2]:
            os.truncate(f, 64)
        _evict_page_cache(copy)
        with pytest.raises(WeightFileChangedError, match=r"experts/layer_\d+_expert_\d+\.bin"):
            _decode(m, 4)
        with pytest.raises(ModelFaultError, match="is shorter than when the model was loaded"):
            _decode(m, 1)  # the model marked itself unhealthy
        del m
        gc.collect()
        assert (_open_fds(), _threads()) == (fds, threads)


def _direct_ok(path: Path) -> bool:
    try:
        fd = os.open(next(path.glob("experts/*.bin")), os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return False
    os.close(fd)
    return True


def test_batch_of_sequences_in_waves(shared_dir: Path) -> None:
    """Four sequences at once route to more experts than one slot per layer holds, so each
    layer runs in waves; every sequence's logits equal the resident model's."""
    def step_all(m: Model) -> np.ndarray:
        n = 4
        rng = np.random.default_rng(3)
        toks = rng.integers(3, 300, size=(n, 9)).astype(np.int32)
        nb = 1
        tables = np.arange(n * nb, dtype=np.int32).reshape(n, nb)
        t = toks.reshape(-1)
        seq = np.repeat(np.arange(n, dtype=np.int32), 9)
        pos = np.tile(np.arange(9, dtype=np.int32), n)
        return m.forward_paged(t, seq, pos, tables, None)

    ref = step_all(Model.load(shared_dir, n_seq=0, kv_blocks=8))
    for per_layer in (1, 2):
        m = Model.load(shared_dir, n_seq=0, kv_blocks=8)
        m.core.enable_expert_cache(per_layer, prefetch=True)
        assert np.array_equal(step_all(m), ref)
        st = m.core.expert_cache_stats()
        assert ((st["state"] >= 1).sum(axis=1) <= per_layer).all()


def test_budget_holds_after_every_step_under_random_routing(shared_dir: Path) -> None:
    m = Model.load(shared_dir, n_seq=0, kv_blocks=64)
    m.core.enable_expert_cache(2, prefetch=True, prefetch_window=4)
    rng = np.random.default_rng(7)
    positions: dict[int, int] = {}
    n_tokens = 0
    for step in range(60):
        n_seq = int(rng.integers(1, 5))
        seqs = rng.choice(8, size=n_seq, replace=False)
        toks, sid, pos = [], [], []
        tables = np.full((n_seq, 8), -1, np.int32)
        for i, s in enumerate(seqs):
            n = int(rng.integers(1, 4))
            p0 = positions.get(int(s), 0)
            if p0 + n > 8 * 16:
                positions[int(s)] = p0 = 0
            toks += rng.integers(3, 300, size=n).tolist()
            sid += [i] * n
            pos += list(range(p0, p0 + n))
            positions[int(s)] = p0 + n
            tables[i] = np.arange(int(s) * 8, int(s) * 8 + 8)
        n_tokens += len(toks)
        m.forward_paged(np.array(toks, np.int32), np.array(sid, np.int32),
                        np.array(pos, np.int32), tables, None)
        st = m.core.expert_cache_stats()
        assert ((st["state"] >= 1).sum(axis=1) <= 2).all(), f"step {step}"
        assert (st["loads"] >= st["prefetch_issued"]).all()
        assert (st["prefetch_used"] + st["prefetch_wasted"] <= st["prefetch_issued"]).all()
    hp = m.config
    assert st["selections"].sum() == hp.n_layer * hp.n_expert_used * n_tokens


def test_pinned_experts_stay_resident(demo_dir: Path, demo_ref: tuple) -> None:
    cfg = Model.load(demo_dir).config
    pinned = np.zeros((cfg.n_layer, cfg.n_expert), bool)
    pinned[:, [3, 17, 40]] = True
    m = _cached(demo_dir, cfg.n_expert_used + 2, pinned=pinned, prefetch=False)
    st0 = m.core.expert_cache_stats()
    assert (st0["state"][pinned] == 3).all()
    assert st0["loads"].sum() == 0  # counters start after the pinned loads
    tokens, _ = _decode(m)
    assert tokens == demo_ref[0]
    st = m.core.expert_cache_stats()
    assert (st["state"][pinned] == 3).all()
    assert ((st["state"] >= 1).sum(axis=1) <= cfg.n_expert_used + 2).all()


def test_too_many_pinned_and_bad_configs_are_refused(demo_dir: Path) -> None:
    cfg = Model.load(demo_dir).config
    m = Model.load(demo_dir)
    pinned = np.zeros((cfg.n_layer, cfg.n_expert), bool)
    pinned[0, :4] = True
    with pytest.raises(ValueError, match="at most 3"):
        m.core.enable_expert_cache(4, pinned=pinned)
    with pytest.raises(ValueError, match="slots per layer"):
        m.core.enable_expert_cache(0)
    with pytest.raises(ValueError, match="load mode"):
        m.core.enable_expert_cache(8, load="tape")
    for readers in (0, 65):
        with pytest.raises(ValueError, match="readers must be in 1..64"):
            m.core.enable_expert_cache(8, readers=readers)
    m.core.enable_expert_cache(8)
    with pytest.raises(ValueError, match="already enabled"):
        m.core.enable_expert_cache(8)


def test_counters_of_one_chunk(demo_dir: Path) -> None:
    """One prefill chunk acquires each expert it routes to once: misses = loads = distinct
    experts used, and selections = the routes the forward pass reported."""
    cfg = Model.load(demo_dir).config
    m = Model.load(demo_dir, n_seq=1)
    m.core.enable_expert_cache(cfg.n_expert - 1, prefetch=False)
    routes = np.zeros((PROMPT.size, cfg.n_layer, cfg.n_expert_used), np.int32)
    m.core.forward(m.kv, PROMPT, np.zeros(PROMPT.size, np.int32),
                   np.arange(PROMPT.size, dtype=np.int32), None, m.slot_tables[:1], routes)
    st = m.core.expert_cache_stats()
    for il in range(cfg.n_layer):
        used = np.unique(routes[:, il, :])
        # one chunk: each used expert is acquired once, in its layer's waves, never found
        assert st["misses"][il] == len(used)
        assert st["hits"][il] == 0
        assert st["loads"][il] == len(used)
        assert st["selections"][il].sum() == PROMPT.size * cfg.n_expert_used
        np.testing.assert_array_equal(
            st["selections"][il], np.bincount(routes[:, il, :].ravel(),
                                              minlength=cfg.n_expert))


def test_misses_memory_holds_are_copied_without_the_reader(demo_dir: Path) -> None:
    """A miss whose expert the page cache holds, in a file already open, is copied on the
    forward's own thread (no read waits on a reader; only the repack into the slot's layout is
    left to one); only reads that need the storage, or a file's first open, go to the reader
    threads, whose wait is bounded. O_DIRECT bypasses the page cache: every miss goes to the
    readers there."""
    for f in demo_dir.glob("experts/*.bin"):  # into the page cache
        f.read_bytes()
    cfg = Model.load(demo_dir).config
    modes = ["pread"] + (["direct"] if _direct_ok(demo_dir) else [])
    for load in modes:
        m = _cached(demo_dir, cfg.n_expert // 2, load=load, prefetch=False)
        _decode(m, 4)  # opens the files it needs
        first = m.core.expert_cache_stats()
        _decode(m, 4)
        st = m.core.expert_cache_stats()
        assert first is not None and st is not None
        misses = st["misses"].sum() - first["misses"].sum()
        by_reader = st["reader_loads"].sum() - first["reader_loads"].sum()
        assert misses > 0 and first["reader_loads"].sum() > 0
        assert by_reader == (0 if load == "pread" else misses), load


@pytest.mark.parametrize("load, readers", [("pread", 4), ("pread", 1), ("direct", 2),
                                           ("uring", 2)])
def test_truncated_expert_file_fails_the_call_and_names_it(demo_dir: Path, tmp_path: Path,
                                                           load: str, readers: int) -> None:
    """A read error on a reader fails the forward call that waits for it, names the file, and
    every later call fails the same way."""
    copy = tmp_path / "m"
    shutil.copytree(demo_dir, copy)
    if load in ("direct", "uring") and not _direct_ok(copy):
        pytest.skip("this file system refuses O_DIRECT (tmpfs)")
    m = Model.load(copy, n_seq=1)
    m.core.enable_expert_cache(8, prefetch=True, load=load, readers=readers)
    _decode(m, 2)  # warm
    _evict_page_cache(copy)
    for f in (copy / "experts").glob("*.bin"):
        os.truncate(f, 64)
    with pytest.raises(WeightFileChangedError, match=r"experts/layer_\d+_expert_\d+\.bin"):
        _decode(m, 8)
    with pytest.raises(ModelFaultError, match="is shorter than when the model was loaded"):
        _decode(m, 1)  # and every later call: the model marked itself unhealthy
    del m  # joins the readers: must not hang or crash


def test_truncated_expert_file_at_load_is_a_clean_error(demo_dir: Path,
                                                        tmp_path: Path) -> None:
    copy = tmp_path / "m"
    shutil.copytree(demo_dir, copy)
    victim = copy / "experts" / "layer_1_expert_5.bin"
    os.truncate(victim, victim.stat().st_size // 2)
    cfg = EngineConfig(expert_cache=ExpertCacheConfig(expert_cache_size=8), progress=False)
    with pytest.raises(Exception, match="layer_1_expert_5.bin"):
        LLM(copy, config=cfg)


def test_plan_refuses_a_budget_below_one_layers_top_k(demo_dir: Path) -> None:
    m = Model.load(demo_dir)
    cfg = m.config
    eb = m.core.expert_bytes
    minimum_mb = cfg.n_expert_used * cfg.n_layer * eb / 1e6
    with pytest.raises(ValueError, match=f"minimum of {minimum_mb:.1f} MB"):
        plan_cache(m.core, ExpertCacheConfig(expert_cache_mb=0.1), cfg.n_layer, cfg.n_expert,
                   cfg.n_expert_used, 0, None)
    with pytest.raises(ValueError, match="must be in 8..64"):
        plan_cache(m.core, ExpertCacheConfig(expert_cache_size=3), cfg.n_layer, cfg.n_expert,
                   cfg.n_expert_used, 0, None)
    layer = cfg.n_layer * eb
    p = plan_cache(m.core, ExpertCacheConfig(expert_cache_mb=20 * layer / 2**20), cfg.n_layer,
                   cfg.n_expert, cfg.n_expert_used, 0, None)
    assert p.per_layer == 20
    # no budget given: everything resident when it fits, else what free memory allows
    p = plan_cache(m.core, ExpertCacheConfig(), cfg.n_layer, cfg.n_expert,
                   cfg.n_expert_used, 10 << 20, 1 << 34)
    assert p.per_layer is None and p.fits
    free = (10 << 20) + MIN_MARGIN_BYTES + 30 * layer  # small: the margin is its minimum
    p = plan_cache(m.core, ExpertCacheConfig(), cfg.n_layer, cfg.n_expert,
                   cfg.n_expert_used, 10 << 20, free)
    assert p.per_layer == 30 and not p.fits
    # every expert resident: in memory of its own (repacked) only when it fits
    every = ExpertCacheConfig(expert_cache_size=cfg.n_expert)
    p = plan_cache(m.core, every, cfg.n_layer, cfg.n_expert, cfg.n_expert_used, 10 << 20, free)
    assert p.per_layer is None and not p.fits  # asked for, but left to the OS's paging
    p = plan_cache(m.core, every, cfg.n_layer, cfg.n_expert, cfg.n_expert_used, 10 << 20,
                   1 << 34)
    assert p.per_layer is None and p.fits


def test_routing_history_pins_the_next_start(demo_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "m"
    shutil.copytree(demo_dir, copy)
    cfg = EngineConfig(expert_cache=ExpertCacheConfig(expert_cache_size=16), progress=False)
    llm = LLM(copy, config=cfg)
    llm.generate_ids(list(PROMPT), 8, temperature=0.0)
    llm.core.close()
    data = json.loads((copy / ROUTING_FILE).read_text())
    sel = np.asarray(data["selections"])
    assert sel.shape == (llm.model.config.n_layer, llm.model.config.n_expert)
    assert sel.sum() > 0
    pinned = load_pinned(copy, *sel.shape, 16)
    assert pinned is not None and (pinned.sum(axis=1) == 4).all()
    for il in range(sel.shape[0]):  # the most selected experts of each layer
        assert sel[il][pinned[il]].min() >= sel[il][~pinned[il]].max()
    llm2 = LLM(copy, config=cfg)
    st = llm2.model.core.expert_cache_stats()
    assert (st["state"][pinned] == 3).all()
    off = EngineConfig(expert_cache=ExpertCacheConfig(expert_cache_size=16, expert_pin=False),
                       progress=False)
    st = LLM(copy, config=off).model.core.expert_cache_stats()
    assert (st["state"] != 3).all()


def test_routes_output_matches_the_cache_selections(shared_dir: Path) -> None:
    m = Model.load(shared_dir, n_seq=1)
    cfg = m.config
    routes = np.full((PROMPT.size, cfg.n_layer, cfg.n_expert_used), -1, np.int32)
    m.core.forward(m.kv, PROMPT, np.zeros(PROMPT.size, np.int32),
                   np.arange(PROMPT.size, dtype=np.int32), None, m.slot_tables[:1], routes)
    assert routes.min() >= 0 and routes.max() < cfg.n_expert
    for t in range(PROMPT.size):  # k distinct experts per token and layer
        for il in range(cfg.n_layer):
            assert len(set(routes[t, il].tolist())) == cfg.n_expert_used
    with pytest.raises(Exception, match="routes must be an int32 array"):
        m.core.forward(m.kv, PROMPT, np.zeros(PROMPT.size, np.int32),
                       np.arange(PROMPT.size, dtype=np.int32), None, m.slot_tables[:1],
                       routes[:3])


def test_auto_load_mode_picks_direct_where_the_file_system_allows(demo_dir: Path) -> None:
    assert resolve_load("auto", demo_dir) == ("direct" if _direct_ok(demo_dir) else "pread")
    assert resolve_load("mmap", demo_dir) == "mmap"


def test_stats_without_cache_is_none(shared_dir: Path) -> None:
    assert Model.load(shared_dir).core.expert_cache_stats() is None


# -- loads overlapped with compute, read-ahead two layers deep, the reader pool's size --------

def _storage_loads(demo_dir: Path) -> str:
    """A load mode whose misses all go to the reader threads (O_DIRECT, or buffered reads of
    files dropped from the page cache; None where neither needs the storage, as on tmpfs)."""
    if _direct_ok(demo_dir):
        return "direct"
    pytest.skip("this file system refuses O_DIRECT (tmpfs): every read is a copy from memory")


def _assert_resident_bits(logits: list[np.ndarray], tokens: list[int], ref: tuple) -> None:
    assert tokens == ref[0]
    for a, b in zip(logits, ref[1], strict=True):
        assert np.array_equal(a, b)


def test_experts_run_as_they_land_while_others_load(demo_dir: Path, demo_ref: tuple) -> None:
    """One reader and the smallest budget: most of a decode wave's experts are missing and
    read one after another, so the first to land runs while the others are still being read
    (counted as overlapped), in whatever order they land; the bits are the resident model's."""
    load = _storage_loads(demo_dir)
    cfg = Model.load(demo_dir).config
    m = _cached(demo_dir, cfg.n_expert_used, load=load, prefetch=False, readers=1)
    tokens, logits = _decode(m)
    _assert_resident_bits(logits, tokens, demo_ref)
    st = m.core.expert_cache_stats()
    assert st is not None
    assert st["reader_loads"].sum() > 0
    # every expert that ran early was one of a wave that still had loads in flight
    assert 0 < st["overlapped"].sum() <= (st["hits"] + st["misses"]).sum()


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("load, readers", [("pread", 1), ("direct", 1), ("direct", 4),
                                           ("uring", 2)])
def test_read_ahead_depths_give_the_resident_output(demo_dir: Path, demo_ref: tuple, depth: int,
                                                    readers: int, load: str) -> None:
    """Read-ahead one or two layers deep, any reader count and load mode: the same bits; only
    two layers deep queues far prefetches."""
    if load != "pread":
        _storage_loads(demo_dir)
    cfg = Model.load(demo_dir).config
    _evict_page_cache(demo_dir)
    m = _cached(demo_dir, cfg.n_expert // 4, load=load, readers=readers, prefetch_depth=depth)
    tokens, logits = _decode(m)
    _assert_resident_bits(logits, tokens, demo_ref)
    st = m.core.expert_cache_stats()
    assert st is not None
    assert ((st["state"] >= 1).sum(axis=1) <= cfg.n_expert // 4).all()
    assert (st["prefetch_used"] + st["prefetch_wasted"] <= st["prefetch_issued"]).all()
    assert (st["prefetch_far"].sum() > 0) == (depth == 2)
    assert st["prefetch_far"][:2].sum() == 0  # layers 0 and 1 are never two layers ahead
    timing = m.core.expert_cache_timing()
    assert timing is not None and timing["prefetch_depth"] == depth


def test_far_prefetches_no_longer_predicted_are_cancelled(demo_dir: Path,
                                                          demo_ref: tuple) -> None:
    """Two layers ahead with one reader: a prompt routes to most experts, so far more is
    queued than one reader reads before the layer begins; what the nearer prediction leaves
    out and what is still queued when the layer begins is dropped unread (cancelled), and
    every read-ahead is accounted for."""
    load = _storage_loads(demo_dir)
    cfg = Model.load(demo_dir).config
    # queued whatever share of the time demand loads keep the storage busy (a slow run, as
    # under a sanitizer, would otherwise hold every prefetch back before it is queued)
    m = _cached(demo_dir, cfg.n_expert // 2, load=load, readers=1, prefetch_depth=2,
                prefetch_busy_pct=100)
    tokens, logits = _decode(m)
    _assert_resident_bits(logits, tokens, demo_ref)
    st = m.core.expert_cache_stats()
    assert st is not None
    assert st["prefetch_far"].sum() > 0 and st["prefetch_cancelled"].sum() > 0
    assert st["prefetch_issued"].sum() > 0
    assert (st["prefetch_used"] + st["prefetch_wasted"] <= st["prefetch_issued"]).all()


def test_automatic_depth_follows_the_measured_read_and_layer_times(demo_dir: Path,
                                                                   demo_ref: tuple) -> None:
    """prefetch_depth 0: the cache averages each reader's read and each layer's compute, and
    reads two layers ahead exactly while a read takes longer than a layer."""
    load = _storage_loads(demo_dir)
    cfg = Model.load(demo_dir).config
    m = _cached(demo_dir, cfg.n_expert_used, load=load, readers=2, prefetch_depth=0)
    t0 = m.core.expert_cache_timing()
    assert t0 == {"read_ns": 0, "layer_ns": 0, "prefetch_depth": 1}  # nothing measured yet
    tokens, logits = _decode(m)
    _assert_resident_bits(logits, tokens, demo_ref)
    t = m.core.expert_cache_timing()
    assert t is not None and t["read_ns"] > 0 and t["layer_ns"] > 0
    assert t["prefetch_depth"] == (2 if t["read_ns"] > t["layer_ns"] else 1)
    off = _cached(demo_dir, cfg.n_expert_used, load=load, prefetch=False)
    assert off.core.expert_cache_timing()["prefetch_depth"] == 0
    assert Model.load(demo_dir).core.expert_cache_timing() is None
    with pytest.raises(ValueError, match="prefetch_depth must be 0"):
        Model.load(demo_dir).core.enable_expert_cache(8, prefetch_depth=3)


# busy_pct 1: once demand loads kept the storage busy (nearly any time), no prefetch starts;
# 100: only a demand load queued or being read holds one back (which of them happen depends on
# timing; the bits never do)
@pytest.mark.parametrize("busy_pct", [1, 100])
@pytest.mark.parametrize("load, readers, depth", [("direct", 1, 2), ("direct", 2, 1),
                                                  ("pread", 1, 2), ("uring", 2, 2)])
def test_prefetch_fills_only_idle_storage_and_gives_the_resident_output(
        demo_dir: Path, demo_ref: tuple, busy_pct: int, load: str, readers: int,
        depth: int) -> None:
    """Prefetches skipped while demand loads hold the storage, stopped part-way for a demand
    load waiting for a reader, or not started because the expert they would evict is likelier
    to be used: the same bits as the resident model, and every prefetch accounted for."""
    if load != "pread":
        _storage_loads(demo_dir)
    cfg = Model.load(demo_dir).config
    per_layer = cfg.n_expert // 4
    _evict_page_cache(demo_dir)  # pread misses need the storage too
    m = _cached(demo_dir, per_layer, load=load, readers=readers, prefetch_depth=depth,
                prefetch_busy_pct=busy_pct)
    tokens, logits = _decode(m)
    _assert_resident_bits(logits, tokens, demo_ref)
    st = m.core.expert_cache_stats()
    assert st is not None
    assert ((st["state"] >= 1).sum(axis=1) <= per_layer).all()
    # an aborted prefetch frees its slot: never used, never evicted as wasted
    assert (st["prefetch_used"] + st["prefetch_wasted"] + st["prefetch_aborted"]
            <= st["prefetch_issued"]).all()
    assert (st["loads"] >= st["prefetch_issued"]).all()
    if load == "uring":  # a uring read is one submission: nothing stops it part-way
        assert st["prefetch_aborted"].sum() == 0
    # every layer but the first is predicted (by the one before), and most of it right
    assert st["predicted"][0] == 0 and (st["predicted"][1:] > 0).all()
    assert (st["predicted_right"] <= st["predicted"]).all()
    assert st["predicted_right"].sum() > st["predicted"].sum() // 2


def test_prefetch_held_back_while_demand_loads_keep_the_storage_busy(demo_dir: Path) -> None:
    """The smallest budget reads at every token, so once the first 50 ms window of the busy
    share has passed, demand loads kept the storage busy more than 1% of the time: from then on
    no prediction is queued, and the bits are still the resident model's."""
    load = _storage_loads(demo_dir)
    cfg = Model.load(demo_dir).config
    n = 6 * N_DECODE
    m = _cached(demo_dir, cfg.n_expert_used, load=load, readers=2, prefetch_busy_pct=1)
    t0 = time.perf_counter()
    tokens, logits = _decode(m, n)
    elapsed = time.perf_counter() - t0
    assert elapsed > 0.1  # past the first window
    _assert_resident_bits(logits, tokens, _decode(Model.load(demo_dir, n_seq=1), n))
    st = m.core.expert_cache_stats()
    assert st is not None
    assert st["stall_ns"].sum() > 0.01 * elapsed * 1e9  # busy well over 1% of the time
    assert st["prefetch_busy"].sum() > 0


def test_prefetch_busy_share_is_checked(demo_dir: Path) -> None:
    for bad in (0, 101):
        with pytest.raises(ValueError, match="prefetch_busy_pct must be in 1..100"):
            Model.load(demo_dir).core.enable_expert_cache(8, prefetch_busy_pct=bad)


def test_prefetch_spares_experts_likelier_to_be_used(demo_dir: Path, demo_ref: tuple) -> None:
    """The smallest budget (one token's experts) on a skewed router: the slots hold the hot
    experts of the running steps, and a prediction that names them too never evicts them,
    so prefetches are spared; the bits are the resident model's."""
    cfg = Model.load(demo_dir).config
    m = _cached(demo_dir, cfg.n_expert_used, load="pread", readers=2, prefetch_depth=1,
                prefetch_busy_pct=100)
    tokens, logits = _decode(m, 24)
    ref = _decode(Model.load(demo_dir, n_seq=1), 24)
    _assert_resident_bits(logits, tokens, ref)
    st = m.core.expert_cache_stats()
    assert st is not None
    assert st["prefetch_spared"].sum() > 0


def test_storage_probe_reads_what_it_says(tmp_path: Path) -> None:
    """The probe reads exactly n_chunks chunks (fewer bytes only at a file's end), from every
    file in turn, with any number in flight; a FIFO or a missing file is an OSError naming it,
    at once (never a hang); bad arguments are a ValueError."""
    from colibri.engine import _core

    files: list[str] = []
    for i, size in enumerate((1 << 20, 1 << 20, 3 << 18, 100 << 10)):
        f = tmp_path / f"f{i}.bin"
        f.write_bytes(os.urandom(size))
        files.append(str(f))
    for depth in (1, 3, 8):
        gbps, nbytes = _core.storage_probe(files[:2], 256 << 10, 0, 8, depth, direct=False)
        assert nbytes == 8 * (256 << 10) and gbps > 0
    # three chunks of 256 KiB in the third file, one of 512 KiB (reads stay inside it)
    assert _core.storage_probe(files[2:3], 256 << 10, 5, 6, 2, direct=False)[1] == 6 << 18
    assert _core.storage_probe(files[2:3], 512 << 10, 0, 2, 2, direct=False)[1] == 2 << 19
    # a file shorter than a chunk: each read ends at its end
    assert _core.storage_probe(files[3:], 256 << 10, 0, 3, 3, direct=False)[1] == 300 << 10
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="fifo"):
        _core.storage_probe([files[0], str(fifo)], 4096, 0, 4, 2, direct=False)
    with pytest.raises(OSError, match="missing"):
        _core.storage_probe([str(tmp_path / "missing")], 4096, 0, 4, 2, direct=False)
    for bad in (dict(chunk=1000), dict(depth=0), dict(depth=65), dict(n_chunks=0)):
        kw = dict(chunk=4096, first=0, n_chunks=4, depth=1) | bad
        with pytest.raises(ValueError, match="storage probe"):
            _core.storage_probe(files[:1], kw["chunk"], kw["first"], kw["n_chunks"],
                                kw["depth"], direct=False)


def test_reader_count_is_the_fewest_near_the_best_rate(demo_dir: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """The readers are the fewest reads in flight within 90% of the best measured rate, 2 to
    16; unmeasurable storage gets the default, and the start log says which and why."""
    assert readers_for({1: 1.0, 2: 1.9, 4: 3.5, 8: 3.8, 16: 3.9}) == 8
    assert readers_for({1: 2.0, 2: 2.0, 4: 2.1, 8: 2.0, 16: 1.9}) == MIN_READERS
    assert readers_for({1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0, 16: 16.0}) == 16
    n, why = probe_readers(demo_dir)
    assert MIN_READERS <= n <= MAX_READERS and why
    total = sum(f.stat().st_size for f in demo_dir.glob("experts/*.bin"))
    if total < PROBE_CHUNK * PROBE_CHUNKS * len(PROBE_DEPTHS) or not _direct_ok(demo_dir):
        assert n == DEFAULT_READERS and why.startswith("the default")
    else:
        assert "GB/s at 1" in why
    cfg = Model.load(demo_dir).config
    with caplog.at_level("INFO", logger="colibri.engine"):
        m = Model.load(demo_dir, n_seq=1)
        mon = start_expert_cache(m, demo_dir, ExpertCacheConfig(expert_cache_size=8,
                                                                expert_pin=False), 0)
    assert (mon.plan.readers, mon.plan.readers_reason) == (n, why)
    assert f"{n} readers ({why})" in caplog.text
    with caplog.at_level("INFO", logger="colibri.engine"):
        m = Model.load(demo_dir, n_seq=1)
        mon = start_expert_cache(m, demo_dir, ExpertCacheConfig(
            expert_cache_size=cfg.n_expert_used, expert_readers=3, expert_pin=False), 0)
    assert mon.plan.readers == 3 and "3 readers (--expert-readers)" in caplog.text

"""Routing traces and their replay (engine.tools.routing_trace, engine.tools.replay).

- LRU and Belady on hand-made traces give the hits counted by hand; Belady equals a brute
  force search over every eviction choice on small traces;
- Belady's optimum is at least every other policy, pinned or not, at every budget, on random
  and on structured (skewed, drifting, repeating) traces;
- the key check: decoding the demo model with the core's expert cache (prefetch off) gives
  exactly the per-layer hits and misses the "lru+heat" replay predicts from the trace of the
  same run, at budgets below, at and above the experts per token, with and without pinned
  experts, over prompts long enough to need several waves;
- `colibri bench --routing-trace` writes a trace of its workload or of a text, and
  `colibri replay` reads it.
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import numpy as np
import pytest

import colibri.engine.tools.routing_trace as rt
from colibri.engine.tools.cli import main
from colibri.engine.tools.replay import (
    POLICIES,
    belady,
    hot_set,
    layer_requests,
    replay_table,
    simulate,
    split_chunk,
)
from colibri.engine.tools.routing_trace import RouteRecorder, RoutingTrace, greedy_run
from tests.conftest import quick_params

ROOT = Path(__file__).resolve().parent.parent


def _trace(tokens: list[list[list[int]]], n_expert: int, chunks: list[int] | None = None
           ) -> RoutingTrace:
    """tokens[t][layer] = the experts of token t; one chunk per token unless given."""
    r = np.asarray(tokens, np.int32)
    c = np.asarray(chunks if chunks is not None else [1] * r.shape[0], np.int32)
    return RoutingTrace(r, c, np.zeros(r.shape[0], bool), n_expert)


# -- hand-made traces -----------------------------------------------------------------------

def test_lru_on_a_hand_made_trace() -> None:
    # 3 slots, one layer, two experts per token:
    # {0,1}: M M | {0,2}: H M (empty slot) | {1,3}: H, M evicts 0 (1 is in the wave)
    # {0,1}: M evicts 2, H | {2,3}: M evicts 3, M evicts 0 (2 is in the wave)
    tr = _trace([[[0, 1]], [[0, 2]], [[1, 3]], [[0, 1]], [[2, 3]]], 4)
    r = simulate(tr, 3, "lru")
    assert r.hits.tolist() == [3] and r.misses.tolist() == [7]
    # scoring from the fourth token counts {0,1} and {2,3} only: one hit, three misses
    r = simulate(tr, 3, "lru", score_from=3)
    assert r.hits.tolist() == [1] and r.misses.tolist() == [3]


def test_a_chunk_wider_than_the_cache_runs_in_waves() -> None:
    # 2 slots, one chunk of two tokens asking for 0, 1, 2, 3: the wave {0,1} runs, then 2
    # and 3 evict them. The next token asks for {0,2}: LRU evicts 2 (the older) for 0, then
    # misses 2; LFU and lru+heat count 2's new selection first and evict 3, so 2 hits
    tr = _trace([[[0, 1]], [[2, 3]], [[0, 2]]], 4, chunks=[2, 1])
    r = simulate(tr, 2, "lru")
    assert r.hits.tolist() == [0] and r.misses.tolist() == [6]
    for policy in ("lfu", "lru+heat"):
        r = simulate(tr, 2, policy)
        assert r.hits.tolist() == [1] and r.misses.tolist() == [5], policy


def test_belady_on_a_hand_made_trace() -> None:
    # 0 1 2 0 1 with 2 slots: 2 evicts 1 (next used later than 0), 0 hits, 1 misses; from
    # the best start ({0, 1}) that is 3 hits and 2 misses (2 and 1)
    tr = _trace([[[e]] for e in (0, 1, 2, 0, 1)], 3)
    r = belady(tr, 2)
    assert r.hits.tolist() == [3] and r.misses.tolist() == [2]


def _brute_force_misses(seq: list[int], n_expert: int, n_slots: int) -> int:
    """The fewest misses over every start of n_slots experts and every eviction choice."""
    best = {frozenset(s): 0 for s in itertools.combinations(range(n_expert), n_slots)}
    for e in seq:
        nxt: dict[frozenset[int], int] = {}
        for state, cost in best.items():
            if e in state:
                cands = [(state, cost)]
            else:
                cands = [((state - {v}) | {e}, cost + 1) for v in state]
            for s, c in cands:
                if c < nxt.get(s, 1 << 30):
                    nxt[s] = c
        best = nxt
    return min(best.values())


def test_belady_is_the_optimum_by_brute_force() -> None:
    rng = np.random.default_rng(7)
    for _ in range(30):
        n_expert, n_slots = 5, int(rng.integers(1, 4))
        seq = rng.integers(0, n_expert, int(rng.integers(1, 14))).tolist()
        tr = _trace([[[e]] for e in seq], n_expert)
        assert int(belady(tr, n_slots).misses[0]) == _brute_force_misses(seq, n_expert,
                                                                         n_slots), seq


# -- Belady bounds every policy -------------------------------------------------------------

def _random_trace(rng: np.random.Generator, n_tokens: int, n_layer: int, n_expert: int,
                  k: int, weights: np.ndarray | None = None) -> RoutingTrace:
    routes = np.zeros((n_tokens, n_layer, k), np.int32)
    for t in range(n_tokens):
        for lay in range(n_layer):
            p = None if weights is None else weights[t, lay]
            routes[t, lay] = rng.choice(n_expert, k, replace=False, p=p)
    chunks: list[int] = []
    left = n_tokens
    while left:  # mostly single tokens, some prompt-sized chunks (several waves)
        c = int(min(left, rng.choice([1, 1, 1, 3, 40, 90])))
        chunks.append(c)
        left -= c
    return RoutingTrace(routes, np.asarray(chunks, np.int32), np.zeros(n_tokens, bool),
                        n_expert)


def _structured_weights(rng: np.random.Generator, n_tokens: int, n_layer: int,
                        n_expert: int) -> np.ndarray:
    """Zipf-like popularity per layer whose ranking drifts, with a repeating motif."""
    w = np.zeros((n_tokens, n_layer, n_expert))
    for lay in range(n_layer):
        perm = rng.permutation(n_expert)
        for t in range(n_tokens):
            if t % 50 == 0:
                perm = np.roll(perm, 3)  # drift: the hot set moves
            zipf = 1.0 / (1.0 + np.arange(n_expert)) ** 1.2
            w[t, lay, perm] = zipf
            w[t, lay, (t % 7) * 2 % n_expert] += 2.0  # a periodic favourite
            w[t, lay] /= w[t, lay].sum()
    return w


@pytest.mark.parametrize("kind", ["random", "structured"])
def test_belady_bounds_every_policy(kind: str) -> None:
    rng = np.random.default_rng(11 if kind == "random" else 12)
    n_tokens, n_layer, n_expert, k = 400, 2, 16, 4
    weights = _structured_weights(rng, n_tokens, n_layer, n_expert) if kind == "structured" \
        else None
    tr = _random_trace(rng, n_tokens, n_layer, n_expert, k, weights)
    reqs = layer_requests(tr)
    half = split_chunk(tr)
    n_checked = 0
    for n_slots in (2, 4, 6, 8, 12):
        for score_from in (0, half):
            opt = belady(tr, n_slots, score_from, reqs)
            total = opt.hits + opt.misses
            for policy in POLICIES:
                for n_pin in (0, 1, n_slots // 2, n_slots - 1):
                    pins = hot_set(tr, n_pin, half) if n_pin else None
                    r = simulate(tr, n_slots, policy, pins, score_from=score_from,
                                 requests=reqs)
                    assert np.array_equal(r.hits + r.misses, total)  # the same requests
                    assert np.all(opt.hits >= r.hits), (n_slots, policy, n_pin, score_from)
                    n_checked += 1
    assert n_checked == 5 * 2 * 3 * 4
    t = replay_table(tr)
    for n in t["budgets"]:
        rows = [r for r in t["rows"] if r["slots"] == n]
        best = [r for r in rows if r["policy"] == "belady"][0]["hit_rate"]
        assert len(rows) > 1 and all(r["hit_rate"] <= best for r in rows)


def test_trace_file_round_trip_and_refusals(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    tr = _random_trace(rng, 50, 2, 8, 2)
    back = RoutingTrace.load(tr.save(tmp_path / "t.npz"))
    assert np.array_equal(back.routes, tr.routes) and np.array_equal(back.chunks, tr.chunks)
    assert back.n_expert == 8
    with pytest.raises(ValueError, match="sum to"):
        RoutingTrace(tr.routes, tr.chunks[:-1], tr.prefill, 8)
    with pytest.raises(ValueError, match="expert ids"):
        RoutingTrace(tr.routes, tr.chunks, tr.prefill, 4)
    twice = tr.routes.copy()
    twice[0, 0] = [1, 1]
    with pytest.raises(ValueError, match="twice"):
        RoutingTrace(twice, tr.chunks, tr.prefill, 8)
    with pytest.raises(ValueError, match="pinned"):
        simulate(tr, 2, "lru", [[0, 1], [0]])


# -- the core's expert cache against the replay ---------------------------------------------

def test_chunk_size_is_the_cores() -> None:
    header = (ROOT / "csrc" / "clb_model_internal.h").read_text()
    m = re.search(r"#define CLB_MAX_BATCH (\d+)", header)
    assert m is not None and int(m.group(1)) == rt.CORE_CHUNK_TOKENS


@pytest.fixture(scope="module")
def demo() -> tuple[Path, np.ndarray]:
    from colibri.engine.demo import default_model_path
    from colibri.engine.format.convert import ensure_converted
    from colibri.engine.text.tokenizer import Tokenizer

    folder = ensure_converted(default_model_path(), "q8", progress=False)
    text = rt.read_trace_text("demo")
    ids = Tokenizer.from_dir(folder).encode(text[:20000], add_special_tokens=False)
    return folder, np.asarray(ids[:400], np.int32)


def _cached_run(folder: Path, ids: np.ndarray, n_slots: int,
                pins: list[list[int]] | None) -> tuple[RoutingTrace, dict[str, np.ndarray]]:
    from colibri.engine.executor.model import Model

    model = Model.load(folder, n_ctx=1024)
    pinned = None
    if pins is not None:
        pinned = np.zeros((model.config.n_layer, model.config.n_expert), bool)
        for lay, p in enumerate(pins):
            pinned[lay, p] = True
    model.core.enable_expert_cache(n_slots, prefetch=False, pinned=pinned)
    rec = RouteRecorder(model)
    greedy_run(rec, ids[:100], 40)  # 800 rows: two waves by rows alone
    greedy_run(rec, ids[100:400], 24)  # 2400 rows: five
    return rec.trace(), model.core.expert_cache_stats()


@pytest.mark.parametrize("n_slots", quick_params([4, 8, 12, 16, 32], [8]))
def test_core_cache_hits_are_the_replays(demo: tuple[Path, np.ndarray], n_slots: int) -> None:
    folder, ids = demo
    tr, st = _cached_run(folder, ids, n_slots, None)
    assert tr.n_tokens == 100 + 40 + 300 + 24 and tr.chunks.tolist()[:2] == [100, 1]
    r = simulate(tr, n_slots, "lru+heat")
    assert r.hits.tolist() == st["hits"].tolist()
    assert r.misses.tolist() == st["misses"].tolist()
    assert int(st["misses"].sum()) > 0 and int(st["hits"].sum()) > 0
    if n_slots == 8:  # the check tells the policies apart: plain LRU predicts other counts
        assert simulate(tr, n_slots, "lru").hits.tolist() != st["hits"].tolist()


@pytest.mark.parametrize("n_slots", quick_params([8, 16], [8]))
def test_core_cache_hits_with_pinned_experts(demo: tuple[Path, np.ndarray],
                                             n_slots: int) -> None:
    folder, ids = demo
    plain, _ = _cached_run(folder, ids, n_slots, None)
    pins = hot_set(plain, n_slots // 2, plain.chunks.size)
    tr, st = _cached_run(folder, ids, n_slots, pins)
    assert np.array_equal(tr.routes, plain.routes)  # the cache changes no routing
    assert (st["state"] == 3).sum(axis=1).tolist() == [n_slots // 2] * tr.n_layer
    r = simulate(tr, n_slots, "lru+heat", pins)
    assert r.hits.tolist() == st["hits"].tolist()
    assert r.misses.tolist() == st["misses"].tolist()


# -- the command line -----------------------------------------------------------------------

def test_bench_writes_a_trace_and_replay_reads_it(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.npz"
    rc = main(["bench", "--prompt-tokens", "16", "--gen-tokens", "8", "--repeat", "1",
               "--probe-mib", "16", "--json", "--routing-trace", str(out)])
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    tr = RoutingTrace.load(out)
    assert tr.n_tokens == 24 and tr.chunks.tolist() == [16] + [1] * 8
    assert tr.prefill.tolist() == [True] * 16 + [False] * 8
    assert tr.n_expert == 64 and tr.k == 8 and tr.model == result["model"]
    # the same workload traced again routes the same way
    from colibri.engine.executor.model import Model
    from colibri.engine.tools.bench import bench_prompt

    model = Model.load(result["model"], n_ctx=24)
    rec = RouteRecorder(model)
    tokens = greedy_run(rec, bench_prompt(model.n_vocab, 16), 8)
    assert tokens[:8] == result["greedy_tokens"][:8]
    assert np.array_equal(rec.trace().routes, tr.routes)

    assert main(["replay", str(out), "--budgets", "8,16"]) == 0
    table = capsys.readouterr().out
    assert "belady (optimum)" in table and "lru+heat + pin 1/2" in table
    assert main(["replay", str(out), "--budgets", "8,16", "--json"]) == 0
    t = json.loads(capsys.readouterr().out)
    assert t["budgets"] == [8, 16] and t["n_tokens"] == 24
    assert {r["policy"] for r in t["rows"]} == {*POLICIES, "belady"}


def test_bench_traces_a_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "text.txt"
    text.write_text(rt.read_trace_text("demo")[:6000], encoding="utf-8")
    out = tmp_path / "text.npz"
    rc = main(["bench", "--prompt-tokens", "20", "--gen-tokens", "5", "--repeat", "1",
               "--probe-mib", "16", "--routing-trace", str(out), "--trace-text", str(text),
               "--trace-tokens", "75"])
    assert rc == 0
    capsys.readouterr()
    tr = RoutingTrace.load(out)
    assert tr.n_tokens == 75 and tr.chunks.tolist() == ([20] + [1] * 5) * 3
    assert str(text) in tr.source and "greedy" in tr.source

    # following the text: the decode steps route exactly as a prefill of the whole piece
    rc = main(["bench", "--prompt-tokens", "20", "--gen-tokens", "5", "--repeat", "1",
               "--probe-mib", "16", "--routing-trace", str(out), "--trace-text", str(text),
               "--trace-tokens", "75", "--trace-follow", "--json"])
    assert rc == 0
    model_dir = json.loads(capsys.readouterr().out)["model"]
    tr = RoutingTrace.load(out)
    assert tr.n_tokens == 75 and "the text's next tokens" in tr.source
    from colibri.engine.executor.model import Model
    from colibri.engine.text.tokenizer import Tokenizer

    ids = Tokenizer.from_dir(model_dir).encode(text.read_text(encoding="utf-8"),
                                               add_special_tokens=False)
    rec = RouteRecorder(Model.load(model_dir, n_ctx=25))
    for i in range(3):
        greedy_run(rec, np.asarray(ids[25 * i:25 * (i + 1)], np.int32), 0)
    assert rec.trace().chunks.tolist() == [25] * 3
    assert np.array_equal(rec.trace().routes, tr.routes)


def test_bad_trace_arguments_are_one_line(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--trace-text", "demo"]) == 2
    assert "--trace-text needs --routing-trace" in capsys.readouterr().err
    assert main(["bench", "--routing-trace", str(tmp_path / "t.npz"), "--trace-follow"]) == 2
    assert "--trace-follow needs --trace-text" in capsys.readouterr().err
    assert main(["bench", "--routing-trace", str(tmp_path / "no" / "t.npz")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["replay", str(tmp_path / "missing.npz")]) == 2
    assert capsys.readouterr().err.startswith("colibri: error: ")

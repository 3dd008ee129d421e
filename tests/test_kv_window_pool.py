"""The windowed KV pool: gpt-oss's sliding-window layers and Llama 4's chunked layers keep their
K/V in a pool of their own, read through a block table of its own, and a sequence gives back
that pool's blocks once every later query's window (or chunk) has left them.

On tiny random checkpoints with a window (chunk) of 32 positions, two blocks:
- the raw paged step: a prompt of several windows in unequal chunks, then greedy decoding past
  more windows, gives bit for bit the logits of one pool for every layer (today's path), with
  the windowed pool's blocks given back as it goes (held blocks bounded by window / 16 + 1, plus
  the chunk being computed); the prompt in one pass likewise; both within 1e-4 of transformers
  and its greedy tokens;
- the step engine: the same tokens with the pool as without it and as transformers' generate,
  its windowed blocks bounded at every step; batches, preemption (a pool too small for every
  request), n > 1 forks and prefix-cache hits give each request's tokens alone; and every
  block is back in its pool at the end.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from colibri.engine.core.block_manager import BLOCK_SIZE, BlockManager  # noqa: E402
from colibri.engine.executor.model import Model, kv_split_block_bytes  # noqa: E402
from tests.conftest import quick_params  # noqa: E402
from tests.parity_helpers import rel_max  # noqa: E402
from tests.tiny_models import VOCAB_SIZE, TinyCheckpoints  # noqa: E402

SPAN = 32  # the window (gpt-oss) or chunk (Llama 4): two blocks
CASES = {"gpt_oss": {"sliding_window": SPAN}, "llama4": {"attention_chunk_size": SPAN}}
N_PROMPT = 150  # over four windows
N_DECODE = 60  # two more windows
CUTS = [0, 21, 70, 117, N_PROMPT]  # chunks crossing block and window edges
N_CTX = 256


class Case:
    def __init__(self, arch: str, checkpoints: TinyCheckpoints) -> None:
        self.arch = arch
        self.ckpt = checkpoints.get(arch, seed=3, **CASES[arch])
        self.hf_dir = self.ckpt.hf_dir
        self.f32 = self.ckpt.converted("f32")
        self.prompt = np.random.default_rng(7).integers(0, VOCAB_SIZE, N_PROMPT).astype(np.int32)


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest, checkpoints: TinyCheckpoints) -> Case:
    return Case(request.param, checkpoints)


# the longest engine tests run on the chunked layers in the whole suite only: the quick pass
# runs them on the sliding window, and every raw-step test on both
@pytest.fixture(scope="module", params=quick_params(CASES, ["gpt_oss"]))
def engine_case(request: pytest.FixtureRequest, checkpoints: TinyCheckpoints) -> Case:
    return Case(request.param, checkpoints)


def _manager(m: Model) -> BlockManager:
    cfg = m.config
    return BlockManager(m.n_kv_blocks, BLOCK_SIZE, True, 0, m.n_kv_win_blocks,
                        cfg.sliding_window or 0 if m.n_kv_win_blocks else 0,
                        cfg.attn_chunk or 0 if m.n_kv_win_blocks else 0)


def _bound(n_step: int) -> int:
    """Windowed blocks a sequence may hold while a step computes n_step of its tokens."""
    return SPAN // BLOCK_SIZE + 1 + -(-(n_step - 1) // BLOCK_SIZE)


def _run(m: Model, prompt: np.ndarray, cuts: list[int], n_decode: int,
         held: list[int] | None = None) -> tuple[np.ndarray, list[int]]:
    """The prompt in chunks cut at `cuts`, then n_decode greedy tokens, through forward_paged
    over blocks of a real BlockManager (windowed blocks given back before each step). Returns
    every position's logits and the tokens generated; `held` receives the windowed blocks
    held during each step."""
    bm = _manager(m)
    assert bm.allocate_prompt("s", []) == 0
    tokens = list(map(int, prompt))
    out: list[np.ndarray] = []
    steps = list(zip(cuts[:-1], cuts[1:], strict=True))
    gen: list[int] = []
    for k in range(len(steps) + n_decode):
        a, b = steps[k] if k < len(steps) else (len(tokens) - 1, len(tokens))
        bm.release_window("s", a)
        assert bm.grow("s", b)
        if held is not None and bm.n_win_blocks:
            held.append(bm.win_held("s"))
            assert bm.win_held("s") <= _bound(b - a), (a, b, bm.win_table("s"))
        table = np.asarray([bm.table("s")], np.int32)
        win = np.asarray([bm.win_table("s")], np.int32) if bm.n_win_blocks else None
        logits = m.forward_paged(np.asarray(tokens[a:b], np.int32), np.zeros(b - a, np.int32),
                                 np.arange(a, b, dtype=np.int32), table, win_tables=win)
        out.append(logits)
        if k >= len(steps) - 1 and len(gen) < n_decode:
            gen.append(int(np.argmax(logits[-1])))
            tokens.append(gen[-1])
    bm.free("s")
    assert bm.n_free == bm.n_blocks and bm.n_win_free == bm.n_win_blocks
    return np.concatenate(out), gen


def test_the_windowed_layers_are_split_off(case: Case, checkpoints: TinyCheckpoints) -> None:
    m = Model.load(case.f32, threads=2, n_ctx=N_CTX, n_seq=0, kv_blocks=20, kv_win_blocks=6)
    full, win = kv_split_block_bytes(m.config, "f32") or (0, 0)
    one = m.kv_block_bytes()
    assert full + win == one and 0 < win < one
    assert (m.kv.block_bytes, m.kv.win_block_bytes, m.n_kv_win_blocks) == (full, win, 6)
    if case.arch != "gpt_oss":
        return
    # a model without windowed layers (or only windowed ones) has nothing to split
    for arch in ("llama", "mistral"):
        dense = checkpoints.get(arch).converted("f32")
        assert kv_split_block_bytes(Model.load(dense, n_seq=0, kv_blocks=4).config) is None
        with pytest.raises(ValueError, match="no sliding-window or chunked layers"):
            Model.load(dense, n_seq=0, kv_blocks=4, kv_win_blocks=2)


def test_windowed_pool_gives_the_logits_of_one_pool_and_transformers(case: Case) -> None:
    one = Model.load(case.f32, threads=2, n_ctx=N_CTX, n_seq=0, kv_blocks=20)
    two = Model.load(case.f32, threads=2, n_ctx=N_CTX, n_seq=0, kv_blocks=20, kv_win_blocks=12)
    held: list[int] = []
    want, gen = _run(one, case.prompt, CUTS, N_DECODE)
    got, gen2 = _run(two, case.prompt, CUTS, N_DECODE, held)
    np.testing.assert_array_equal(got, want)
    assert gen2 == gen
    # the pool was given back as the sequence grew: decode held at most window / 16 + 1
    assert held[-N_DECODE:] and max(held[-N_DECODE:]) <= SPAN // BLOCK_SIZE + 1
    # the prompt in one pass, then the same decode: bit for bit between the pools, within
    # 1e-5 of the chunked prompt
    want1, gen1 = _run(one, case.prompt, [0, N_PROMPT], N_DECODE)
    got1, _ = _run(two, case.prompt, [0, N_PROMPT], N_DECODE)
    np.testing.assert_array_equal(got1, want1)
    assert rel_max(got1[:N_PROMPT], got[:N_PROMPT]) <= 1e-5
    # transformers over the prompt and the generated tokens: its logits at every position
    # and its greedy choice at each generated one
    ids = np.concatenate([case.prompt, np.asarray(gen, np.int32)])
    with torch.no_grad():
        ref = case.ckpt.hf(torch.tensor(ids[None].astype(np.int64))).logits[0]
    ref = ref.float().numpy()
    assert ref.shape == got.shape
    assert rel_max(got, ref) <= 1e-4
    assert rel_max(got1, ref) <= 1e-4
    assert gen == [int(t) for t in np.argmax(ref[N_PROMPT - 1:-1], axis=1)]
    assert gen1 == gen


def test_windowed_blocks_outside_every_window_are_refused_when_read(case: Case) -> None:
    """A table whose entry a window still reaches is -1: refused before any work."""
    from colibri.engine.errors import InputError

    m = Model.load(case.f32, threads=2, n_ctx=N_CTX, n_seq=0, kv_blocks=8, kv_win_blocks=8)
    toks = case.prompt[:40]
    table = np.arange(3, dtype=np.int32)[None]
    m.forward_paged(toks, np.zeros(40, np.int32), np.arange(40, dtype=np.int32), table,
                    win_tables=table.copy())
    win = np.array([[-1, 1, 2]], np.int32)  # position 40's window starts in block 0 or 2
    nxt = np.array([[0, 1, 2]], np.int32)
    lo = 40 - 32 + 1 if case.arch == "gpt_oss" else 32
    if lo // BLOCK_SIZE == 0:
        with pytest.raises(InputError, match="windowed block table entry 0"):
            m.forward_paged(case.prompt[40:41], np.zeros(1, np.int32), np.array([40], np.int32),
                            nxt, win_tables=win)
    else:  # the chunk starts at 32: block 0 is never read again
        m.forward_paged(case.prompt[40:41], np.zeros(1, np.int32), np.array([40], np.int32),
                        nxt, win_tables=win)
    with pytest.raises(InputError, match="win_tables is needed"):
        m.forward_paged(case.prompt[40:41], np.zeros(1, np.int32), np.array([40], np.int32),
                        nxt)


def test_two_sequences_in_one_call_give_what_each_gives_alone(case: Case) -> None:
    """Batch invariance through both pools: two sequences' chunks interleaved in one call,
    each past its window already, give bit for bit their logits alone."""
    m = Model.load(case.f32, threads=2, n_ctx=N_CTX, n_seq=0, kv_blocks=40, kv_win_blocks=30)
    other = np.random.default_rng(9).integers(0, VOCAB_SIZE, 120).astype(np.int32)
    alone = [_run(m, case.prompt, [0, 64, 120], 0)[0], _run(m, other, [0, 64, 120], 0)[0]]
    bm = _manager(m)
    for s in ("a", "b"):
        assert bm.allocate_prompt(s, []) == 0
    for lo, hi in ((0, 64), (64, 120)):
        toks, seqs, poss = [], [], []
        for i in range(lo, hi):  # a, b, a, b, ...
            for k, p in enumerate((case.prompt, other)):
                toks.append(p[i])
                seqs.append(k)
                poss.append(i)
        for s in ("a", "b"):
            bm.release_window(s, lo)
            assert bm.grow(s, hi)
        table = np.asarray([bm.table("a"), bm.table("b")], np.int32)
        win = np.asarray([bm.win_table("a"), bm.win_table("b")], np.int32)
        assert (win[:, :lo // BLOCK_SIZE] < 0).any() or lo == 0
        out = m.forward_paged(np.asarray(toks, np.int32), np.asarray(seqs, np.int32),
                              np.asarray(poss, np.int32), table, win_tables=win)
        seqs_a = np.asarray(seqs)
        np.testing.assert_array_equal(out[seqs_a == 0], alone[0][lo:hi])
        np.testing.assert_array_equal(out[seqs_a == 1], alone[1][lo:hi])


# -- the step engine ----------------------------------------------------------------------

def _llm(case: Case, **cfg: Any) -> Any:
    from colibri.engine import LLM, EngineConfig

    return LLM(case.hf_dir, threads=2, quant="f32", n_ctx=N_CTX, config=EngineConfig(**cfg))


def _params(**kw: Any) -> Any:
    from colibri.engine import SamplingParams

    base = dict(max_tokens=N_DECODE, temperature=0.0, ignore_eos=True)
    base.update(kw)
    return SamplingParams(**base)


def _watch(core: Any) -> list[int]:
    """Checks after every step that each running request holds at most the windowed blocks
    its windows reach (plus the tokens it just computed); returns the pool's use per step."""
    last: dict[str, int] = {}
    use: list[int] = []

    def on_step(n_seq: int, n_tok: int) -> None:
        b = core.blocks
        for r in core.scheduler.running:
            n = r.num_computed - last.get(r.rid, r.n_cached)
            last[r.rid] = r.num_computed
            assert b.win_held(r.rid) <= _bound(max(n, 1)), (r.rid, n, b.win_table(r.rid))
        use.append(b.n_win_blocks - b.n_win_free)

    core.on_step = on_step
    return use


def _all_free(core: Any) -> None:
    b = core.blocks
    assert b.n_free == b.n_blocks and b.n_win_free == b.n_win_blocks and not b.tables


def test_engine_tokens_with_and_without_the_pool_and_transformers(engine_case: Case) -> None:
    case = engine_case
    prompt = [int(t) for t in case.prompt]
    off = _llm(case, kv_window_pool=False, max_num_batched_tokens=48)
    on = _llm(case, max_num_batched_tokens=48)
    assert off.core.blocks.n_win_blocks == 0 and on.core.blocks.n_win_blocks > 0
    use = _watch(on.core)
    want = off.generate_batch([prompt], _params())[0]
    got = on.generate_batch([prompt], _params())[0]
    assert got == want
    assert max(use) <= _bound(48)
    _all_free(on.core)
    ref = case.ckpt.hf.generate(torch.tensor([prompt]), max_new_tokens=N_DECODE,
                                do_sample=False, min_new_tokens=N_DECODE)
    assert got == ref[0, N_PROMPT:].tolist()
    # the whole pool costs less than one pool of every layer for as many tokens
    kv_on, kv_off = on.core.model.kv, off.core.model.kv
    assert kv_on.n_blocks == kv_off.n_blocks
    assert (kv_on.n_blocks * kv_on.block_bytes + kv_on.n_win_blocks * kv_on.win_block_bytes
            < kv_off.n_blocks * kv_off.block_bytes)


def test_batches_preemption_forks_and_prefix_hits_give_the_tokens_alone(engine_case: Case) -> None:
    case = engine_case
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(0, VOCAB_SIZE, n)] for n in (90, 37, 120, 64, 5)]
    prompts.append(prompts[2][:100] + prompts[0][:20])  # a cached prefix of 6 blocks
    params = [_params(max_tokens=40, temperature=0.9, seed=5 + i) for i in range(len(prompts))]
    probe = _llm(case, max_num_seqs=1, kv_window_pool=False)  # alone, on one pool
    alone = [probe.generate_batch([p], q)[0] for p, q in zip(prompts, params, strict=True)]
    # a full pool of 24 blocks for six requests of up to 160 positions (10 blocks each), and
    # the windowed pool's size for four seats of 32-token steps: 4 * (2 + 3) + 2 blocks
    full, win = kv_split_block_bytes(probe.core.model.config, "f32") or (0, 0)
    block_mb, win_mb = full / (1024 * 1024), win / (1024 * 1024)
    n_win = 4 * (SPAN // BLOCK_SIZE + 3) + 2
    llm = _llm(case, max_num_seqs=4, max_num_batched_tokens=32,
               kv_cache_mb=24 * block_mb + n_win * win_mb + min(block_mb, win_mb) / 2)
    core = llm.core
    assert (core.blocks.n_blocks, core.blocks.n_win_blocks) == (24, n_win)
    _watch(core)
    together = llm.generate_batch(prompts, params)
    assert core.scheduler.n_preemptions > 0
    assert together == alone
    _all_free(core)
    # the same long prompt again while the first holds its blocks: its prefix is found
    # (full blocks, and the windowed ones its first query reads, still held)
    core.add_request("a", prompts[2], params[2])
    outs: dict[str, list[int]] = {"a": [], "b": []}
    cached: dict[str, int] = {}
    n_steps = 0
    while core.has_work():
        for o in core.step():
            outs[o.request_id].append(o.token_id)
            cached[o.request_id] = o.n_cached_tokens
        n_steps += 1
        if n_steps == 6:  # "a" decodes past its prompt, giving back windowed blocks
            core.add_request("b", prompts[2], params[2])
    assert cached["b"] > 0 and outs["a"] == outs["b"] == alone[2]
    _all_free(core)
    # n > 1: the other choices fork from choice 0's prompt
    choices = [_params(max_tokens=20, temperature=1.0, seed=11 + i) for i in range(3)]
    core.add_request("nn", prompts[0], choices)
    got: dict[int, list[int]] = {0: [], 1: [], 2: []}
    while core.has_work():
        for o in core.step():
            got[o.index].append(o.token_id)
    for i, p in enumerate(choices):
        assert got[i] == probe.generate_batch([prompts[0]], p)[0]
    _all_free(core)


def test_preemption_when_the_windowed_pool_runs_short(case: Case) -> None:
    """A windowed pool of 6 blocks, room for two decoding requests' windows at most: the
    others are preempted though the full pool has room, and recomputed with their own
    tokens."""
    from colibri.engine.core.engine import EngineCore
    from colibri.engine.core.scheduler import SchedulerConfig

    probe = _llm(case, max_num_seqs=1, kv_window_pool=False)
    rng = np.random.default_rng(2)
    prompts = [[int(t) for t in rng.integers(0, VOCAB_SIZE, n)] for n in (70, 40, 100, 55)]
    params = [_params(max_tokens=30, temperature=0.9, seed=21 + i) for i in range(4)]
    alone = [probe.generate_batch([p], q)[0] for p, q in zip(prompts, params, strict=True)]
    m = Model.load(probe.core.model_path, threads=2, n_ctx=N_CTX, n_seq=0, kv_blocks=64,
                   kv_win_blocks=6)
    core = EngineCore(m, probe.tokenizer, SchedulerConfig(max_num_seqs=4,
                                                          max_num_batched_tokens=32), 64)
    _watch(core)
    for i, (p, q) in enumerate(zip(prompts, params, strict=True)):
        core.add_request(f"r{i}", p, q)
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(4)}
    while core.has_work():
        for o in core.step():
            got[o.request_id].append(o.token_id)
            assert core.blocks.n_free > 0  # the full pool never ran short
    assert core.scheduler.n_preemptions > 0
    assert [got[f"r{i}"] for i in range(4)] == alone
    _all_free(core)


def test_speculative_decoding_rolls_back_windowed_blocks(case: Case) -> None:
    """n-gram drafts on a repetitive prompt: rejected drafts' blocks go back in both pools and
    the tokens are those of plain decoding on one pool."""
    prompt = [int(t) for t in np.tile(case.prompt[:12], 9)]
    off = _llm(case, kv_window_pool=False)
    spec = _llm(case, speculative="ngram", num_speculative_tokens=4,
                max_num_batched_tokens=32)
    want = off.generate_batch([prompt], _params(max_tokens=48))[0]
    _watch(spec.core)
    assert spec.generate_batch([prompt], _params(max_tokens=48))[0] == want
    stats = spec.core.spec_stats.as_dict()
    assert stats["spec_draft_tokens"] > stats["spec_accepted_tokens"] > 0  # some rolled back
    _all_free(spec.core)

"""Paged KV cache: block tables, shared prefixes, batch invariance, KV types, refusals.

References: transformers' logits for the same prompts (the paged layout must not change the
math), the contiguous layout for bit-for-bit checks at f32, and each sequence computed alone
for batch invariance. f16 and q8 KV are compared with f32 KV under named tolerances.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AttentionInterface  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, eager_mask  # noqa: E402

from colibri.engine import _core  # noqa: E402
from colibri.engine.errors import ContextOverflowError, InputError  # noqa: E402
from colibri.engine.executor.model import Model, kv_block_bytes, slot_kv_blocks  # noqa: E402
from colibri.engine.executor.step_inputs import StepInputs  # noqa: E402
from tests.tiny_models import VOCAB_SIZE, TinyCheckpoints  # noqa: E402

N_CTX = 96
THREADS = 2
BLK = _core.KV_BLOCK
# against transformers with the same KV rounding: max|diff| / max|ref|, as f32 parity
KV_REF_TOL = 1e-4
# against f32 KV, per position max|diff| / max|f32-KV logits| over a 70-position prompt
# (measured on these models: f16 <= 3.6e-4, q8 <= 6.7e-3). q8 may flip a top-k expert choice
# at a near tie, which moves that position's logits far more (transformers with the same
# rounding flips it too), so q8's bound holds for 95% of positions.
F16_KV_TOL = 1e-3
Q8_KV_TOL = 1e-2

MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral-hd16": ("mixtral", {}),
    # head_dim 6, 3 kv heads: rows that fill no SIMD register and q8 scales after 18 bytes
    "mixtral-hd6": ("mixtral", {"head_dim": 6, "num_attention_heads": 6,
                                "num_key_value_heads": 3}),
    "qwen2_moe-hd4": ("qwen2_moe", {"num_attention_heads": 16, "num_key_value_heads": 4}),
}


@pytest.fixture(scope="module", params=list(MODELS))
def model_dir(request: pytest.FixtureRequest, checkpoints: TinyCheckpoints) -> tuple[Path, Any]:
    arch, over = MODELS[request.param]
    ckpt = checkpoints.get(arch, seed=11, **over)
    return ckpt.converted("f32"), ckpt.hf


def _hf_logits(hf: Any, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor(ids[None].astype(np.int64))).logits[0].float().numpy()


def _round_kv(x: torch.Tensor, kv_type: str) -> torch.Tensor:
    """K or V [B, Hkv, T, hd] as the cache stores it, back in f32."""
    if kv_type == "f16":
        return x.to(torch.float16).to(torch.float32)
    d = x.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return torch.clamp(torch.round(x * inv), -127, 127) * d  # round half to even, as C


def _rounded_kv_attention(kv_type: str) -> Any:
    def attend(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               mask: Any, **kw: Any) -> Any:
        eager = sys.modules[type(module).__module__].eager_attention_forward
        return eager(module, query, _round_kv(key, kv_type), _round_kv(value, kv_type), mask,
                     **kw)
    return attend


for _t in ("f16", "q8"):
    AttentionInterface.register(f"colibri_test_{_t}_kv", _rounded_kv_attention(_t))
    AttentionMaskInterface.register(f"colibri_test_{_t}_kv", eager_mask)


def _rel_max(x: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(x - ref)) / np.max(np.abs(ref)))


def _load(path: Path, kv_type: str = "f32", kv_blocks: int = 64, threads: int = THREADS
          ) -> Model:
    return Model.load(path, threads=threads, n_ctx=N_CTX, n_seq=0, kv_type=kv_type,
                      kv_blocks=kv_blocks)


def _prompt(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB_SIZE, n).astype(np.int32)


def _run(m: Model, table: list[list[int]], seqs: list[tuple[np.ndarray, int]],
         max_blocks: int = 8) -> list[np.ndarray]:
    """One call: sequence s computes tokens seqs[s][0] from position seqs[s][1]; tokens of the
    sequences are interleaved round-robin. Returns each sequence's logits."""
    bt = np.full((len(table), max_blocks), -1, np.int32)
    for s, row in enumerate(table):
        bt[s, :len(row)] = row
    order = []
    for i in range(max(ids.size for ids, _ in seqs)):
        order += [(s, i) for s, (ids, _) in enumerate(seqs) if i < ids.size]
    tok = np.array([seqs[s][0][i] for s, i in order], np.int32)
    sid = np.array([s for s, _ in order], np.int32)
    pos = np.array([seqs[s][1] + i for s, i in order], np.int32)
    out = m.forward_paged(tok, sid, pos, bt)
    return [out[sid == s] for s in range(len(seqs))]


def test_scrambled_blocks_equal_contiguous(model_dir: tuple[Path, Any]) -> None:
    path, hf = model_dir
    ids = _prompt(1, 70)
    ref = _hf_logits(hf, ids)
    outs = []
    for table in ([0, 1, 2, 3, 4], [37, 3, 50, 8, 21]):
        m = _load(path)
        # prefill in two calls that split a block, then three one-token decode steps
        a = _run(m, [table], [(ids[:21], 0)])[0]
        b = _run(m, [table], [(ids[21:67], 21)])[0]
        steps = [_run(m, [table], [(ids[p:p + 1], p)])[0] for p in (67, 68, 69)]
        outs.append(np.concatenate([a, b] + steps))
    np.testing.assert_array_equal(outs[1], outs[0])
    assert _rel_max(outs[0], ref) <= 1e-4


def test_shared_prefix_blocks(model_dir: tuple[Path, Any]) -> None:
    """B reads A's two full blocks and computes only its suffix, while A decodes."""
    path, _ = model_dir
    a_ids = _prompt(2, 40)
    b_ids = np.concatenate([a_ids[:32], _prompt(3, 13)])
    m = _load(path)
    ta, tb = [9, 4, 30], [9, 4, 17, 12]
    a_pre = _run(m, [ta], [(a_ids[:39], 0)])[0]
    a_step, b_suffix = _run(m, [ta, tb], [(a_ids[39:], 39), (b_ids[32:], 32)])
    alone = _load(path)
    np.testing.assert_array_equal(_run(alone, [[0, 1, 2, 3]], [(b_ids, 0)])[0][32:], b_suffix)
    alone = _load(path)
    np.testing.assert_array_equal(_run(alone, [[5, 6, 7]], [(a_ids, 0)])[0],
                                  np.concatenate([a_pre, a_step]))


@pytest.mark.parametrize("kv_type", ["f32", "f16", "q8"])
def test_batch_invariance(model_dir: tuple[Path, Any], kv_type: str) -> None:
    """Five sequences of different lengths in one call (then one joint decode step) give,
    bit for bit, what each gives alone, also with another thread count (3 workers and one
    token split attention by query head instead of by kv head group)."""
    path, _ = model_dir
    lens = [5, 33, 16, 1, 47]
    prompts = [_prompt(10 + i, n + 1) for i, n in enumerate(lens)]
    tables = [[3 * i + 1, 3 * i, 3 * i + 2, 40 + i] for i in range(len(lens))]
    m = _load(path, kv_type)
    joint = _run(m, tables, [(p[:-1], 0) for p in prompts])
    step = _run(m, tables, [(p[-1:], p.size - 1) for p in prompts])
    for i, p in enumerate(prompts):
        alone = _load(path, kv_type, threads=3)
        t = [[7, 2, 5, 11]]
        np.testing.assert_array_equal(_run(alone, t, [(p[:-1], 0)])[0], joint[i])
        np.testing.assert_array_equal(_run(alone, t, [(p[-1:], p.size - 1)])[0], step[i])


@pytest.mark.parametrize("kv_type,tol,share", [("f16", F16_KV_TOL, 1.0),
                                               ("q8", Q8_KV_TOL, 0.95)])
def test_kv_type_against_references(model_dir: tuple[Path, Any], kv_type: str, tol: float,
                                    share: float, isa: str) -> None:
    path, _ = model_dir
    ids = _prompt(4, 70)
    table = [[6, 0, 3, 1, 9]]
    f32 = _run(_load(path, "f32"), table, [(ids, 0)])[0]
    got = _run(_load(path, kv_type), table, [(ids, 0)])[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent / "hf"), dtype=torch.float32,
        attn_implementation=f"colibri_test_{kv_type}_kv").eval()
    ref = _hf_logits(hf, ids)
    err_ref = _rel_max(got, ref)
    per_pos = np.abs(got - f32).max(axis=1) / np.abs(f32).max()
    print(f"{path.parent.name}/{isa} {kv_type} KV: vs transformers with {kv_type} KV "
          f"{err_ref:.2e}; vs f32 KV max {per_pos.max():.2e}, median {np.median(per_pos):.2e}")
    assert err_ref <= KV_REF_TOL
    assert np.mean(per_pos <= tol) >= share
    assert not np.array_equal(got, f32)  # the type really changed the stored rows


def test_refused_calls_change_nothing(model_dir: tuple[Path, Any]) -> None:
    path, _ = model_dir
    m = _load(path, kv_blocks=12)
    ids = _prompt(5, 20)
    table = np.full((2, 4), -1, np.int32)
    table[0, :2] = [5, 2]
    _run(m, [[5, 2]], [(ids, 0)], max_blocks=4)
    probe_tok, probe_pos = ids[-1:], np.array([19], np.int32)
    z = np.zeros(1, np.int32)
    before = m.forward_paged(probe_tok, z, probe_pos, table)

    # each refused call first rewrites positions 3..5 of sequence 0 with other tokens
    w_tok, w_seq, w_pos = np.array([7, 8, 9], np.int32), np.zeros(3, np.int32), np.arange(3, 6)

    def call(tok: list[int], seq: list[int], pos: list[int], tab: np.ndarray) -> np.ndarray:
        return m.forward_paged(np.concatenate([w_tok, np.array(tok, np.int32)]),
                               np.concatenate([w_seq, np.array(seq, np.int32)]),
                               np.concatenate([w_pos, np.array(pos, np.int32)]), tab)

    def with_row1(*row: int) -> np.ndarray:
        t = table.copy()
        t[1, :len(row)] = row
        return t

    cases: list[tuple[Any, Any, str]] = [
        (lambda: call([1], [1], [0], table), InputError, "entry 0 .* is -1"),      # missing
        (lambda: call([1], [1], [17], with_row1(0)), InputError, "entry 1"),       # missing
        (lambda: call([1], [1], [0], with_row1(12)), InputError, "not a block"),   # range
        (lambda: call([1], [1], [0], with_row1(-7)), InputError, "not a block"),
        (lambda: call([1], [1], [0], with_row1(5)), InputError, "written by sequences 0 and 1"),
        (lambda: call([1, 1], [1, 1], [15, 16], with_row1(0, 0)), InputError,
         "block 0 is at table entries 0 and 1"),
        (lambda: call([1], [0], [7], table), InputError, "consecutive"),
        (lambda: call([1], [0], [5], table), InputError, "consecutive"),
        (lambda: call([1], [2], [0], table), InputError, "sequence id 2"),
        (lambda: call([1], [1], [64], with_row1(0)), InputError, "entry 4"),
        (lambda: call([1], [1], [N_CTX], with_row1(0)), ContextOverflowError, "n_ctx"),
        (lambda: call([1], [1], [-1], with_row1(0)), InputError, "negative"),
        (lambda: call([VOCAB_SIZE], [1], [0], with_row1(0)), InputError, "token"),
        (lambda: call([1], [0], [6], table.astype(np.int64)), InputError, "int32"),
        (lambda: call([1], [0], [6], table.ravel()), InputError, "2-D"),
        (lambda: call([1], [0], [6], np.asfortranarray(np.tile(table, (1, 2)))[:, ::2]),
         InputError, "contiguous"),
        (lambda: call([1], [0], [6], table.tolist()), InputError, "numpy"),
        (lambda: call([1], [0], [6], np.zeros((0, 4), np.int32)), InputError, "at least"),
        (lambda: call([1], [0], [6], np.zeros((13, 4), np.int32)), InputError, "n_seq"),
        (lambda: m.forward_paged(w_tok, w_seq, w_pos, table, np.ones(3, np.float32)),
         InputError, "want_logits"),
        (lambda: m.forward_paged(w_tok, w_seq, w_pos, table, np.ones(2, bool)),
         InputError, "want_logits"),
        (lambda: m.forward_paged(w_tok, w_seq[:2], w_pos, table), InputError, "differ"),
        (lambda: m.forward_paged(w_tok, w_seq, w_pos.astype(float), table), InputError,
         "integers"),
    ]
    for fn, exc, words in cases:
        with pytest.raises(exc, match=words):
            fn()
    np.testing.assert_array_equal(m.forward_paged(probe_tok, z, probe_pos, table), before)
    # and the same overwrite, accepted, does change what position 19 sees
    call([], [], [], table)
    assert not np.array_equal(m.forward_paged(probe_tok, z, probe_pos, table), before)


def test_slot_api_and_sizes(model_dir: tuple[Path, Any]) -> None:
    """forward/reset/seq_len over fixed slots agree with forward_paged; block sizes."""
    path, hf = model_dir
    m = Model.load(path, threads=THREADS, n_ctx=N_CTX, n_seq=2, kv_type="q8")
    nb = -(-N_CTX // BLK)
    assert m.n_kv_blocks == 2 * nb and m.kv_type == "q8"
    ids = _prompt(6, 30)
    got = m.forward(ids, np.ones(30, np.int32), np.arange(30, dtype=np.int32))
    assert m.seq_len(1) == 30 and m.seq_len(0) == 0
    paged = _load(path, "q8")
    np.testing.assert_array_equal(_run(paged, [[0, 1]], [(ids, 0)])[0], got)
    m.reset(1)
    assert m.seq_len(1) == 0

    cfg = m.config
    hd, hkv, n_layer = cfg.head_dim, cfg.n_head_kv, cfg.n_layer
    kvd = hd * hkv
    rows = 2 * BLK * n_layer
    hp = cfg.to_hparams(N_CTX)
    # q8: each kv head's int8 values padded to 4 bytes, then its f32 scale
    expect = {"f32": rows * kvd * 4, "f16": rows * kvd * 2,
              "q8": rows * hkv * (-(-hd // 4) * 4 + 4)}
    for t, n in expect.items():
        assert m.kv_block_bytes(t) == n == _core.kv_block_bytes(hp, t) == kv_block_bytes(cfg, t)
    assert m.kv_block_bytes() == expect["q8"]
    with pytest.raises(ValueError, match="KV cache type"):
        m.kv_block_bytes("q4")
    with pytest.raises(ValueError, match="cannot hold"):
        Model.load(path, threads=1, n_ctx=N_CTX, n_seq=2, kv_blocks=2 * nb - 1)
    # the one count every backend's load takes: just enough slots, at least one block
    assert slot_kv_blocks(2, N_CTX, None) == 2 * nb and slot_kv_blocks(0, N_CTX, None) == 1
    assert slot_kv_blocks(2, N_CTX, 2 * nb + 3) == 2 * nb + 3
    with pytest.raises(ValueError, match=f"kv_blocks 1 cannot hold 1 sequence slots of "
                                         f"{N_CTX} positions \\({nb} blocks\\)"):
        slot_kv_blocks(1, N_CTX, 1)
    with pytest.raises(ValueError, match="KV cache type"):
        Model.load(path, threads=1, n_ctx=N_CTX, kv_type="bf16")
    with pytest.raises(ValueError, match="n_blocks"):
        _core.KVCache(m.core, 0, "f32")


def test_step_inputs_reach_the_core(model_dir: tuple[Path, Any]) -> None:
    """A step's optional inputs arrive alike as one StepInputs or by name, and only those set
    are handed on."""
    path, _ = model_dir
    m = _load(path)
    cfg = m.config
    ids = _prompt(7, 20)
    bt = np.array([[0, 1]], np.int32)
    seq, pos = np.zeros(20, np.int32), np.arange(20, dtype=np.int32)
    shape = (20, cfg.n_layer, cfg.n_expert_used)
    by_object, by_name = np.full(shape, -7, np.int32), np.full(shape, -7, np.int32)
    a = m.forward_paged(ids, seq, pos, bt, None, StepInputs(routes=by_object))
    b = m.forward_paged(ids, seq, pos, bt, routes=by_name)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(by_object, by_name)
    assert by_object.min() >= 0 and by_object.max() < cfg.n_expert  # written by the core
    # a name given beside the object wins over the object's field
    unused = np.full(shape, -7, np.int32)
    m.forward_paged(ids, seq, pos, bt, inputs=StepInputs(routes=unused), routes=by_name)
    assert (unused == -7).all()
    assert list(StepInputs(routes=by_name, hidden_normed=False).given()) == ["routes"]
    assert StepInputs().given() == {}
    with pytest.raises(TypeError, match="route"):
        m.forward_paged(ids, seq, pos, bt, route=by_name)

"""The single-sequence C API (colibri_init / colibri_forward / colibri_reset / colibri_free),
called through ctypes on the built extension, against the Python Model over the same files."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

from colibri.engine import _core
from colibri.engine.executor.model import Model
from colibri.engine.models.config import ModelConfig

N_CTX = 80


class _HParams(ctypes.Structure):
    """clb_hparams, field for field (csrc/clb_model.h)."""

    _fields_ = ([(k, ctypes.c_int64) for k in ("n_vocab", "n_embd", "n_layer", "n_head",
                                               "n_head_kv", "head_dim")]
                + [("attn", ctypes.c_int32)]
                + [(k, ctypes.c_int64) for k in ("q_lora_rank", "kv_lora_rank", "v_head_dim")]
                + [("attn_scale", ctypes.c_float)]
                + [(k, ctypes.c_int64) for k in ("n_ff", "n_expert", "n_expert_used",
                                                 "n_ff_shared", "n_ff_dense")]
                + [(k, ctypes.c_int32) for k in ("shared_gate", "norm_topk_prob", "router")]
                + [("n_group", ctypes.c_int64), ("topk_group", ctypes.c_int64),
                   ("routed_scale", ctypes.c_float)]
                + [(k, ctypes.c_int32) for k in ("qk_norm", "qkv_bias", "o_bias",
                                                 "tie_embeddings")]
                + [("clip_qkv", ctypes.c_float), ("rope_theta", ctypes.c_float),
                   ("rotary_dim", ctypes.c_int64), ("rope_scale", ctypes.c_float),
                   ("rms_eps", ctypes.c_float), ("sliding_window", ctypes.c_int64)]
                + [("attn_sinks", ctypes.c_int32), ("attn_chunk", ctypes.c_int64),
                   ("attn_temp_floor", ctypes.c_float), ("attn_temp_scale", ctypes.c_float)]
                + [(k, ctypes.c_int32) for k in ("route_input", "router_bias", "expert_bias",
                                                 "glu")]
                + [("glu_alpha", ctypes.c_float), ("glu_limit", ctypes.c_float),
                   ("attn_gate", ctypes.c_int32)]
                + [(k, ctypes.c_int64) for k in ("lin_n_k_heads", "lin_n_v_heads", "lin_k_dim",
                                                 "lin_v_dim", "lin_conv")]
                + [("n_ctx", ctypes.c_int64), ("rope_freqs", ctypes.POINTER(ctypes.c_float)),
                   ("layer_ffn", ctypes.POINTER(ctypes.c_int32)),
                   ("layer_attn", ctypes.POINTER(ctypes.c_int32)),
                   ("layer_mixer", ctypes.POINTER(ctypes.c_int32)),
                   ("mtp_input", ctypes.c_int32), ("mtp_keep_first", ctypes.c_int32)])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from colibri.engine.format.convert import convert
    from tests.tiny_models import make_checkpoint

    root = tmp_path_factory.mktemp("capi")
    hf = make_checkpoint("qwen3_moe", root / "hf", seed=5)
    return convert(hf, root / "f32", quant="f32", progress=False)


def test_colibri_wrappers_match_model(model_dir: Path) -> None:
    lib = ctypes.CDLL(_core.__file__)
    lib.colibri_init.restype = ctypes.c_void_p
    lib.colibri_init.argtypes = [ctypes.c_char_p, ctypes.POINTER(_HParams), ctypes.c_int,
                                 ctypes.c_char_p]
    lib.colibri_forward.restype = ctypes.c_int
    lib.colibri_forward.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                    ctypes.c_void_p, ctypes.c_char_p]
    lib.colibri_reset.argtypes = [ctypes.c_void_p]
    lib.colibri_free.argtypes = [ctypes.c_void_p]

    fields = ModelConfig.from_dir(model_dir).to_hparams(N_CTX)
    # every field set (ctypes would take an unknown name as a plain attribute, silently)
    assert set(fields) == {name for name, _ in _HParams._fields_}
    for k in ("rope_freqs", "layer_ffn", "layer_attn", "layer_mixer"):  # NULL: C defaults
        assert fields.pop(k) is None
    hp = _HParams(**fields)
    err = ctypes.create_string_buffer(512)
    cm = lib.colibri_init(str(model_dir).encode(), ctypes.byref(hp), 1, err)
    assert cm, err.value
    m = Model.load(model_dir, threads=1, n_ctx=N_CTX)
    ids = np.random.default_rng(3).integers(0, m.n_vocab, 71).astype(np.int32)
    logits = np.full(m.n_vocab, np.nan, np.float32)
    try:
        def step(part: np.ndarray) -> np.ndarray:
            st = lib.colibri_forward(cm, part.ctypes.data, part.size, logits.ctypes.data, err)
            assert st == 0, err.value
            return logits.copy()

        ref = m.forward(ids, np.zeros(71, np.int32), np.arange(71, dtype=np.int32))
        # 70 tokens (more than one internal step of the wrapper), then one more
        np.testing.assert_array_equal(step(ids[:70]), ref[69])
        np.testing.assert_array_equal(step(ids[70:]), ref[70])
        # past n_ctx: refused with CLB_E_RANGE
        assert lib.colibri_forward(cm, ids.ctypes.data, 10, logits.ctypes.data, err) == -6
        assert b"exceed n_ctx" in err.value
        lib.colibri_reset(cm)
        np.testing.assert_array_equal(step(ids[:5]), ref[4])
    finally:
        lib.colibri_free(cm)


def test_reference_f16_widening_matches_numpy_on_every_value() -> None:
    """The reference's branch-free f16 -> f32 (clb_to_float_f16_ref, attention's f16 KV rows
    on a CPU without AVX2) equals numpy's conversion for all 65536 bit patterns (NaN payloads
    included)."""
    lib = ctypes.CDLL(_core.__file__)
    lib.clb_to_float_f16_ref.restype = None
    lib.clb_to_float_f16_ref.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    out = np.full(65536, np.nan, np.float32)
    lib.clb_to_float_f16_ref(bits.size, bits.ctypes.data, out.ctypes.data)
    np.testing.assert_array_equal(out.view(np.uint32), bits.view(np.float16).astype(np.float32)
                                  .view(np.uint32))

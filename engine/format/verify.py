"""`colibri verify` and load-time checks: a converted folder still is what was converted.

Guarantees: names in config.json's `files` never lead outside the folder (absolute paths,
`..` and symlinks out are refused before anything is opened); the hyper-parameters recorded
at conversion must equal config.json's; every weight file's tensors must agree with
config.json's shapes (C loader) and `tensor_types`; the tokenizer must load; with `full`, every
weight must be finite. Refuses: repairing anything: it reports, one line per problem.
"""

from __future__ import annotations

import math
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from colibri.engine.errors import FormatError

# The config.json keys that shape the computation; the converter records their values under
# "converted_hparams" so an edited config.json no longer passes for the weights it describes.
HPARAM_KEYS = (
    "architecture", "n_vocab", "n_embd", "n_layer", "n_head", "n_head_kv", "head_dim", "n_ff",
    "n_expert", "n_expert_used", "n_ff_shared", "shared_gate", "norm_topk_prob", "qk_norm",
    "qkv_bias", "clip_qkv", "rope_theta", "rotary_dim", "rms_eps", "sliding_window",
    "tie_embeddings", "max_position_embeddings", "bos_token_id", "eos_token_ids",
    "n_ff_dense", "layer_ffn", "router", "n_group", "topk_group", "routed_scale", "o_bias", "rope",
    "attn", "q_lora_rank", "kv_lora_rank", "v_head_dim", "attn_scale",
    "layer_attn", "attn_sinks", "router_bias", "expert_bias", "glu", "glu_alpha", "glu_limit",
    "attn_chunk", "nope_layers", "attn_temp_floor", "attn_temp_scale", "route_input",
)


def converted_hparams(config: dict[str, Any]) -> dict[str, Any]:
    """The values of HPARAM_KEYS in a config.json dict (absent keys are left out)."""
    return {k: config[k] for k in HPARAM_KEYS if k in config}


def check_finite(a: np.ndarray, what: str) -> None:
    """FormatError when a (a source tensor at conversion) holds NaN or inf."""
    if a.dtype.kind == "f" and not math.isfinite(float(np.sum(a, dtype=np.float64))):
        if not np.isfinite(a).all():
            n = int(a.size - np.count_nonzero(np.isfinite(a)))
            raise FormatError(f"{what}: {n} non-finite values (NaN or inf); refusing to convert")


def member(model_dir: Path, name: Any) -> Path | None:
    """model_dir / name if name is a plain relative path that stays inside model_dir."""
    if not isinstance(name, str) or not name or "\\" in name or "\0" in name:
        return None
    pure = PurePosixPath(name)
    if pure.is_absolute() or ".." in pure.parts:
        return None
    path = model_dir / pure
    try:
        path.resolve().relative_to(model_dir.resolve())
    except ValueError:  # a symlink out of the folder
        return None
    return path


def _group(file: str) -> str:
    """The tensor_types key prefix of a file (its folder, or its stem at top level)."""
    return file.split("/")[0] if "/" in file else file.rsplit(".", 1)[0]


def tensor_type_problems(model_dir: Path, tensor_types: dict[str, str],
                         files: list[str]) -> list[str]:
    """Tensors whose dtype in the file differs from config.json's tensor_types."""
    from colibri.engine import _core

    problems = []
    for file in files:
        if not file.endswith(".bin"):
            continue
        for t in _core.inspect_weight_file(model_dir / file):
            want = tensor_types.get(f"{_group(file)}.{t['name']}")
            if want is not None and want != t["dtype"]:
                problems.append(f"{file}: tensor '{t['name']}' is {t['dtype']}, config.json's "
                                f"tensor_types says {want}")
    return problems


def check_tensor_types(model_dir: Path, tensor_types: dict[str, str]) -> None:
    """FormatError when a loaded model's files disagree with tensor_types (at start)."""
    files = sorted(str(p.relative_to(model_dir)) for p in model_dir.rglob("*.bin"))
    problems = tensor_type_problems(model_dir, tensor_types, files)
    if problems:
        raise FormatError(f"{model_dir}: " + "; ".join(problems[:5]))


def _non_finite(path: Path) -> list[str]:
    from colibri.engine.format.wfile import read_wfile

    wf = read_wfile(path)
    bad = []
    for name in wf.tensors:
        a = wf.array(name)
        if not np.isfinite(a).all():
            bad.append(name)
    return bad


def verify_problems(model_dir: Path, raw: dict[str, Any], full: bool) -> list[str]:
    """Everything wrong with a converted folder whose config.json is raw; [] when sound."""
    from colibri.engine import _core
    from colibri.engine.models.config import ModelConfig
    from colibri.engine.text.tokenizer import Tokenizer

    problems: list[str] = []
    try:
        cfg = ModelConfig.from_dict(raw, source=str(model_dir / "config.json"))
    except FormatError as e:
        return [str(e)]
    recorded = raw.get("converted_hparams")
    if isinstance(recorded, dict):
        now = converted_hparams(raw)
        changed = sorted(k for k in set(recorded) | set(now) if recorded.get(k) != now.get(k))
        if changed:
            problems.append("config.json: changed since conversion: " + ", ".join(
                f"{k} {recorded.get(k)!r} -> {now.get(k)!r}" for k in changed))
    bins = [n for n in cfg.files if isinstance(n, str) and n.endswith(".bin")]
    try:
        core = _core.CoreModel.load(str(model_dir), cfg.to_hparams(16), 1)
        del core
    except (FormatError, OSError) as e:
        problems.append(f"weights do not match config.json: {e}")
    else:
        problems += tensor_type_problems(model_dir, cfg.tensor_types, bins)
        if full:
            for file in bins:
                bad = _non_finite(model_dir / file)
                if bad:
                    problems.append(f"{file}: non-finite values (NaN or inf) in " +
                                    ", ".join(bad[:4]))
    if not (model_dir / "tokenizer.json").is_file():
        problems.append("tokenizer.json: missing")
    else:
        try:
            tok = Tokenizer.from_dir(model_dir)
        except Exception as e:  # noqa: BLE001 - any failure to load is the problem reported
            problems.append(f"tokenizer: does not load ({type(e).__name__}: {e})")
        else:
            if int(tok.vocab_size) > cfg.n_vocab:
                problems.append(f"tokenizer: {tok.vocab_size} tokens, the model has "
                                f"{cfg.n_vocab}")
    return problems

"""Hugging Face safetensors checkpoint -> Colibri model folder (docs/INTERNALS.md).

Guarantees: every source tensor's presence and shape is checked before anything is
written; output goes to a hidden sibling folder that is renamed into place only when all
files, config.json (with each file's size and sha256) and the tokenizer files are written,
so an interrupted conversion never leaves a folder that looks complete. Refuses what
engine.models.archs and engine.format.safetensors_io refuse, and an output folder that
already exists.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import hashlib
import json
import os
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any

from colibri.engine.errors import ModelError
from colibri.engine.format import quant
from colibri.engine.format.jsonfile import read_json_object
from colibri.engine.format.safetensors_io import Checkpoint, CheckpointError
from colibri.engine.format.verify import check_finite, converted_hparams, member, verify_problems
from colibri.engine.format.wfile import TensorSpec, write_wfile
from colibri.engine.models import archs
from colibri.engine.models.family import transform

PRESETS = ("f32", "f16", "q8", "q4")
DEFAULT_QUANT = "q8"  # the one default of every command, of convert() and of engine.LLM
QUANT_PRESETS = PRESETS
# raised whenever a preset's choice of types changes, so conversions made before are redone
# (recorded in config.json; see is_current_conversion)
PRESET_REVISION = 4
# Copied beside the weights. Chat templates live in any of three places (transformers'
# order of precedence: chat_template.jinja and additional_chat_templates/*.jinja, then
# chat_template.json, then tokenizer_config.json); engine.text.tokenizer_files reads them in
# that order.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja", "chat_template.json")
CHAT_TEMPLATE_DIR = "additional_chat_templates"
CONFIG_MAX_BYTES = 16 * 1024 * 1024
MTP_DIR = "mtp"  # the sub-folder holding a model's multi-token-prediction layer


def choose_type(kind: str, shape: tuple[int, ...], preset: str) -> str:
    """The stored type of a tensor of `kind` under a quant preset (see module docs)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown quant preset {preset!r}; choose one of {', '.join(PRESETS)}")
    if kind == archs.MXFP4:  # as the checkpoint ships it: no second rounding
        return "mxfp4"
    if preset == "f32" or kind in (archs.NORM, archs.BIAS, archs.ROUTER):
        return "f32"
    want = preset
    if preset == "q4" and kind == archs.VOCAB:
        # where 4 bits cost quality: on the bundled model's validation text, q4 attention
        # adds 0.10% perplexity to q4 experts' 0.15%, a q4 lm_head another 0.44%
        want = "q6"
    if want in ("q8", "q4", "q6") and shape[-1] % quant.QK:
        return "f16"
    if kind == archs.EXPERT and len(shape) == 2 and shape[0] % 8 == 0:
        # stored in the layout the products read: an expert read from storage into the expert
        # cache is ready as it lands, with no repack on the readers' cores
        return quant.X8_OF[want] if want in quant.X8_OF else want
    return want


def _read_json(path: Path, what: str) -> dict[str, Any]:
    if not path.is_file():
        raise ValueError(f"{path.parent}: no {what} found")
    return read_json_object(path, what, CONFIG_MAX_BYTES)


def is_current_conversion(folder: str | Path, quant: str) -> bool:
    """Whether folder holds a Colibri conversion at quant with the types that preset chooses
    today (False for one an earlier choice made: it still loads and runs)."""
    cfg = Path(folder) / "config.json"
    if not cfg.is_file():
        return False
    try:
        c = _read_json(cfg, "config.json")
    except ValueError:
        return False
    return (c.get("format") == "colibri" and c.get("quant") == quant
            and c.get("preset_revision", 1) == PRESET_REVISION)


def convert_once(hf_dir: str | Path, out_dir: str | Path, quant: str) -> Path:
    """out_dir as a conversion of hf_dir at quant: kept when it is a current one, converted
    again over another Colibri folder (an earlier preset, another quant); a folder there that
    is not a Colibri one is refused as convert() refuses it."""
    out = Path(out_dir)
    if is_current_conversion(out, quant):
        return out
    if is_colibri_dir(out):
        shutil.rmtree(out)
    return convert(hf_dir, out, quant=quant, progress=False)


def is_colibri_dir(path: str | Path) -> bool:
    """True if path holds a Colibri config.json."""
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return False
    try:
        return _read_json(cfg, "config.json").get("format") == "colibri"
    except ValueError:
        return False


def _check_sources(ckpt: Checkpoint, cfg: dict[str, Any], targets: list[archs.Target]) -> None:
    missing = sorted({t.source.hf_name for t in targets if t.source.hf_name not in ckpt})
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(
            f"{ckpt.folder}: tensors missing from the checkpoint: {', '.join(missing[:5])}{more}"
        )
    for t in targets:
        src = t.source
        want = src.src_shape or (archs.fused_shape(cfg, src.hf_name) if src.index is not None
                                 else t.shape)
        have = ckpt.shape(src.hf_name)
        if have != want:
            raise CheckpointError(
                f"{ckpt.folder}: tensor {src.hf_name!r} has shape {list(have)}, "
                f"config.json implies {list(want)}"
            )
        if src.scales is not None:
            if src.scales not in ckpt:
                raise CheckpointError(f"{ckpt.folder}: tensor {src.scales!r} (the scales of "
                                      f"{src.hf_name!r}) is missing from the checkpoint")
            if ckpt.shape(src.scales) != want[:-1]:
                raise CheckpointError(
                    f"{ckpt.folder}: tensor {src.scales!r} has shape "
                    f"{list(ckpt.shape(src.scales))}, its blocks imply {list(want[:-1])}")


def _producer(ckpt: Checkpoint, t: archs.Target, type_name: str):  # noqa: ANN202
    src = t.source
    if src.scales is not None:  # MXFP4 blocks and scales, copied as they are
        def produce_mxfp4() -> bytes:
            blocks = ckpt.get_u8(src.hf_name, src.index)
            scales = ckpt.get_u8(src.scales, src.index)
            if src.transform == "rows":
                blocks = blocks[src.params[0]::src.params[1]]
                scales = scales[src.params[0]::src.params[1]]
            return quant.mxfp4_from_checkpoint(blocks, scales).tobytes()

        return produce_mxfp4

    def produce() -> bytes:
        a = ckpt.get(t.source.hf_name, t.source.index)
        if t.source.rows is not None:
            a = a[t.source.rows[0] : t.source.rows[1]]
        a = transform(a, t.source)
        check_finite(a, f"{t.source.hf_name} (for {t.file}: {t.name})")
        return quant.encode(a, type_name)

    return produce


def convert(hf_dir: str | Path, out_dir: str | Path, quant: str = DEFAULT_QUANT,
            progress: bool = True) -> Path:
    """Convert a Hugging Face checkpoint folder into a Colibri folder at out_dir."""
    preset = quant
    if preset not in PRESETS:
        raise ValueError(f"unknown quant preset {preset!r}; choose one of {', '.join(PRESETS)}")
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    if not hf_dir.is_dir():
        raise ValueError(f"{hf_dir}: not a folder")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ValueError(f"{out_dir}: already exists; remove it or choose another output folder")
    hf_cfg = _read_json(hf_dir / "config.json", "config.json")
    gen_path = hf_dir / "generation_config.json"
    gen = _read_json(gen_path, "generation_config.json") if gen_path.is_file() else {}
    cfg = archs.colibri_config(hf_cfg, gen)

    with Checkpoint(hf_dir, fp8_block=_fp8_block(hf_cfg)) as ckpt:
        targets = archs.plan(cfg, set(ckpt.names()))
        _check_sources(ckpt, cfg, targets)
        if progress:
            for line in describe_plan(cfg, set(ckpt.names()), targets):
                print(line, file=sys.stderr)
        by_file: dict[str, list[archs.Target]] = {}
        for t in targets:
            by_file.setdefault(t.file, []).append(t)

        tensor_types = _tensor_types(targets, preset)
        mtp = archs.mtp_plan(cfg, set(ckpt.names()))
        if mtp is not None:
            _check_sources(ckpt, mtp[0], mtp[1])

        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            bar = _progress(len(by_file), f"converting ({preset})", progress)
            try:
                files = _write_files(ckpt, tmp, by_file, preset, bar)
            finally:
                bar.close()
            config = dict(cfg)
            if mtp is not None:  # the MTP layer: a one-layer model in its own sub-folder
                config["mtp"] = MTP_DIR
                files.update(_write_mtp(ckpt, tmp / MTP_DIR, mtp[0], mtp[1], preset))
            text_files: dict[str, dict[str, Any]] = {}
            for name in TOKENIZER_FILES:
                if (hf_dir / name).is_file():
                    shutil.copyfile(hf_dir / name, tmp / name)
                    # recorded so that verify notices a truncated or edited tokenizer too
                    text_files[name] = {"size": (tmp / name).stat().st_size,
                                        "sha256": _sha256(tmp / name)}
            extra = hf_dir / CHAT_TEMPLATE_DIR
            if extra.is_dir():
                for f in sorted(extra.glob("*.jinja")):
                    if f.is_file():
                        (tmp / CHAT_TEMPLATE_DIR).mkdir(exist_ok=True)
                        shutil.copyfile(f, tmp / CHAT_TEMPLATE_DIR / f.name)
            config["tokenizer_files"] = text_files
            config["converted_hparams"] = converted_hparams(config)
            config["quant"] = preset
            config["preset_revision"] = PRESET_REVISION
            config["tensor_types"] = tensor_types
            config["files"] = files
            _write_atomic(tmp / "config.json", json.dumps(config, indent=2) + "\n")
            _sync_tree(tmp)
            os.rename(tmp, out_dir)
            _fsync_dir(out_dir.parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out_dir


def _tensor_types(targets: list[archs.Target], preset: str) -> dict[str, str]:
    """config.json's tensor_types: the stored type of each tensor name per file group."""
    tensor_types: dict[str, str] = {}
    for t in targets:
        key = f"{t.group}.{t.name}"
        ty = choose_type(t.kind, t.shape, preset)
        if tensor_types.setdefault(key, ty) != ty:
            raise AssertionError(f"{key}: types differ between layers")
    return tensor_types


def _write_files(ckpt: Checkpoint, root: Path, by_file: dict[str, list[archs.Target]],
                 preset: str, bar: Any) -> dict[str, dict[str, Any]]:
    """Every weight file of by_file under root; their sizes and sha256 by relative path."""
    files: dict[str, dict[str, Any]] = {}
    for fname, group in by_file.items():
        path = root / fname
        path.parent.mkdir(parents=True, exist_ok=True)
        specs = [
            TensorSpec(t.name, choose_type(t.kind, t.shape, preset), t.shape,
                       _producer(ckpt, t, choose_type(t.kind, t.shape, preset)))
            for t in group
        ]
        size, digest = write_wfile(path, specs, durable=False)  # the caller syncs the tree
        files[fname] = {"size": size, "sha256": digest}
        bar.update(1)
    return files


def _write_mtp(ckpt: Checkpoint, root: Path, mcfg: dict[str, Any],
               targets: list[archs.Target], preset: str) -> dict[str, dict[str, Any]]:
    """The multi-token-prediction layer as a Colibri folder of one layer at root (its own
    config.json, mtp_input set); returns its files for the main folder's table, paths
    relative to the main folder."""
    by_file: dict[str, list[archs.Target]] = {}
    for t in targets:
        by_file.setdefault(t.file, []).append(t)
    root.mkdir()
    files = _write_files(ckpt, root, by_file, preset, _NoBar())
    config = dict(mcfg, quant=preset, preset_revision=PRESET_REVISION,
                  tensor_types=_tensor_types(targets, preset), files=files)
    config["converted_hparams"] = converted_hparams(config)
    _write_atomic(root / "config.json", json.dumps(config, indent=2) + "\n")
    out = {f"{root.name}/{name}": meta for name, meta in files.items()}
    out[f"{root.name}/config.json"] = {"size": (root / "config.json").stat().st_size,
                                       "sha256": _sha256(root / "config.json")}
    return out


class NotAConversionOf(ValueError):
    """add_mtp given a folder converted from another model (or by another mapping)."""


def add_mtp(hf_dir: str | Path, folder: str | Path) -> bool:
    """Convert only hf_dir's multi-token-prediction layer into folder, an existing conversion of
    hf_dir made without it (by a version that did not keep this family's layer): writes mtp/
    and adds it to config.json, nothing else is converted again. False when folder has the
    layer already or the checkpoint ships none that its family can run. Refuses a folder whose
    architecture or hyper-parameters are not those of hf_dir. mtp/ is written under a hidden
    name and renamed into place before config.json names it, so an interruption leaves the
    folder as it was."""
    hf_dir, folder = Path(hf_dir), Path(folder)
    config = _read_json(folder / "config.json", "config.json")
    if config.get("format") != "colibri":
        raise ValueError(f"{folder}: not a Colibri model folder")
    if config.get("mtp") or not archs.offers_mtp(str(config.get("architecture"))):
        return False
    hf_cfg = _read_json(hf_dir / "config.json", "config.json")
    gen_path = hf_dir / "generation_config.json"
    gen = _read_json(gen_path, "generation_config.json") if gen_path.is_file() else {}
    cfg = archs.colibri_config(hf_cfg, gen)
    if json.loads(json.dumps(converted_hparams(cfg))) != config.get("converted_hparams"):
        raise NotAConversionOf(f"{folder} is not a conversion of {hf_dir}: their "
                               "architectures or hyper-parameters differ")
    preset = config.get("quant")
    if preset not in PRESETS:
        raise ValueError(f"{folder}/config.json: unknown quant {preset!r}")
    with Checkpoint(hf_dir, fp8_block=_fp8_block(hf_cfg)) as ckpt:
        mtp = archs.mtp_plan(cfg, set(ckpt.names()))
        if mtp is None:
            return False
        _check_sources(ckpt, mtp[0], mtp[1])
        for stale in (folder / MTP_DIR, *folder.glob(f".{MTP_DIR}.tmp-*")):
            shutil.rmtree(stale, ignore_errors=True)  # an interrupted add's: not listed
        tmp = folder / f".{MTP_DIR}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            files = _write_mtp(ckpt, tmp / MTP_DIR, mtp[0], mtp[1], preset)
            _sync_tree(tmp)
            os.rename(tmp / MTP_DIR, folder / MTP_DIR)
            _fsync_dir(folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    config["mtp"] = MTP_DIR
    config["files"] = {**config.get("files", {}), **files}
    _write_atomic(folder / "config.json", json.dumps(config, indent=2) + "\n")
    return True


def _fp8_block(hf_cfg: dict[str, Any]) -> tuple[int, int]:
    """The block an FP8 checkpoint's scales cover (quantization_config.weight_block_size)."""
    q = hf_cfg.get("quantization_config") or {}
    block = q.get("weight_block_size", [128, 128]) if isinstance(q, dict) else [128, 128]
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(f"config.json: bad quantization_config.weight_block_size {block!r}")
    return block[0], block[1]


def describe_plan(cfg: dict[str, Any], names: set[str], targets: list[archs.Target]) -> list[str]:
    """What the converter recognised, for the user: the family and its layers, and the
    checkpoint tensors it leaves out on purpose (multi-token-prediction layers)."""
    kinds = cfg.get("layer_ffn") or ["moe"] * cfg["n_layer"]
    n_dense = kinds.count("dense")
    parts = [f"{cfg['n_layer']} layers"]
    if n_dense:
        parts.append(f"{n_dense} dense")
    if cfg["n_expert"]:
        shared = f", shared experts of width {cfg['n_ff_shared']}" if cfg["n_ff_shared"] else ""
        parts.append(f"{len(kinds) - n_dense} with {cfg['n_expert']} experts, top-"
                     f"{cfg['n_expert_used']} ({cfg.get('router', 'softmax')} router){shared}")
    attn = cfg.get("layer_attn") or []
    if cfg.get("sliding_window") and attn:
        parts.append(f"{attn.count('sliding')} with a sliding window of "
                     f"{cfg['sliding_window']}, {attn.count('full')} full")
    elif cfg.get("sliding_window"):
        parts.append(f"a sliding window of {cfg['sliding_window']}")
    if "chunked" in attn:
        parts.append(f"{attn.count('chunked')} attending in chunks of {cfg['attn_chunk']}, "
                     f"{attn.count('full')} globally")
    if cfg.get("nope_layers"):
        tuned = " (query temperature tuning)" if cfg.get("attn_temp_floor") else ""
        parts.append(f"{len(cfg['nope_layers'])} without RoPE{tuned}")
    if cfg.get("route_input"):
        parts.append("router weights scale the experts' input")
    if cfg.get("attn_sinks"):
        parts.append("attention sinks")
    mixers = cfg.get("layer_mixer") or []
    if "linear" in mixers:
        parts.append(f"{mixers.count('linear')} linear attention (gated DeltaNet, conv width "
                     f"{cfg['lin_conv']}), {mixers.count('attention')} gated full attention")
    if any(t.kind == archs.MXFP4 for t in targets):
        parts.append("experts kept in MXFP4")
    rd, hd = cfg.get("rotary_dim") or cfg["head_dim"], cfg["head_dim"]
    if cfg.get("attn", "gqa") == "gqa" and rd < hd:
        parts.append(f"rotary on {rd} of {hd} head dims")
    qk = {"head": "q/k RMSNorm per head", "full": "q/k RMSNorm over the whole projection",
          "l2": "q/k L2 norm on the RoPE layers"}.get(cfg.get("qk_norm", "none"))
    if qk:
        parts.append(qk)
    lines = [f"recognised {cfg['hf_architecture']} as the {cfg['architecture']} family: "
             + ", ".join(parts)]
    used = ({t.source.hf_name for t in targets}
            | {t.source.scales for t in targets if t.source.scales})
    vision = [n for n in names - used if n.startswith(("vision_model.", "multi_modal_projector."))]
    if vision:
        lines.append(f"skipping {len(vision)} tensors of the vision encoder and its projector: "
                     f"the text model is converted")
    mtp = archs.mtp_plan(cfg, names)
    if mtp is not None:
        used |= {t.source.hf_name for t in mtp[1]}
        what = ("the multi-token-prediction module (mtp.*)"
                if any(t.source.hf_name.startswith("mtp.") for t in mtp[1])
                else f"multi-token-prediction layer {cfg['n_layer']}")
        lines.append(f"{what} converted into {MTP_DIR}/ (drafts for --speculative mtp)")
    unused = sorted(n for n in names - used if n.startswith("model.layers."))
    if unused:
        layers = sorted({int(n.split(".")[2]) for n in unused if n.split(".")[2].isdigit()})
        lines.append(f"skipping {len(unused)} tensors of multi-token-prediction layer(s) "
                     f"{', '.join(map(str, layers))}: they are not used to decode")
    mtp_names = [n for n in names - used if n.startswith("mtp.")]
    if mtp_names:
        lines.append(f"skipping {len(mtp_names)} tensors of the multi-token-prediction module "
                     f"(mtp.*): they are not used to decode")
    visual = [n for n in names - used if n.startswith("model.visual.")]
    if visual:
        lines.append(f"skipping {len(visual)} tensors of the vision encoder (model.visual.*): "
                     f"only the text model is served")
    return lines


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, desc: str, enabled: bool):  # noqa: ANN202
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="file")


def _write_atomic(path: Path, text: str) -> None:
    part = path.with_name(path.name + ".part")
    with open(part, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)


def _sync_tree(root: Path) -> None:
    """Everything written under root on disk before root is renamed into place: one syncfs
    of root's filesystem where the C library has it (one flush for the whole conversion
    rather than one per file), else an fsync of every file and folder under root."""
    fd = os.open(root, os.O_RDONLY)
    try:
        syncfs = getattr(_libc(), "syncfs", None)
        if syncfs is not None and syncfs(fd) == 0:
            return
    finally:
        os.close(fd)
    for folder, _dirs, names in os.walk(root):
        for name in names:
            with open(os.path.join(folder, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(folder))


@functools.cache
def _libc() -> Any:
    """The C library of this process (ctypes), or None where it cannot be opened."""
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def verify(model_dir: str | Path, full: bool = False, deep: bool = False) -> None:
    """Check every file listed in config.json (sizes always, sha256 too when full); with
    deep (what `colibri verify` does), also config.json against the weights, the recorded
    hyper-parameters and tensor_types, the tokenizer and, with full, finite weights
    (engine.format.verify). Without deep nothing is mapped or parsed: a cheap check before loading.

    Raises ValueError listing every problem: files missing, resized, altered or outside the
    folder, hyper-parameters changed since conversion, shapes or dtypes that disagree.
    """
    model_dir = Path(model_dir)
    cfg = _read_json(model_dir / "config.json", "config.json")
    if cfg.get("format") != "colibri":
        raise ValueError(f"{model_dir}: not a Colibri model folder (convert it first)")
    files = cfg.get("files")
    if not isinstance(files, dict) or not files:
        raise ValueError(f"{model_dir}/config.json: no 'files' table")
    problems: list[str] = []
    text_files = cfg.get("tokenizer_files", {})
    if not isinstance(text_files, dict):
        text_files = {}
    files = {**files, **text_files}
    for name, meta in files.items():
        path = member(model_dir, name)
        if path is None:
            problems.append(f"{name!r}: not a file name inside the model folder")
            continue
        if not isinstance(meta, dict):
            problems.append(f"{name}: no size and sha256 recorded")
            continue
        if not path.is_file():
            problems.append(f"{name}: missing")
            continue
        size = path.stat().st_size
        if size != meta.get("size"):
            problem = f"{name}: {size} bytes, expected {meta.get('size')}"
            if name in text_files and name.endswith(".json"):
                problem += _parse_problem(path)
            problems.append(problem)
            continue
        if full and _sha256(path) != meta.get("sha256"):
            problems.append(f"{name}: sha256 mismatch (file altered or corrupt)")
    if deep and not problems:  # the files are what was written: do they still fit together?
        problems = verify_problems(model_dir, cfg, full)
    if problems:
        raise ValueError(f"{model_dir}: " + "; ".join(problems))


def _parse_problem(path: Path) -> str:
    """What a reader of a resized tokenizer file runs into (with its parser's words), or ""."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
        if path.name == "tokenizer.json":
            from tokenizers import Tokenizer as HFTokenizer

            HFTokenizer.from_str(text)
        else:
            json.loads(text)
    except Exception as e:  # noqa: BLE001 - any parser complaint is the detail we report
        return f" (does not load: {e})"
    return ""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def cache_dir() -> Path:
    """Where ensure_converted keeps converted models."""
    env = os.environ.get("COLIBRI_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "colibri" / "models"


def _source_key(hf_dir: Path, preset: str) -> str:
    h = hashlib.sha256()
    h.update(str(hf_dir.resolve()).encode())
    for p in sorted(hf_dir.iterdir()):
        if p.is_file():
            st = p.stat()
            h.update(f"\0{p.name}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    h.update(preset.encode())
    return h.hexdigest()[:16]


def ensure_converted(path: str | Path, quant: str = DEFAULT_QUANT,
                     progress: bool = False) -> Path:
    """A Colibri folder for path: path itself if it is one, else a cached conversion.

    The cache entry is keyed by the source's absolute path, file sizes and mtimes and the
    preset, and converted again in place when an earlier choice of the preset's types made
    it; one made without the checkpoint's multi-token-prediction layer gets just that layer
    added (add_mtp); a file lock serialises concurrent converters, and the atomic rename in
    convert() means a reader never sees a half-written entry.
    """
    from colibri.engine.format.hub import download, is_repo_id, repo_name

    path = download(path) if is_repo_id(path) else Path(path)
    if is_colibri_dir(path):
        return path
    if not path.is_dir():
        raise ValueError(f"{path}: not a folder")
    if not (path / "config.json").is_file():
        raise ValueError(f"{path}: no config.json found (not a model folder)")
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    name = (repo_name(path) or path.resolve().name).replace("/", "--")
    dest = root / f"{name}-{_source_key(path, quant)}-{quant}"
    with open(root / f".{dest.name}.lock", "w") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        for stale in root.glob(f".{dest.name}.tmp-*"):  # left by a killed converter
            shutil.rmtree(stale, ignore_errors=True)
        if is_current_conversion(dest, quant):
            try:
                verify(dest)
            except ValueError:
                pass  # damaged cache entry: convert again
            else:
                try:  # made before Colibri kept this family's multi-token-prediction layer:
                    add_mtp(path, dest)  # only that layer is converted now
                    return dest
                except NotAConversionOf:
                    pass  # from other hyper-parameters than today's mapping: convert again
        if dest.exists():  # damaged, or made by an earlier choice of types
            shutil.rmtree(dest)
        try:
            return convert(path, dest, quant=quant, progress=progress)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise ModelError(
                f"converting {path.name} into {root} ran out of disk space ({e.strerror}); "
                "nothing was kept. Free space there, or set COLIBRI_CACHE_DIR to a folder "
                "with room for the converted weights") from None

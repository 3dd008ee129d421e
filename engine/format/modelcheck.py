"""Checking a model folder before anything loads it: one function, one error type.

`check_model(path)` reads what a load would read first (config.json, the weight files'
headers or sizes, tokenizer.json) and raises `ModelError` (engine.errors), whose message is
one line saying what is wrong and what to pass instead. Every command line entry point calls
it before loading, so a bad folder never surfaces as a traceback or after a port is bound. It
reads no tensor data and converts nothing.
"""

from __future__ import annotations

from pathlib import Path

from colibri.engine.demo import default_model_path
from colibri.engine.errors import ModelError


def bundled_model_path() -> Path:
    """The demo model shipped inside the package (a Hugging Face folder)."""
    return default_model_path()  # one definition, in engine.demo


def _hint(flag: str) -> str:
    hint = (f"{flag} must name a Colibri or Hugging Face model folder, or a Hugging Face repo "
            "id (owner/name)")
    if flag.startswith("--"):
        hint += f" (leave {flag} out for the bundled demo model)"
    return hint


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text if len(text) <= 400 else text[:397] + "..."


def check_model(path: str | Path | None, flag: str = "--model",
                n_ctx: int | None = None) -> Path:
    """The folder to load for `path` (None: the bundled demo model), checked.

    Raises ModelError when the folder is missing, is not a model folder, or its
    config.json, weight files or tokenizer.json cannot be read, or when `n_ctx` (a
    context asked for with --n-ctx) is more than the model's positions. `flag` names the
    option the user gave the path with, for the hint ("--model", or a positional like
    "HF_DIR").
    """
    from colibri.engine.format.hub import download, is_repo_id

    source = (bundled_model_path() if path is None
              else download(path) if is_repo_id(path) else Path(path))
    hint = _hint(flag)
    if not source.exists():
        raise ModelError(f"model folder not found: {source}; {hint}")
    if not source.is_dir():
        raise ModelError(f"{source} is a file, not a model folder; {hint}")
    if not (source / "config.json").is_file():
        raise ModelError(f"{source} has no config.json, so it is not a model folder (one holds "
                         f"config.json, *.safetensors and tokenizer.json); {hint}")
    try:
        max_positions = _check_files(source)
    except ModelError:
        raise
    except (ValueError, OSError, RecursionError) as e:
        raise ModelError(f"{_one_line(e)}; {hint}") from None
    if n_ctx is not None and not 1 <= n_ctx <= max_positions:
        raise ModelError(f"--n-ctx {n_ctx}: {source.name} handles 1 to {max_positions} "
                         f"positions; pass --n-ctx {max_positions} or less, or leave it out "
                         f"for {min(max_positions, 4096)}")
    return source


def _check_weight_headers(source: Path, config: dict) -> None:
    """Each weight file's header and tensor table, as the C loader checks them (a file of the
    right size with a damaged header is refused here, before the server binds its port).
    Reads the headers only."""
    from colibri.engine import _core

    for name in config.get("files") or {}:
        if str(name).endswith(".bin"):
            _core.inspect_weight_file(source / str(name))


def _check_files(source: Path) -> int:
    """Check the files a load reads first; returns the model's max_position_embeddings."""
    from colibri.engine.format.convert import CONFIG_MAX_BYTES, _check_sources, verify
    from colibri.engine.format.jsonfile import read_json_object
    from colibri.engine.text.tokenizer import Tokenizer

    raw = read_json_object(source / "config.json", "config.json", CONFIG_MAX_BYTES)
    if raw.get("format") == "colibri":
        from colibri.engine.models.config import ModelConfig

        max_positions = ModelConfig.from_dict(
            raw, source=str(source / "config.json")).max_position_embeddings
        verify(source, full=False)  # sizes only: a truncated file is refused before mapping
        _check_weight_headers(source, raw)
    else:
        from colibri.engine.format.safetensors_io import Checkpoint
        from colibri.engine.models import archs

        gen_path = source / "generation_config.json"
        gen = (read_json_object(gen_path, "generation_config.json", CONFIG_MAX_BYTES)
               if gen_path.is_file() else {})
        cfg = archs.colibri_config(raw, gen)
        max_positions = int(cfg["max_position_embeddings"])
        with Checkpoint(source) as ckpt:  # headers only
            _check_sources(ckpt, cfg, archs.plan(cfg, set(ckpt.names())))
    if not (source / "tokenizer.json").is_file():
        raise ModelError(f"{source} has no tokenizer.json (Colibri needs a fast tokenizer's "
                         f"tokenizer.json beside config.json)")
    Tokenizer.from_dir(source)
    return max_positions

"""Loading a model's multi-token-prediction layer for `--speculative mtp` (engine.spec.mtp).

The converter puts the layer of DeepSeek-V3, GLM-4.5, Qwen3-Next and Qwen3.5 checkpoints into
the model folder's mtp/ as a one-layer model; it is loaded here beside the main model, with the
same threads, context and KV type, and a KV cache of its own numbered as the main one plus
scratch blocks for chained drafts (the layer is full attention even in a model with
linear-attention layers, so rejected drafts are undone as in any KV cache). Refuses, with a
message that says what to do, a model folder without such a layer.
"""

from __future__ import annotations

from typing import Any

from colibri.engine.executor.model import Model
from colibri.engine.models import archs
from colibri.engine.spec.mtp import MtpDrafter, scratch_blocks

MAX_CHAIN_SETS = 64  # sequences that chain drafts in one call of the layer; more take turns


class NoMtpLayer(ValueError):
    """--speculative mtp asked of a model that cannot draft with an MTP layer."""


def missing_layer_message(folder: Any, architecture: str) -> str:
    """Why --speculative mtp cannot run on folder, and what to do about it."""
    head = (f"{folder}: no multi-token-prediction layer in the model folder, which "
            "--speculative mtp drafts with")
    if not archs.offers_mtp(architecture):
        return (f"{head}; only DeepSeek-V3, GLM-4.5, Qwen3-Next and Qwen3.5 checkpoints ship "
                "one that Colibri runs. Use --speculative ngram")
    return (f"{head}. A checkpoint of this family that ships one gets it at conversion: give "
            "--model the Hugging Face checkpoint folder (a cached conversion made without the "
            f"layer gets it added), or run `colibri convert --add-mtp HF_DIR {folder}` with "
            "the checkpoint this folder was converted from. If the checkpoint has none, use "
            "--speculative ngram")


def load_mtp_drafter(model: Any, n_blocks: int, max_seqs: int, max_drafts: int) -> MtpDrafter:
    """An MtpDrafter over model's MTP layer; NoMtpLayer when it has none it can use."""
    cfg = getattr(model, "config", None)
    if cfg is None or not cfg.mtp or not (model.path / cfg.mtp / "config.json").is_file():
        raise NoMtpLayer(missing_layer_message(getattr(model, "path", "the model folder"),
                                               cfg.architecture if cfg is not None else ""))
    n_sets = max(1, min(max_seqs, MAX_CHAIN_SETS))
    layer = Model.load(model.path / cfg.mtp, threads=model.n_threads, n_ctx=model.n_ctx,
                       n_seq=0, kv_type=model.kv_type,
                       kv_blocks=n_blocks + scratch_blocks(max_drafts, n_sets))
    return MtpDrafter(layer, n_blocks, max_drafts)

"""Loading a model's multi-token-prediction layer for `--speculative mtp` (engine.spec.mtp).

The converter puts the layer of DeepSeek-V3 and GLM-4.5 checkpoints into the model folder's
mtp/ as a one-layer model; it is loaded here beside the main model, with the same threads,
context and KV type, and a KV cache of its own numbered as the main one plus scratch blocks
for chained drafts. Refuses, with a message saying why, a model without such a layer and
models with linear-attention layers (their recurrent state cannot take back rejected drafts).
"""

from __future__ import annotations

from typing import Any

from colibri.engine.executor.model import Model
from colibri.engine.spec.mtp import MtpDrafter, scratch_blocks

MAX_CHAIN_SETS = 64  # sequences that chain drafts in one call of the layer; more take turns


class NoMtpLayer(ValueError):
    """--speculative mtp asked of a model that cannot draft with an MTP layer."""


def load_mtp_drafter(model: Any, n_blocks: int, max_seqs: int, max_drafts: int) -> MtpDrafter:
    """An MtpDrafter over model's MTP layer; NoMtpLayer when it has none it can use."""
    cfg = getattr(model, "config", None)
    if cfg is not None and cfg.hybrid:
        raise NoMtpLayer("--speculative mtp is not available for models with linear-attention "
                         "layers (Qwen3-Next): their recurrent state cannot take back rejected "
                         "drafts; use --speculative off")
    if cfg is None or not cfg.mtp or not (model.path / cfg.mtp / "config.json").is_file():
        raise NoMtpLayer(f"{getattr(model, 'path', 'the model')}: no multi-token-prediction "
                         "layer in the model folder, which --speculative mtp drafts with (the "
                         "converter keeps the one DeepSeek-V3 and GLM-4.5 checkpoints ship; "
                         "convert the checkpoint again to get it, or use --speculative ngram)")
    n_sets = max(1, min(max_seqs, MAX_CHAIN_SETS))
    layer = Model.load(model.path / cfg.mtp, threads=model.n_threads, n_ctx=model.n_ctx,
                       n_seq=0, kv_type=model.kv_type,
                       kv_blocks=n_blocks + scratch_blocks(max_drafts, n_sets))
    return MtpDrafter(layer, n_blocks, max_drafts)

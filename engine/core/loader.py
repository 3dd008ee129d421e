"""Building an engine from a model path: convert on first use, load the weights into the C
core, size the shared KV pool, and wire the scheduler.

`EngineConfig` is the one settings object for all of it (the server, the CLI and the Python
API fill it from their own options). The KV pool defaults to room for `max_num_seqs` full
contexts, capped at a quarter of the memory available now and never below one full context.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from colibri.engine.core.block_manager import BLOCK_SIZE
from colibri.engine.core.engine import EngineCore
from colibri.engine.core.kv_types import DEFAULT_KV_CACHE_TYPE, resolve_kv_type
from colibri.engine.core.options import ExpertCacheConfig, default
from colibri.engine.core.scheduler import SchedulerConfig
from colibri.engine.core.speculative import SpeculativeConfig, spare_state_slots
from colibri.engine.executor.expert_cache import (
    CachePlan,
    ExpertCacheMonitor,
    load_pinned,
    memory_free,
    plan_cache,
    resolve_load,
)
from colibri.engine.executor.model import Model, kv_block_bytes
from colibri.engine.format.convert import ensure_converted
from colibri.engine.models.config import ModelConfig
from colibri.engine.text.tokenizer import Tokenizer

log = logging.getLogger("colibri.engine")

DEFAULT_MAX_NUM_SEQS = default("max_num_seqs")
DEFAULT_MAX_NUM_BATCHED_TOKENS = default("max_num_batched_tokens")
# measured on the benchmark Mixtral (2 threads, 8 streams): p99 inter-token latency 0.54 s
# instead of 0.93 s with whole 256-token chunks, a new request's p99 time to first token
# about 2x its idle one (with 64: 0.28 s, but 3.4x)
DEFAULT_PREFILL_TOKENS_WHILE_DECODING = default("prefill_tokens_while_decoding")


@dataclass
class EngineConfig:
    """How to load and run a model."""

    threads: int | None = None  # None: physical cores
    n_ctx: int | None = None  # None: the model's own, capped at 4096
    quant: str = default("quant")  # precision a Hugging Face folder is converted to
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    # prompt tokens a step carries while other requests decode (None: max_num_batched_tokens)
    prefill_tokens_while_decoding: int | None = DEFAULT_PREFILL_TOKENS_WHILE_DECODING
    kv_cache_mb: float | None = None  # None: sized from max_num_seqs and available memory
    kv_cache_type: str = DEFAULT_KV_CACHE_TYPE
    prefix_cache: bool = default("prefix_cache")
    speculative: str = default("speculative")  # off | ngram
    num_speculative_tokens: int = default("num_speculative_tokens")
    progress: bool = True  # show the conversion progress bar
    expert_cache: ExpertCacheConfig = field(default_factory=ExpertCacheConfig.from_env)

    @classmethod
    def from_options(cls, values: object) -> EngineConfig:
        """The config of an object whose attributes are option values by their option names
        (the server's Settings, parsed flags); options it lacks keep their defaults."""
        def pick(names: Iterable[str]) -> dict[str, Any]:
            return {n: getattr(values, n) for n in names if hasattr(values, n)}

        cache = ExpertCacheConfig(**pick(f.name for f in fields(ExpertCacheConfig)))
        own = pick(f.name for f in fields(cls) if f.name not in ("expert_cache", "progress"))
        return cls(**own, expert_cache=cache)


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is no such file)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def kv_pool_blocks(block_bytes: int, n_ctx: int, config: EngineConfig) -> int:
    """Blocks of the KV pool for config; ValueError when an explicit size cannot hold one
    block."""
    per_ctx = -(-n_ctx // BLOCK_SIZE)
    if config.kv_cache_mb is not None:
        n = int(config.kv_cache_mb * 1024 * 1024) // block_bytes
        if n < 1:
            raise ValueError(f"--kv-cache-mb {config.kv_cache_mb:g} is below one KV block "
                             f"({block_bytes / 1024 / 1024:.3f} MB)")
        return n
    n = per_ctx * config.max_num_seqs
    avail = available_memory_bytes()
    if avail is not None:
        n = min(n, max(per_ctx, avail // 4 // block_bytes))
    return max(n, per_ctx)


def resolve_model(model: str | Path | None) -> tuple[Path, str]:
    """(folder, name) of what a user named: a Hugging Face repo id (downloaded once into the
    Hugging Face cache), a folder, or None for the bundled demo model. FileNotFoundError when
    a folder does not exist."""
    from colibri.engine.demo import default_model_path
    from colibri.engine.format.hub import download, is_repo_id

    if is_repo_id(model):
        return download(str(model)), str(model)
    source = Path(model) if model is not None else default_model_path()
    if not source.exists():
        raise FileNotFoundError(f"model folder not found: {source}")
    return source, source.name


def engine_loader(model: str | Path | None, config: EngineConfig) -> Callable[[], EngineCore]:
    """What AsyncEngine runs on its thread to load `model` (see resolve_model)."""

    def load() -> EngineCore:
        folder, name = resolve_model(model)
        core = load_engine(folder, config)
        core.model_name = name
        return core

    return load


def load_engine(path: str | Path, config: EngineConfig) -> EngineCore:
    """An EngineCore over the model at path (a Colibri or Hugging Face folder)."""
    folder = ensure_converted(Path(path), config.quant, progress=config.progress)
    cfg = ModelConfig.from_dir(folder)
    n_ctx = cfg.default_n_ctx() if config.n_ctx is None else config.n_ctx
    kv_type = resolve_kv_type(config.kv_cache_type, cfg.quant)
    block_bytes = kv_block_bytes(cfg, kv_type)
    n_blocks = kv_pool_blocks(block_bytes, n_ctx, config)
    # a recurrent-state slot per running sequence (models with linear attention), one for
    # scoring between steps, and with speculation spare ones to undo rejected drafts
    n_states = config.max_num_seqs + 1 + (spare_state_slots(config.max_num_seqs)
                                          if config.speculative != "off" else 0)
    model = Model.load(folder, threads=config.threads, n_ctx=config.n_ctx, n_seq=0,
                       kv_type=kv_type, kv_blocks=n_blocks, state_slots=n_states)
    monitor = start_expert_cache(model, folder, config.expert_cache, n_blocks * block_bytes)
    tokenizer = Tokenizer.from_dir(folder)
    mb = n_blocks * block_bytes / 1024 / 1024
    log.info("KV cache: %d blocks of %d positions (%s, %.1f MB, %d tokens; %d full contexts "
             "of %d)", n_blocks, BLOCK_SIZE, kv_type, mb, n_blocks * BLOCK_SIZE,
             n_blocks * BLOCK_SIZE // model.n_ctx, model.n_ctx)
    sched = SchedulerConfig(max_num_seqs=config.max_num_seqs,
                            max_num_batched_tokens=config.max_num_batched_tokens,
                            prefill_tokens_while_decoding=config.prefill_tokens_while_decoding)
    spec = SpeculativeConfig(config.speculative, config.num_speculative_tokens)
    core = EngineCore(model, tokenizer, sched, n_blocks, config.prefix_cache, spec)
    core.model_path = folder
    core.model_name = Path(path).name
    core.expert_cache = monitor
    return core


def repack_enabled() -> bool:
    """Whether q8/q4 weights are copied at start into the layout this CPU's kernels read
    fastest (COLIBRI_REPACK, default on; off keeps the files' rows: same tokens, to compare
    speeds)."""
    return os.environ.get("COLIBRI_REPACK", "1").strip().lower() not in ("0", "false", "no")


def start_expert_cache(model: Model, folder: Path, xc: ExpertCacheConfig,
                       kv_bytes: int) -> ExpertCacheMonitor:
    """Decides the expert budget (printed), enables the cache when one is needed and returns
    its monitor. ValueError when an explicit budget is below the minimum."""
    cfg = model.config
    # every weight file but the experts' (which may be thousands: not even listed)
    other_files = [folder / "embeddings.bin"] + [
        p for d in ("attention", "router", "shared", "dense") for p in (folder / d).glob("*.bin")]
    other = kv_bytes + sum(p.stat().st_size for p in other_files)
    n_moe = len(cfg.moe_layers)
    if n_moe == 0:
        if xc.expert_cache_size is not None or xc.expert_cache_mb is not None:
            log.warning("expert cache: a dense model has no routed experts; the expert cache "
                        "budget is ignored")
        repacked = model.core.repack(experts=False) if repack_enabled() else 0
        if repacked:
            log.info("weights: %d matrices repacked for this CPU's kernels", repacked)
        log.info("expert cache: none (a dense model has no routed experts)")
        return ExpertCacheMonitor(model.core, CachePlan(
            None, 0, 0, 0, "a dense model has no routed experts",
            dense_layers=tuple(range(cfg.n_layer))), folder)
    # budgets count the layers with experts: a dense layer's slots are never filled
    plan = plan_cache(model.core, xc, n_moe, cfg.n_expert, cfg.n_expert_used, other,
                      memory_free(available_memory_bytes()))
    shared = sum(p.stat().st_size for p in (folder / "shared").glob("*.bin"))
    plan = replace(plan, shared_bytes=shared,
                   dense_layers=tuple(i for i in range(cfg.n_layer) if i not in cfg.moe_layers))
    # the layout this CPU's kernels read fastest; the cache repacks the experts it loads, and
    # resident experts are copied only when they fit (else the OS pages their mappings)
    repacked = model.core.repack(experts=plan.fits) if repack_enabled() else 0
    if repacked:
        log.info("weights: %d matrices repacked for this CPU's kernels", repacked)
    if plan.per_layer is None:
        log.info("expert cache: off, all %d experts resident (%.1f MB; %s)",
                 n_moe * cfg.n_expert, plan.budget_bytes / 1e6, plan.reason)
    else:
        pinned = (load_pinned(folder, cfg.n_layer, cfg.n_expert, plan.per_layer)
                  if xc.expert_pin else None)
        load = resolve_load(xc.expert_load, folder)
        model.core.enable_expert_cache(plan.per_layer, load=load, prefetch=xc.expert_prefetch,
                                       huge_pages=xc.expert_huge_pages,
                                       prefetch_window=xc.prefetch_window, pinned=pinned,
                                       read_timeout_s=xc.expert_read_timeout_s)
        pages = "" if load == "mmap" else (", slots on 2 MiB pages where granted"
                                           if xc.expert_huge_pages else ", slots on 4 KiB pages")
        log.info("expert cache: %d of %d experts per layer resident (%.1f MB of %.1f MB; %s); "
                 "load %s%s, prefetch %s, %d pinned", plan.per_layer, cfg.n_expert,
                 plan.budget_bytes / 1e6, n_moe * cfg.n_expert * plan.expert_bytes / 1e6,
                 plan.reason, load, pages, "on" if xc.expert_prefetch else "off",
                 0 if pinned is None else int(pinned.sum()))
    return ExpertCacheMonitor(model.core, plan, folder)

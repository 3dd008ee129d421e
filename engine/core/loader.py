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
from typing import TYPE_CHECKING, Any

from colibri.engine.core.block_manager import BLOCK_SIZE
from colibri.engine.core.engine import EngineCore, win_pool_need
from colibri.engine.core.kv_types import DEFAULT_KV_CACHE_TYPE, resolve_kv_type
from colibri.engine.core.options import ExpertCacheConfig, default, env_values
from colibri.engine.core.scheduler import SchedulerConfig
from colibri.engine.core.speculative import SpeculativeConfig, spare_state_slots
from colibri.engine.executor.backend import Placement, resolve_device, torch_unsupported
from colibri.engine.executor.expert_cache import (
    CachePlan,
    ExpertCacheMonitor,
    load_pinned,
    memory_free,
    plan_cache,
    probe_readers,
    resolve_load,
)
from colibri.engine.executor.model import Model, kv_block_bytes, kv_split_block_bytes
from colibri.engine.format.convert import ensure_converted
from colibri.engine.models.config import ModelConfig
from colibri.engine.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from colibri.engine.executor.costmodel import DeviceProfile

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

    # None: the physical cores this process may run on
    threads: int | None = field(default_factory=lambda: env_values(("threads",)).get("threads"))
    device: str = default("device")  # auto | cpu | cuda | cuda:N | torch-cpu
    gpu_memory_mb: float | None = None  # None: everything on a torch device
    device_profile: str | None = None  # None: measure this machine for the placement
    n_ctx: int | None = None  # None: the model's own, capped at 4096
    quant: str = default("quant")  # precision a Hugging Face folder is converted to
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    # prompt tokens a step carries while other requests decode (None: max_num_batched_tokens)
    prefill_tokens_while_decoding: int | None = DEFAULT_PREFILL_TOKENS_WHILE_DECODING
    kv_cache_mb: float | None = None  # None: sized from max_num_seqs and available memory
    kv_cache_type: str = DEFAULT_KV_CACHE_TYPE
    prefix_cache: bool = default("prefix_cache")
    kv_window_pool: bool = default("kv_window_pool")
    speculative: str = default("speculative")  # off | ngram
    num_speculative_tokens: int | None = default("num_speculative_tokens")
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


@dataclass(frozen=True)
class KVPools:
    """Blocks and bytes per block of the KV pools: the full one (every cached layer, or the
    full-attention ones when the windowed layers keep a pool of their own) and the windowed
    one (n_win 0: none)."""

    n_blocks: int
    block_bytes: int
    n_win: int = 0
    win_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.n_blocks * self.block_bytes + self.n_win * self.win_bytes


def one_kv_pool(cfg: ModelConfig, kv_type: str, n_ctx: int, config: EngineConfig) -> KVPools:
    """One KV pool for every cached layer."""
    block_bytes = kv_block_bytes(cfg, kv_type)
    return KVPools(kv_pool_blocks(block_bytes, n_ctx, config), block_bytes)


def kv_pools(cfg: ModelConfig, kv_type: str, n_ctx: int, config: EngineConfig) -> KVPools:
    """The KV pools for a model. A model whose sliding-window or chunked layers sit beside full
    ones keeps those layers in a windowed pool sized for what running requests' windows and
    one step's tokens reach (a request gives its blocks back as its windows move on): the
    default size then holds as many tokens as one pool would, in less memory, and an explicit
    --kv-cache-mb holds more tokens."""
    one = one_kv_pool(cfg, kv_type, n_ctx, config)
    all_bytes, n_all = one.block_bytes, one.n_blocks
    split = (None if cfg.hybrid or not config.kv_window_pool
             else kv_split_block_bytes(cfg, kv_type))
    if split is None:
        return KVPools(n_all, all_bytes)
    full_b, win_b = split
    window, chunk = cfg.sliding_window or 0, cfg.attn_chunk or 0
    if max(window, chunk) >= n_ctx:  # no window ends inside the context: nothing goes back
        return KVPools(n_all, all_bytes)
    sched = SchedulerConfig(max_num_seqs=config.max_num_seqs,
                            max_num_batched_tokens=config.max_num_batched_tokens)
    span_blocks = -(-max(window, chunk) // BLOCK_SIZE)
    n_win = (config.max_num_seqs * (span_blocks + 3)
             + -(-config.max_num_batched_tokens // BLOCK_SIZE))
    if config.kv_cache_mb is None:
        n_full = n_all
    else:
        budget = int(config.kv_cache_mb * 1024 * 1024)
        n_full = (budget - n_win * win_b) // full_b
        if n_full < n_win:  # a small budget: as many blocks in each pool
            n_full = budget // (full_b + win_b)
    n_win = min(n_win, n_full)
    if n_win < win_pool_need(window, chunk, sched):
        return KVPools(n_all, all_bytes)  # too small to split: one pool
    return KVPools(n_full, full_b, n_win, win_b)


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
    device, placement, profile = choose_placement(folder, cfg, config, n_ctx)
    # the windowed KV pool is the C core's: a torch device keeps one pool
    pools = (kv_pools(cfg, kv_type, n_ctx, config) if device == "cpu"
             else one_kv_pool(cfg, kv_type, n_ctx, config))
    n_blocks = pools.n_blocks
    # a recurrent-state slot per running sequence (models with linear attention), one for
    # scoring between steps, and with speculation spare ones to undo rejected drafts
    n_states = config.max_num_seqs + 1 + (spare_state_slots(config.max_num_seqs)
                                          if config.speculative != "off" else 0)
    model = Model.load(folder, threads=config.threads, n_ctx=config.n_ctx, n_seq=0,
                       kv_type=kv_type, kv_blocks=n_blocks, state_slots=n_states,
                       kv_win_blocks=pools.n_win, device=device, placement=placement)
    monitor = attach_monitor(model, folder, profile, config.expert_cache, pools.total_bytes)
    tokenizer = Tokenizer.from_dir(folder)
    mb = pools.total_bytes / 1024 / 1024
    log.info("KV cache: %d blocks of %d positions (%s, %.1f MB, %d tokens; %d full contexts "
             "of %d)", n_blocks, BLOCK_SIZE, kv_type, mb, n_blocks * BLOCK_SIZE,
             n_blocks * BLOCK_SIZE // model.n_ctx, model.n_ctx)
    if pools.n_win:
        log.info("KV cache: the sliding-window and chunked layers keep a pool of their own, "
                 "%d blocks (%.1f MB): a request holds only the blocks its windows still "
                 "reach, and gives the others back as it grows", pools.n_win,
                 pools.n_win * pools.win_bytes / 1024 / 1024)
    sched = SchedulerConfig(max_num_seqs=config.max_num_seqs,
                            max_num_batched_tokens=config.max_num_batched_tokens,
                            prefill_tokens_while_decoding=config.prefill_tokens_while_decoding)
    spec = SpeculativeConfig(config.speculative, config.num_speculative_tokens)
    core = EngineCore(model, tokenizer, sched, n_blocks, config.prefix_cache, spec)
    core.model_path = folder
    core.model_name = Path(path).name
    core.expert_cache = monitor
    return core


def choose_placement(folder: Path, cfg: ModelConfig, config: EngineConfig, n_ctx: int
                     ) -> tuple[str, Placement | None, DeviceProfile | None]:
    """The device the step runs on and, under --gpu-memory-mb, the layers the cost model
    puts on it (the others run on the C core), with the device profile it planned with.
    auto keeps models the torch backend does not run on the C core."""
    device = resolve_device(config.device)
    if device != "cpu" and config.device == "auto" and torch_unsupported(cfg):
        log.info("device: cpu (auto; the GPU path does not run %s)",
                 ", ".join(torch_unsupported(cfg)))
        return "cpu", None, None
    if device == "cpu" or config.gpu_memory_mb is None:
        log.info("device: %s", device)
        return device, None, None
    from colibri.engine.executor.costmodel import DeviceProfile
    from colibri.engine.executor.placement import budget_text, measure_profile, plan_placement

    profile = (DeviceProfile.load(config.device_profile) if config.device_profile
               else measure_profile(config.threads or 0, device))
    placement, text, _plan = plan_placement(folder, cfg, profile, config.gpu_memory_mb, n_ctx)
    log.info("device: %s, placement under %s: %s", device, budget_text(config.gpu_memory_mb),
             text)
    return (device, placement, profile) if placement is not None else ("cpu", None, None)


def attach_monitor(model: Model, folder: Path, profile: DeviceProfile | None,
                   xc: ExpertCacheConfig, kv_bytes: int) -> ExpertCacheMonitor | None:
    """The loaded model's monitor (the expert cache's on the C core, the split's on a torch
    device), with the placement's profile handed to a split: its per-step choice for cold
    experts predicts with the profile the placement was planned with."""
    if model.device == "cpu":
        return start_expert_cache(model, folder, xc, kv_bytes)
    split = getattr(model.core, "expert_split", None)
    if split is not None:
        split.profile = profile
    return split_monitor(model, folder, xc, kv_bytes)


def split_monitor(model: Model, folder: Path, xc: ExpertCacheConfig,
                  kv_bytes: int) -> ExpertCacheMonitor | None:
    """The monitor of a run split between a torch device and the C core: the C core's expert
    cache, planned and enabled as on the CPU (its layers, and the experts a GPU layer leaves
    to it, read through the cache), and the GPU tier's counters when routed experts are
    split (/metrics and /v1/expert_cache). None for a run all on the torch device."""
    c = getattr(model.core, "c", None)
    if c is None:
        return None
    # the C core's weights stay in the files' rows: most of them are the device layers', which
    # it never reads
    monitor = start_expert_cache(model, folder, xc, kv_bytes, core=c, repack=False)
    monitor.gpu_tier = getattr(model.core, "expert_split", None)
    return monitor


def repack_enabled() -> bool:
    """Whether q8/q4 weights are copied at start into the layout this CPU's kernels read
    fastest (COLIBRI_REPACK, default on; off keeps the files' layout: same tokens, to compare
    speeds)."""
    return os.environ.get("COLIBRI_REPACK", "1").strip().lower() not in ("0", "false", "no")


def start_expert_cache(model: Model, folder: Path, xc: ExpertCacheConfig, kv_bytes: int,
                       core: Any = None, repack: bool = True) -> ExpertCacheMonitor:
    """Decides the expert budget (printed), enables the cache when one is needed and returns
    its monitor. ValueError when an explicit budget is below the minimum. core: the C core
    whose cache it is (None: the model's; a split names its C side); repack False keeps the
    weights in the files' rows whatever COLIBRI_REPACK says."""
    cfg = model.config
    core = model.core if core is None else core
    repack = repack and repack_enabled()
    # every weight file but the experts' (which may be thousands: not even listed)
    other_files = [folder / "embeddings.bin"] + [
        p for d in ("attention", "router", "shared", "dense") for p in (folder / d).glob("*.bin")]
    other = kv_bytes + sum(p.stat().st_size for p in other_files)
    n_moe = len(cfg.moe_layers)
    if n_moe == 0:
        if xc.expert_cache_size is not None or xc.expert_cache_mb is not None:
            log.warning("expert cache: a dense model has no routed experts; the expert cache "
                        "budget is ignored")
        repacked = core.repack(experts=False) if repack else 0
        if repacked:
            log.info("weights: %d matrices repacked for this CPU's kernels", repacked)
        log.info("expert cache: none (a dense model has no routed experts)")
        return ExpertCacheMonitor(core, CachePlan(
            None, 0, 0, 0, "a dense model has no routed experts",
            dense_layers=tuple(range(cfg.n_layer))), folder)
    # budgets count the layers with experts: a dense layer's slots are never filled
    plan = plan_cache(core, xc, n_moe, cfg.n_expert, cfg.n_expert_used, other,
                      memory_free(available_memory_bytes()))
    shared = sum(p.stat().st_size for p in (folder / "shared").glob("*.bin"))
    plan = replace(plan, shared_bytes=shared,
                   dense_layers=tuple(i for i in range(cfg.n_layer) if i not in cfg.moe_layers))
    # the layout this CPU's kernels read fastest; the cache reads (and for rows, repacks) the
    # experts it loads, and resident experts, stored in that layout, are copied only when they
    # fit (else the OS pages their mappings)
    repacked = core.repack(experts=plan.fits) if repack else 0
    if repacked:
        log.info("weights: %d matrices repacked or copied for this CPU's kernels", repacked)
    if plan.per_layer is None:
        log.info("expert cache: off, all %d experts resident (%.1f MB; %s)",
                 n_moe * cfg.n_expert, plan.budget_bytes / 1e6, plan.reason)
    else:
        pinned = (load_pinned(folder, cfg.n_layer, cfg.n_expert, plan.per_layer)
                  if xc.expert_pin else None)
        load = resolve_load(xc.expert_load, folder)
        if xc.expert_readers is None:
            readers, why = probe_readers(folder)
        else:
            readers, why = xc.expert_readers, "--expert-readers"
        plan = replace(plan, readers=readers, readers_reason=why)
        depth = xc.expert_prefetch_depth
        core.enable_expert_cache(plan.per_layer, load=load, prefetch=xc.expert_prefetch,
                                 huge_pages=xc.expert_huge_pages,
                                 prefetch_window=xc.prefetch_window, pinned=pinned,
                                 read_timeout_s=xc.expert_read_timeout_s, readers=readers,
                                 prefetch_depth=0 if depth == "auto" else int(depth))
        pages = "" if load == "mmap" else (", slots on 2 MiB pages where granted"
                                           if xc.expert_huge_pages else ", slots on 4 KiB pages")
        ahead = (f"on, {depth} layer{'s' if depth == '2' else ''} ahead" if depth != "auto"
                 else "on, 1 or 2 layers ahead as reads and layers measure")
        log.info("expert cache: %d of %d experts per layer resident (%.1f MB of %.1f MB; %s); "
                 "load %s%s, %d readers (%s), prefetch %s, %d pinned", plan.per_layer,
                 cfg.n_expert, plan.budget_bytes / 1e6,
                 n_moe * cfg.n_expert * plan.expert_bytes / 1e6, plan.reason, load, pages,
                 readers, why, ahead if xc.expert_prefetch else "off",
                 0 if pinned is None else int(pinned.sum()))
    return ExpertCacheMonitor(core, plan, folder)

"""The cache options shared by `serve`, `generate`, `bench` and `eval`."""

from __future__ import annotations

import argparse
from typing import Any

from colibri.engine.core.kv_types import DEFAULT_KV_CACHE_TYPE, KV_CACHE_TYPES
from colibri.engine.executor.expert_cache import LOAD_MODES, ExpertCacheConfig


def add_expert_cache_args(p: argparse.ArgumentParser, suppress: bool = False) -> None:
    """Adds --expert-cache-mb and friends; suppress: leave unset options out of the namespace
    (serve layers them over its settings)."""
    d: dict[str, Any] = {"default": argparse.SUPPRESS} if suppress else {}
    p.add_argument("--expert-cache-mb", type=float, metavar="MB", **d,
                   help="memory for routed experts, all layers (default: every expert when "
                        "the model fits in free memory, else what is free; also "
                        "COLIBRI_EXPERT_CACHE_MB)")
    p.add_argument("--expert-cache-size", type=int, metavar="N", **d,
                   help="routed experts kept resident per layer (wins over --expert-cache-mb)")
    p.add_argument("--prefetch-window", type=int, metavar="TOKENS", **d,
                   help="tokens of routing history that make an expert hot (default 16)")
    p.add_argument("--expert-load", choices=LOAD_MODES, **d,
                   help="how missing experts are read: direct (O_DIRECT into slots, past "
                        "the page cache), pread (into slots, through the page cache), mmap "
                        "(madvise on the files); default auto: direct where the file system "
                        "allows it, else pread")
    p.add_argument("--no-expert-prefetch", dest="expert_prefetch", action="store_false",
                   default=argparse.SUPPRESS if suppress else True,
                   help="no prefetch thread reading the next layer's experts ahead")
    p.add_argument("--no-pin", dest="expert_pin", action="store_false",
                   default=argparse.SUPPRESS if suppress else True,
                   help="do not pin the experts earlier runs used most")
    p.add_argument("--expert-huge-pages", action=argparse.BooleanOptionalAction,
                   default=argparse.SUPPRESS if suppress else True,
                   help="2 MiB transparent huge pages on the expert slots (default on: "
                        "O_DIRECT reads into them run faster)")


def add_kv_cache_type_arg(p: argparse.ArgumentParser) -> None:
    """Adds --kv-cache-type, defaulting to the server's."""
    p.add_argument("--kv-cache-type", choices=KV_CACHE_TYPES, default=DEFAULT_KV_CACHE_TYPE,
                   help=f"KV cache element type (default {DEFAULT_KV_CACHE_TYPE}, as the server: "
                        "f32 for an f32 model, else f16)")


def expert_cache_from_args(args: argparse.Namespace) -> ExpertCacheConfig:
    """The ExpertCacheConfig of parsed options, over COLIBRI_EXPERT_CACHE_* variables."""
    c = ExpertCacheConfig.from_env()
    if getattr(args, "expert_cache_mb", None) is not None:
        c.mb = args.expert_cache_mb
    if getattr(args, "expert_cache_size", None) is not None:
        c.size = args.expert_cache_size
    if getattr(args, "prefetch_window", None) is not None:
        c.prefetch_window = args.prefetch_window
    if getattr(args, "expert_load", None) is not None:
        c.load = args.expert_load
    c.prefetch = bool(getattr(args, "expert_prefetch", c.prefetch))
    c.pin = bool(getattr(args, "expert_pin", c.pin))
    c.huge_pages = bool(getattr(args, "expert_huge_pages", c.huge_pages))
    if c.prefetch_window < 1:
        raise ValueError("--prefetch-window must be at least 1")
    return c

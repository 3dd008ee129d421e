"""The cache options shared by `serve`, `generate`, `bench` and `eval`, made from the options
table (engine.core.options): names, defaults, help and checks all come from there."""

from __future__ import annotations

import argparse

from colibri.engine.core.kv_types import DEFAULT_KV_CACHE_TYPE, KV_CACHE_TYPES
from colibri.engine.core.options import (
    EXPERT_CACHE_OPTIONS,
    ExpertCacheConfig,
    add_option_args,
    option_values,
)

__all__ = ["DEFAULT_KV_CACHE_TYPE", "KV_CACHE_TYPES", "DEVICE_OPTIONS", "add_device_args",
           "add_expert_cache_args", "add_kv_cache_type_arg", "device_from_args",
           "expert_cache_from_args"]

DEVICE_OPTIONS = ("device", "gpu_memory_mb", "device_profile")


def add_expert_cache_args(p: argparse.ArgumentParser, suppress: bool = False) -> None:
    """Adds --expert-cache-mb and friends (also read from their COLIBRI_* variables, see
    expert_cache_from_args); suppress as in engine.core.options.add_option_args."""
    add_option_args(p, EXPERT_CACHE_OPTIONS, suppress=suppress)


def add_kv_cache_type_arg(p: argparse.ArgumentParser) -> None:
    """Adds --kv-cache-type, defaulting to the server's."""
    add_option_args(p, ("kv_cache_type",))


def expert_cache_from_args(args: argparse.Namespace) -> ExpertCacheConfig:
    """The ExpertCacheConfig of parsed options: flags over COLIBRI_* variables over defaults."""
    return ExpertCacheConfig(**option_values(args, EXPERT_CACHE_OPTIONS))


def threads_from_args(args: argparse.Namespace) -> int | None:
    """--threads, else COLIBRI_THREADS, else None (the cores this process may run on);
    ValueError "--threads must be at least 1, got ..." on a bad count."""
    return option_values(args, ("threads",))["threads"]


def add_device_args(p: argparse.ArgumentParser, suppress: bool = False) -> None:
    """Adds --device, --gpu-memory-mb and --device-profile (also read from COLIBRI_DEVICE,
    COLIBRI_GPU_MEMORY_MB and COLIBRI_DEVICE_PROFILE, see device_from_args)."""
    add_option_args(p, DEVICE_OPTIONS, suppress=suppress)


def device_from_args(args: argparse.Namespace) -> dict[str, object]:
    """{"device": ..., "gpu_memory_mb": ..., "device_profile": ...}: flags over COLIBRI_*
    variables over defaults."""
    return option_values(args, DEVICE_OPTIONS)

"""A torch device's side of a device profile, measured: memory GB/s (a large on-device copy),
product GMAC/s (float32 products of the torch backend's shape), host-to-device GB/s (pinned
copies), one launch and one sync. Runs on any torch device; its figures mean something only
on the GPU it is meant for."""

from __future__ import annotations

import time

import torch

from colibri.engine.executor.costmodel import GpuProfile


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _best(fn: object, dev: torch.device, reps: int = 5) -> float:
    out = []
    for _ in range(reps):
        _sync(dev)
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        _sync(dev)
        out.append(time.perf_counter() - t0)
    return min(out)


def measure_gpu(device: str, mib: int = 512) -> GpuProfile:
    dev = torch.device(device)
    n = (mib << 20) // 4
    a = torch.empty(n, dtype=torch.float32, device=dev)
    b = torch.empty_like(a)
    a.fill_(1.0)
    hbm = 2 * a.numel() * 4 / _best(lambda: b.copy_(a), dev) / 1e9  # read + write
    m = torch.randn(4096, 4096, device=dev)
    x = torch.randn(512, 4096, device=dev)
    gmacs = 512 * 4096 * 4096 / _best(lambda: x @ m.T, dev) / 1e9
    host = torch.empty(n // 4, dtype=torch.float32,
                       pin_memory=dev.type == "cuda")
    dst = torch.empty(n // 4, dtype=torch.float32, device=dev)
    h2d = host.numel() * 4 / _best(lambda: dst.copy_(host, non_blocking=True), dev) / 1e9
    one = torch.zeros(1, device=dev)
    k = 200
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(k):
        one.add_(1.0)
    _sync(dev)
    launch = (time.perf_counter() - t0) / k * 1e6
    sync = _best(lambda: one.add_(1.0).item(), dev, 20) * 1e6
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        name, mem = props.name, int(props.total_memory // 10**6)
    else:
        name, mem = f"torch {dev.type}", 0
    return GpuProfile(name, mem, hbm, gmacs, h2d, launch, sync)

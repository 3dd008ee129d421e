"""The GPU figures of scripts/device_check.sh, on a random Mixtral-shaped model it builds (no
download): decode tokens/s all on the GPU beside the HBM bound, a --gpu-memory-mb run holding
the non-expert weights and a quarter of the experts (the others on the CPU beside them, the
GPU tier's counters) against the CPU-only decode, and the cost model's predicted step time
against the measured one at three budgets.

Usage: python scripts/device_check.py [--device cuda:0] [--out DIR] [--layers 8]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from colibri.engine.executor.costmodel import model_costs  # noqa: E402
from colibri.engine.executor.model import Model  # noqa: E402
from colibri.engine.executor.placement import measure_profile, plan_placement  # noqa: E402
from colibri.engine.format.convert import convert  # noqa: E402
from colibri.engine.models.config import ModelConfig  # noqa: E402
from tests.tiny_models import make_checkpoint  # noqa: E402

PROMPT, GEN = 64, 64


def build(out: Path, layers: int) -> Path:
    q8 = out / "q8"
    if (q8 / "config.json").is_file():
        return q8
    hf = make_checkpoint("mixtral", out / "hf", seed=1, hidden_size=1024,
                         intermediate_size=2816, num_hidden_layers=layers,
                         num_attention_heads=16, num_key_value_heads=4, num_local_experts=8,
                         num_experts_per_tok=2, max_position_embeddings=4096)
    return convert(hf, q8, quant="q8", progress=False)


def decode_ms(m: Model) -> float:
    """Median ms of a greedy decode step after a PROMPT-token prefill."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, m.n_vocab, PROMPT).astype(np.int32)
    m.reset(0)
    logits = m.forward(ids, np.zeros(PROMPT, np.int32), np.arange(PROMPT, dtype=np.int32))
    tok, times = int(logits[-1].argmax()), []
    for i in range(GEN):
        t0 = time.perf_counter()
        out = m.forward(np.array([tok], np.int32), np.zeros(1, np.int32),
                        np.array([PROMPT + i], np.int32))
        tok = int(out[-1].argmax())  # the logits are on the host: the step has synced
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times[4:]))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--out", default="/tmp/colibri_device_check")
    ap.add_argument("--layers", type=int, default=8)
    a = ap.parse_args()
    path = build(Path(a.out), a.layers)
    cfg = ModelConfig.from_dir(path)
    prof = measure_profile(0, a.device)
    assert prof.gpu is not None
    print(f"GPU            {prof.gpu.name}: {prof.gpu.hbm_gb_s:.0f} GB/s copy, "
          f"{prof.gpu.gmacs:.0f} GMAC/s f32, {prof.gpu.h2d_gb_s:.1f} GB/s host-to-device, "
          f"launch {prof.gpu.launch_us:.1f} us, sync {prof.gpu.sync_us:.1f} us")
    print(f"CPU            {prof.cpu.read_gb_s:.1f} GB/s read, GMAC/s "
          + ", ".join(f"{k} {v:.0f}" for k, v in prof.cpu.gmacs.items()))
    mc = model_costs(path, cfg, context=PROMPT + GEN)
    active = (sum(i.gpu_bytes for i in mc.always)
              + sum(e.gpu_bytes * cfg.n_expert_used for e in mc.experts.values()))
    ctx = PROMPT + GEN + 16

    cpu = Model.load(path, n_ctx=ctx)
    cpu_ms = decode_ms(cpu)
    del cpu
    gpu = Model.load(path, n_ctx=ctx, device=a.device)
    gpu_ms = decode_ms(gpu)
    del gpu
    bound = prof.gpu.hbm_gb_s * 1e9 / active
    print(f"model          Mixtral shape, {cfg.n_layer} layers, {cfg.n_expert} experts top-"
          f"{cfg.n_expert_used}, q8, {active / 1e6:.0f} MB read per token")
    print(f"all on GPU     {1e3 / gpu_ms:8.1f} tok/s   HBM bound {bound:8.0f} tok/s "
          f"({100 * 1e3 / gpu_ms / bound:.1f}% of it)")
    print(f"CPU only       {1e3 / cpu_ms:8.1f} tok/s")

    always = sum(i.gpu_bytes for i in mc.always)
    experts = sum(e.gpu_bytes * cfg.n_expert for e in mc.experts.values())
    quarter_mb = (always + experts / 4) / 1e6
    rows = []
    tier = ""
    for label, mb in (("quarter", quarter_mb), ("half", (always + experts / 2) / 1e6),
                      ("all", (always + experts) * 1.1 / 1e6)):
        placement, text, plan = plan_placement(path, cfg, prof, mb, ctx)
        if placement is None:
            m = Model.load(path, n_ctx=ctx)
        else:
            m = Model.load(path, n_ctx=ctx, device=a.device, placement=placement)
        pred = plan.decode_ms if placement is not None else plan.cpu_decode_ms
        ms = decode_ms(m)
        split = getattr(m.core, "expert_split", None)
        if split is not None and label == "quarter":
            st = split.stats()
            tier = (f"GPU tier       {st['experts_on_device']} experts on the GPU, "
                    f"{st['hits']} selections there, {st['misses']} on the CPU beside it, "
                    f"{st['uploads']} uploads ({st['upload_bytes'] / 1e6:.1f} MB)")
        del m
        rows.append((label, mb, pred, ms, text))
    q = rows[0]
    print(f"--gpu-memory-mb {q[1]:.0f} (non-expert weights + a quarter of the experts): "
          f"{1e3 / q[3]:.1f} tok/s, {cpu_ms / q[3]:.2f}x the CPU-only decode")
    if tier:
        print(tier)
    print("budget MB   predicted ms   measured ms   error   placement")
    for label, mb, pred, ms, text in rows:
        print(f"{mb:9.0f}   {pred:12.2f}   {ms:11.2f}   {100 * (pred - ms) / ms:+5.0f}%   "
              f"{label}: {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

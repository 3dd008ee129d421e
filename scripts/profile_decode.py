"""Private timing harness for the forward pass: prefill and decode tokens/s of a random Mixtral.

Builds (once, cached) a small random Mixtral with transformers
(vocab 32000, hidden 1024, intermediate 3584, 8 layers, 8 experts, top-2, 16 heads, 8 KV
heads), converts it to Colibri q8 and q4, then times through engine.executor.model.Model:
prefill of a P-token prompt (one forward call) and N single-token decode steps.
Prints the median of R runs. Not a test; `colibri bench` is the user-facing tool.

Usage: python scripts/profile_decode.py [--quant q8,q4] [--threads 2] [--runs 3]
                                        [--prompt 128] [--decode 128] [--dir /tmp/speed_model]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SIZE = dict(vocab_size=32000, hidden_size=1024, intermediate_size=3584, num_hidden_layers=8,
            num_local_experts=8, num_experts_per_tok=2, num_attention_heads=16,
            num_key_value_heads=8, head_dim=64, max_position_embeddings=4096,
            rms_norm_eps=1e-5, rope_theta=1e6, tie_word_embeddings=False)


def build_checkpoint(hf_dir: Path) -> None:
    """Random-init Mixtral of SIZE saved as f16 safetensors (skipped when present)."""
    if (hf_dir / "config.json").is_file():
        return
    import torch
    import transformers as tf

    from colibri.engine.text.bpe import train_bpe_tokenizer

    torch.manual_seed(0)
    cfg = tf.MixtralConfig(**SIZE, bos_token_id=None, eos_token_id=2, pad_token_id=0)
    model = tf.MixtralForCausalLM(cfg).eval()
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith("gate.weight"):
                p.copy_(2.0 * torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    model = model.to(torch.float16)
    hf_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(hf_dir))
    train_bpe_tokenizer(["The quick brown fox jumps over the lazy dog. " * 20] * 4, 320, hf_dir)


def ensure(base: Path, quant: str) -> Path:
    from colibri.engine.format.convert import convert_once

    hf = base / "hf"
    build_checkpoint(hf)
    return convert_once(hf, base / quant, quant)


def time_model(path: Path, threads: int, n_prompt: int, n_decode: int,
               runs: int) -> tuple[float, float, float, float]:
    """Median prefill and decode tokens/s over wall time, then over CPU time x threads (what
    the figure would be if the threads had their cores to themselves: useful on a busy box)."""
    from colibri.engine.executor.model import Model

    m = Model.load(path, threads=threads, n_ctx=n_prompt + n_decode + 8)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, m.n_vocab, n_prompt).astype(np.int32)
    seq = np.zeros(n_prompt, np.int32)
    one_seq = np.zeros(1, np.int32)
    pre, dec, cpre, cdec = [], [], [], []
    for _ in range(runs):
        m.reset(0)
        c0 = time.process_time()
        t0 = time.perf_counter()
        logits = m.forward(prompt, seq, np.arange(n_prompt, dtype=np.int32),
                           np.eye(1, n_prompt, n_prompt - 1, dtype=np.uint8)[0])
        t1 = time.perf_counter()
        c1 = time.process_time()
        tok = np.array([int(np.argmax(logits[-1]))], np.int32)
        t2 = time.perf_counter()
        c2 = time.process_time()
        for i in range(n_decode):
            lg = m.forward(tok, one_seq, np.array([n_prompt + i], np.int32))
            tok[0] = int(np.argmax(lg[0]))
        t3 = time.perf_counter()
        c3 = time.process_time()
        pre.append(n_prompt / (t1 - t0))
        dec.append(n_decode / (t3 - t2))
        cpre.append(n_prompt / (c1 - c0) * threads)
        cdec.append(n_decode / (c3 - c2) * threads)
    return (statistics.median(pre), statistics.median(dec), statistics.median(cpre),
            statistics.median(cdec))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quant", default="q8,q4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--dir", default="/tmp/speed_model")
    a = ap.parse_args()
    base = Path(a.dir)
    for q in a.quant.split(","):
        path = ensure(base, q)
        pre, dec, cpre, cdec = time_model(path, a.threads, a.prompt, a.decode, a.runs)
        print(f"{q}: prefill {pre:7.1f} tok/s   decode {dec:7.1f} tok/s   "
              f"[cpu-time: prefill {cpre:7.1f}  decode {cdec:7.1f}]   "
              f"(threads {a.threads}, median of {a.runs}, load {os.getloadavg()[0]:.2f})",
              flush=True)


if __name__ == "__main__":
    main()

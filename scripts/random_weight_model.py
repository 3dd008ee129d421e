"""Write a copy of a Hugging Face MoE folder whose weights are redrawn at random.

Every tensor of the checkpoint becomes Gaussian noise with that tensor's own mean and
standard deviation (so norms stay near their trained scale and activations keep their size);
config and tokenizer are copied unchanged. The result routes like an untrained model of the
same shape: the contrast for a routing trace of the trained one (docs/expert-cache.md,
"Expert cache: routing replay"). Needs torch and safetensors.

    python scripts/random_weight_model.py OUT_DIR [--model HF_DIR] [--seed N]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from colibri.engine.demo import default_model_path


def randomize(src: Path, out: Path, seed: int) -> Path:
    """Copy src to out (a new folder) with every safetensors tensor redrawn."""
    if out.exists():
        raise SystemExit(f"{out} exists; give a new folder")
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.safetensors"))
    g = torch.Generator().manual_seed(seed)
    for f in sorted(src.glob("*.safetensors")):
        tensors = load_file(f)
        new = {}
        for name in sorted(tensors):
            t = tensors[name].float()
            std = float(t.std()) if t.numel() > 1 else 0.0
            noise = torch.randn(t.shape, generator=g) * std + float(t.mean())
            new[name] = noise.to(tensors[name].dtype)
        save_file(new, out / f.name, metadata={"format": "pt"})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--model", type=Path, default=default_model_path(),
                   help="Hugging Face folder (default: the bundled demo model)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    print(randomize(a.model, a.out_dir, a.seed))


if __name__ == "__main__":
    main()

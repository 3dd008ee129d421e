"""Held-out perplexity of a model by position in the context, with full attention and with
sliding windows: how far past its training length a model stays good, and how.

    python scripts/context_perplexity.py                      # the bundled demo model
    python scripts/context_perplexity.py --ctx 4096 --windows 4 --sliding 512 256

Runs Colibri at f32 on `--windows` stretches of `--ctx` tokens spread over the text (the
demo model's held-out plays by default), once per attention setting (the model folder's
config.json is copied and its `sliding_window` changed, nothing else), and prints the
perplexity of the tokens in each band of positions.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from colibri.engine.executor.model import Model  # noqa: E402
from colibri.engine.format.convert import convert, is_colibri_dir  # noqa: E402
from colibri.engine.format.modelcheck import check_model  # noqa: E402
from colibri.engine.text.tokenizer import Tokenizer  # noqa: E402
from colibri.engine.tools.evaluate import demo_validation_text  # noqa: E402

BANDS = (0, 128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)


def band_perplexities(folder: Path, ids: np.ndarray, ctx: int, windows: int,
                      threads: int) -> dict[str, float]:
    model = Model.load(folder, threads=threads, n_ctx=ctx)
    edges = [b for b in BANDS if b < ctx] + [ctx]
    sums = np.zeros(len(edges) - 1)
    counts = np.zeros(len(edges) - 1)
    for start in np.linspace(0, ids.size - ctx - 2, windows).astype(int):
        x, y = ids[start:start + ctx], ids[start + 1:start + ctx + 1]
        model.reset(0)
        logits = model.forward(x, np.zeros(ctx, np.int32), np.arange(ctx, dtype=np.int32))
        model.reset(0)
        lg = logits.astype(np.float64)
        top = lg.max(1)
        nll = np.log(np.exp(lg - top[:, None]).sum(1)) + top - lg[np.arange(ctx), y]
        for i in range(len(edges) - 1):
            sums[i] += nll[edges[i]:edges[i + 1]].sum()
            counts[i] += edges[i + 1] - edges[i]
    return {f"{edges[i]}-{edges[i + 1]}": math.exp(sums[i] / counts[i])
            for i in range(len(edges) - 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="Hugging Face or Colibri folder "
                   "(default: the bundled demo model)")
    p.add_argument("--text", default=None, help="UTF-8 text (default: the demo held-out plays)")
    p.add_argument("--ctx", type=int, default=4096, help="positions per stretch (default 4096)")
    p.add_argument("--windows", type=int, default=4, help="stretches of text (default 4)")
    p.add_argument("--sliding", type=int, nargs="*", default=[512, 256],
                   help="sliding windows to try besides full attention (default 512 256)")
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args()

    source = check_model(a.model)
    text = Path(a.text).read_text(encoding="utf-8") if a.text else demo_validation_text()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "f32"
        if is_colibri_dir(source):
            shutil.copytree(source, folder)
        else:
            convert(source, folder, quant="f32", progress=False)
        ids = np.asarray(Tokenizer.from_dir(folder).encode(text, add_special_tokens=False),
                         dtype=np.int32)
        if ids.size < a.ctx + 2:
            raise SystemExit(f"the text has {ids.size} tokens, fewer than --ctx {a.ctx}")
        base = json.loads((folder / "config.json").read_text())
        results = {}
        for window in [None, *a.sliding]:
            cfg = dict(base, sliding_window=window,
                       max_position_embeddings=max(a.ctx, base["max_position_embeddings"]))
            (folder / "config.json").write_text(json.dumps(cfg))
            name = "full attention" if window is None else f"sliding window {window}"
            results[name] = band_perplexities(folder, ids, a.ctx, a.windows, a.threads or 0)
    bands = list(next(iter(results.values())))
    print(f"{'positions':>18}" + "".join(f"{b:>11}" for b in bands))
    for name, row in results.items():
        print(f"{name:>18}" + "".join(f"{row[b]:>11.1f}" for b in bands))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

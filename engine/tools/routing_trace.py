"""Routing traces: which experts every token chose in every layer, as forward calls ran.

A trace is the input of `colibri replay` (engine.tools.replay), which plays it back against
expert cache policies. It keeps, per token, the n_expert_used expert ids of each layer, and
the forward chunks the tokens were computed in: the expert cache updates its heat and takes
experts once per chunk, so a replay has to see the same chunks. The core splits a forward
call into chunks of at most CORE_CHUNK_TOKENS tokens; `RouteRecorder` records the same split.

File format (.npz, numpy's zip of arrays): routes int32 [n_tokens, n_layer, k] (n_layer: the
layers with routed experts, in order; dense layers choose none and are left out); chunks int32
[n_chunks] tokens per chunk (summing to n_tokens); prefill bool [n_tokens] (token came from a
prompt rather than a decode step); n_expert, model and source as 0-d arrays.
"""

from __future__ import annotations

import argparse
import gzip
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

CORE_CHUNK_TOKENS = 512  # CLB_MAX_BATCH in csrc/clb_model_internal.h: tokens per core chunk
TRACE_VERSION = 1


@dataclass(frozen=True)
class RoutingTrace:
    """Expert choices of a run, in the order the tokens were computed."""

    routes: np.ndarray  # int32 [n_tokens, n_layer, k]; n_layer counts the layers with experts
    chunks: np.ndarray  # int32 [n_chunks], tokens per forward chunk
    prefill: np.ndarray  # bool [n_tokens]
    n_expert: int
    model: str = ""
    source: str = ""

    def __post_init__(self) -> None:
        r, c, p = self.routes, self.chunks, self.prefill
        if r.ndim != 3 or r.dtype != np.int32:
            raise ValueError(f"routes must be int32 [n_tokens, n_layer, k], got {r.dtype} "
                             f"{r.shape}")
        if c.ndim != 1 or (c.size and (c.min() < 1 or int(c.sum()) != r.shape[0])):
            raise ValueError(f"chunk sizes must be positive and sum to the {r.shape[0]} tokens")
        if p.shape != (r.shape[0],):
            raise ValueError(f"prefill flags: {p.shape} for {r.shape[0]} tokens")
        if self.n_expert < 1 or (r.size and (r.min() < 0 or r.max() >= self.n_expert)):
            raise ValueError(f"expert ids must be in 0..{self.n_expert - 1}")
        if r.size and np.any(np.diff(np.sort(r, axis=2), axis=2) == 0):
            raise ValueError("a token chose one expert twice in a layer")

    @property
    def n_tokens(self) -> int:
        return int(self.routes.shape[0])

    @property
    def n_layer(self) -> int:
        return int(self.routes.shape[1])

    @property
    def k(self) -> int:
        return int(self.routes.shape[2])

    def chunk_starts(self) -> np.ndarray:
        """First token of each chunk, int64 [n_chunks]."""
        return np.concatenate([[0], np.cumsum(self.chunks)[:-1]]).astype(np.int64)

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        with p.open("wb") as f:
            np.savez_compressed(f, version=np.int32(TRACE_VERSION), routes=self.routes,
                                chunks=self.chunks, prefill=self.prefill,
                                n_expert=np.int32(self.n_expert), model=np.str_(self.model),
                                source=np.str_(self.source))
        return p

    @classmethod
    def load(cls, path: str | Path) -> RoutingTrace:
        with np.load(Path(path), allow_pickle=False) as z:
            if int(z["version"]) != TRACE_VERSION:
                raise ValueError(f"{path}: routing trace version {int(z['version'])}, this "
                                 f"Colibri reads version {TRACE_VERSION}")
            return cls(routes=z["routes"].astype(np.int32, copy=False),
                       chunks=z["chunks"].astype(np.int32, copy=False),
                       prefill=z["prefill"].astype(bool, copy=False),
                       n_expert=int(z["n_expert"]), model=str(z["model"]),
                       source=str(z["source"]))


@dataclass
class RouteRecorder:
    """Runs Model.forward and keeps every token's routes, split into the core's chunks."""

    model: Any  # engine.executor.model.Model
    routes: list[np.ndarray] = field(default_factory=list)
    chunks: list[int] = field(default_factory=list)
    prefill: list[np.ndarray] = field(default_factory=list)

    def forward(self, tokens: np.ndarray, seq_ids: np.ndarray, positions: np.ndarray,
                want_logits: np.ndarray | None = None, prefill: bool = False) -> np.ndarray:
        """model.forward(...), recording the call's routes; returns its logits."""
        cfg = self.model.config
        n = int(np.asarray(tokens).size)
        r = np.zeros((n, cfg.n_layer, cfg.n_expert_used), np.int32)
        out = self.model.forward(tokens, seq_ids, positions, want_logits, routes=r)
        # the trace holds the layers with experts only (a dense layer chooses none)
        self.routes.append(r if len(cfg.moe_layers) == cfg.n_layer else r[:, cfg.moe_layers])
        self.prefill.append(np.full(n, prefill))
        for t0 in range(0, n, CORE_CHUNK_TOKENS):
            self.chunks.append(min(CORE_CHUNK_TOKENS, n - t0))
        return out

    def trace(self, source: str = "") -> RoutingTrace:
        cfg = self.model.config
        k = cfg.n_expert_used
        return RoutingTrace(
            routes=np.concatenate(self.routes) if self.routes
            else np.zeros((0, len(cfg.moe_layers), k), np.int32),
            chunks=np.asarray(self.chunks, np.int32),
            prefill=np.concatenate(self.prefill) if self.prefill else np.zeros(0, bool),
            n_expert=int(cfg.n_expert), model=str(self.model.path), source=source)


def greedy_run(rec: RouteRecorder, prompt: np.ndarray, n_gen: int, seq: int = 0,
               follow: np.ndarray | None = None) -> list[int]:
    """Prefill prompt in one call, then n_gen single-token decode calls, all recorded.

    Each decode call feeds the greedy choice of the one before, or, with follow (int32
    [n_gen]), follow[i] at step i: the text's own next tokens (teacher forcing). Sequence
    slot seq is cleared before and after; returns the n_gen greedy choices.
    """
    model = rec.model
    n = int(prompt.size)
    if follow is not None and follow.size < n_gen:
        raise ValueError(f"{follow.size} tokens to follow for {n_gen} decode steps")
    want = np.zeros(n, np.uint8)
    want[-1] = 1
    seq_ids = np.full(1, seq, np.int32)
    model.reset(seq)
    try:
        logits = rec.forward(prompt, np.full(n, seq, np.int32), np.arange(n, dtype=np.int32),
                             want, prefill=True)
        out = [int(np.argmax(logits[-1]))]
        for step in range(n_gen):
            fed = out[-1] if follow is None else int(follow[step])
            logits = rec.forward(np.asarray([fed], np.int32), seq_ids,
                                 np.asarray([n + step], np.int32))
            out.append(int(np.argmax(logits[0])))
    finally:
        model.reset(seq)
    return out[:n_gen]


def text_segments(ids: list[int] | np.ndarray, prompt_tokens: int, gen_tokens: int,
                  max_tokens: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(prompt, continuation) pieces of a text, consecutive and disjoint: prompt_tokens
    tokens and the gen_tokens after them, as many as fit in max_tokens (at least one, if the
    text holds one)."""
    a = np.asarray(ids, np.int32)
    per = prompt_tokens + gen_tokens
    for i in range(max(1, max_tokens // per)):
        piece = a[i * per:(i + 1) * per]
        if piece.size < per:
            return
        yield piece[:prompt_tokens], piece[prompt_tokens:]


def read_trace_text(spec: str) -> str:
    """The text to trace: "demo" for the demo model's held-out plays, else a UTF-8 file."""
    if spec == "demo":
        from colibri.engine.tools.evaluate import demo_validation_text

        return demo_validation_text()
    p = Path(spec)
    raw = p.read_bytes()
    return (gzip.decompress(raw) if p.suffix == ".gz" else raw).decode("utf-8")


def trace_text(model: Any, text: str, prompt_tokens: int, gen_tokens: int,
               max_tokens: int, follow: bool = False) -> RoutingTrace:
    """Trace a text: consecutive pieces of prompt_tokens + gen_tokens tokens of it, each
    prompt prefilled as a fresh sequence and followed by gen_tokens decode steps (greedy, or
    with follow the piece's own next tokens), until about max_tokens tokens are traced.
    Raises ValueError when the text is shorter than one piece."""
    from colibri.engine.text.tokenizer import Tokenizer

    if prompt_tokens < 1 or gen_tokens < 0 or max_tokens < 1:
        raise ValueError("trace lengths must be positive")
    ids = Tokenizer.from_dir(model.path).encode(text, add_special_tokens=False)
    if len(ids) < prompt_tokens + gen_tokens:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one piece of "
                         f"{prompt_tokens} + {gen_tokens}")
    rec = RouteRecorder(model)
    for prompt, rest in text_segments(ids, prompt_tokens, gen_tokens, max_tokens):
        greedy_run(rec, prompt, gen_tokens, follow=rest if follow else None)
    how = "fed the text's next tokens" if follow else "greedy"
    return rec.trace(source=f"text: {prompt_tokens}-token prompts + {gen_tokens} decode steps "
                            f"({how})")


# -- `colibri bench --routing-trace` ---------------------------------------------------------

DEFAULT_TRACE_TOKENS = 4096


def add_trace_args(p: argparse.ArgumentParser) -> None:
    """The routing trace options of `colibri bench`."""
    p.add_argument("--routing-trace", metavar="FILE", default=None,
                   help="also run the workload once more, untimed, and write which experts "
                        "every token chose in every layer (prefill and decode) to FILE (.npz), "
                        "for `colibri replay`")
    p.add_argument("--trace-text", metavar="FILE", default=None,
                   help="with --routing-trace: trace a text instead of the random prompt, "
                        "whose tokens route unlike real text. FILE is UTF-8 (.gz allowed), or "
                        "'demo' for the demo model's held-out plays. The text is cut into "
                        "consecutive pieces of --prompt-tokens + --gen-tokens tokens; each "
                        "prompt is prefilled as a fresh sequence and followed by --gen-tokens "
                        "greedy decode steps, until --trace-tokens tokens are traced")
    p.add_argument("--trace-follow", action="store_true",
                   help="with --trace-text: each decode step feeds the text's next token "
                        "instead of the greedy choice, so decode routes real text even where "
                        "the model's own output would repeat itself")
    p.add_argument("--trace-tokens", type=int, default=DEFAULT_TRACE_TOKENS,
                   help=f"with --trace-text: at most how many tokens to trace (default "
                        f"{DEFAULT_TRACE_TOKENS})")


def check_trace_args(args: argparse.Namespace) -> None:
    """Refuse trace options that cannot work, before anything is measured."""
    if args.routing_trace is None:
        if args.trace_text is not None:
            raise ValueError("--trace-text needs --routing-trace FILE")
        return
    if args.trace_follow and args.trace_text is None:
        raise ValueError("--trace-follow needs --trace-text")
    out = Path(args.routing_trace)
    if not out.parent.is_dir():
        raise ValueError(f"--routing-trace: folder {out.parent} does not exist")
    if args.trace_text not in (None, "demo") and not Path(args.trace_text).is_file():
        raise ValueError(f"--trace-text: {args.trace_text} is not a file")
    if args.trace_tokens < 1:
        raise ValueError("--trace-tokens must be positive")


def record_bench_trace(args: argparse.Namespace, model_dir: str | Path,
                       prompt_of: Callable[[int], np.ndarray]) -> RoutingTrace:
    """The trace `colibri bench --routing-trace` writes: bench's workload (prompt_of(n_vocab)
    prefilled, --gen-tokens greedy steps) or, with --trace-text, that text."""
    from colibri.engine.executor.model import Model
    from colibri.engine.tools.cache_args import threads_from_args

    n_ctx = args.prompt_tokens + args.gen_tokens
    model = Model.load(model_dir, threads=threads_from_args(args), n_ctx=n_ctx)
    if args.trace_text is not None:
        tr = trace_text(model, read_trace_text(args.trace_text), args.prompt_tokens,
                        args.gen_tokens, args.trace_tokens, follow=args.trace_follow)
        tr = RoutingTrace(tr.routes, tr.chunks, tr.prefill, tr.n_expert, tr.model,
                          f"{args.trace_text} {tr.source}")
    else:
        rec = RouteRecorder(model)
        greedy_run(rec, prompt_of(model.n_vocab), args.gen_tokens)
        tr = rec.trace(source=f"bench: {args.prompt_tokens} random prompt tokens + "
                              f"{args.gen_tokens} decode steps (greedy)")
    tr.save(args.routing_trace)
    return tr

"""Sampling parameters and the token sampler (numpy, one sequence at a time).

Order of operations: logit_bias -> repetition penalty (HF style, over prompt + generated) ->
presence/frequency penalties (OpenAI style, over generated tokens only) -> greedy argmax when
temperature < GREEDY_TEMPERATURE (0 included), else temperature -> top_k -> top_p -> min_p ->
draw. Logprobs are the log-softmax of the logits after bias and penalties, before temperature
and filtering: they describe the model's (adjusted) distribution, not the truncated one that
was sampled from, so they are comparable across temperatures and finite for every token. A request's
`constraint` (engine.sample.constraints) is applied by the batched sampler (engine.sample.batch) to
the adjusted logits before anything else looks at them: disallowed tokens get -inf, so the
logprobs reported are those of the masked distribution (tokens the grammar forbids have none
and never appear among the top logprobs); the engine calls its accept() after each token.
Guarantees: the same seed and logits give the same tokens; no Python loop over the vocabulary;
penalty counts are kept incrementally. Refuses: parameters outside the documented ranges.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from colibri.engine.errors import TokenIdError, check_token_ids

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 512
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0
# Below this a repetition penalty divides positive logits by more than 100: float32 logits
# would overflow to inf for large values, so such penalties are refused, not clamped.
MIN_REPETITION_PENALTY = 0.01
# Temperatures this small are greedy: dividing logits by a subnormal temperature overflows
# (every logit becomes inf and the draw degenerates to one fixed token), and anything below
# it is already indistinguishable from argmax for real logit gaps.
GREEDY_TEMPERATURE = 1e-5
# top_p first looks for the nucleus among this many best tokens, widening the set (x16) only
# when their mass falls short of top_p.
_TOP_P_CANDIDATES = 1024


class SamplingParamError(ValueError):
    """A sampling parameter is out of range; `param` is the request field's name."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message


@dataclass
class SamplingParams:
    """What the client asked for. `validate(vocab_size)` before use."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None  # None: none; k >= 0: chosen token's logprob plus top k
    # A compiled per-request constraint (engine.sample.constraints.Constraint) or None: apply()
    # masks each step's logits, accept() follows every sampled token.
    constraint: Any = None
    # None: none; k >= 0: each prompt token's logprob plus the top k (max_tokens may be 0)
    prompt_logprobs: int | None = None
    # False: the text keeps special tokens' text (reasoning and tool-call markers that some
    # vocabularies mark special); end-of-sequence and stop tokens never reach the text
    skip_special_tokens: bool = True

    def validate(self, vocab_size: int) -> None:
        """Raise SamplingParamError naming the first field that is out of range."""
        if self.max_tokens is not None:
            _int(self.max_tokens, "max_tokens")
            if self.max_tokens < (0 if self.prompt_logprobs is not None else 1):
                raise SamplingParamError("max_tokens", "must be at least 1")
        _real_in(self.temperature, "temperature", 0.0, 2.0)
        _real(self.top_p, "top_p")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamError("top_p", "must be in (0, 1]")
        _int(self.top_k, "top_k")
        if self.top_k < -1:
            raise SamplingParamError("top_k", "must be -1 (disabled), 0 (disabled) or positive")
        _real_in(self.min_p, "min_p", 0.0, 1.0)
        _real_in(self.presence_penalty, "presence_penalty", -2.0, 2.0)
        _real_in(self.frequency_penalty, "frequency_penalty", -2.0, 2.0)
        _real(self.repetition_penalty, "repetition_penalty")
        if not self.repetition_penalty >= MIN_REPETITION_PENALTY:
            raise SamplingParamError(
                "repetition_penalty", f"must be at least {MIN_REPETITION_PENALTY:g}")
        if not isinstance(self.stop, (list, tuple)):
            raise SamplingParamError("stop", "must be a list of strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise SamplingParamError("stop", f"at most {MAX_STOP_STRINGS} stop strings")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise SamplingParamError("stop", "stop strings must be non-empty strings")
            if len(s) > MAX_STOP_CHARS:
                raise SamplingParamError("stop", f"stop strings are at most {MAX_STOP_CHARS} chars")
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise SamplingParamError("stop_token_ids", "must be a list of token ids")
        for t in self.stop_token_ids:
            _token_id(t, "stop_token_ids", vocab_size)
        if not isinstance(self.ignore_eos, bool):
            raise SamplingParamError("ignore_eos", "must be a boolean")
        if self.seed is not None:
            _int(self.seed, "seed")
        if not isinstance(self.logit_bias, dict):
            raise SamplingParamError("logit_bias", "must be a map of token id to bias")
        for t, b in self.logit_bias.items():
            _token_id(t, "logit_bias", vocab_size)
            _real_in(b, "logit_bias", -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
        if self.logprobs is not None:
            _int(self.logprobs, "logprobs")
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise SamplingParamError("logprobs", f"must be in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None:
            _int(self.prompt_logprobs, "prompt_logprobs")
            if not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
                raise SamplingParamError("prompt_logprobs", f"must be in [0, {MAX_LOGPROBS}]")
        if not isinstance(self.skip_special_tokens, bool):
            raise SamplingParamError("skip_special_tokens", "must be a boolean")
        if self.constraint is not None and not callable(getattr(self.constraint, "apply", None)):
            raise SamplingParamError("constraint", "must be a compiled constraint")


def _real(x: Any, name: str) -> None:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        raise SamplingParamError(name, "must be a finite number")


def _real_in(x: Any, name: str, lo: float, hi: float) -> None:
    _real(x, name)
    if not lo <= x <= hi:
        raise SamplingParamError(name, f"must be in [{lo:g}, {hi:g}]")


def _int(x: Any, name: str) -> None:
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
        raise SamplingParamError(name, "must be an integer")


def _token_id(t: Any, name: str, vocab_size: int) -> None:
    _int(t, name)
    try:
        check_token_ids([t], vocab_size, name)
    except TokenIdError as exc:
        raise SamplingParamError(name, str(exc)) from None


@dataclass
class SampleResult:
    """One sampled token; its logprob and top_logprobs are None unless logprobs were
    requested (SamplingParams.logprobs not None)."""

    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


def _log_softmax(x: np.ndarray, m: float) -> np.ndarray:
    """float64 log-softmax of x, whose maximum m the caller found finite."""
    shifted = x.astype(np.float64) - np.float64(m)
    return shifted - np.log(np.sum(np.exp(shifted)))


def _top_indices(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values, best first, ties broken by the lower id."""
    n = x.shape[0]
    if k >= n:
        return np.argsort(-x, kind="stable")
    kth = np.partition(x, n - k)[n - k]
    above = np.flatnonzero(x > kth)
    equal = np.flatnonzero(x == kth)[: k - above.shape[0]]
    idx = np.sort(np.concatenate([above, equal]))
    return idx[np.argsort(-x[idx], kind="stable")]


class Sampler:
    """Samples the tokens of one sequence; keeps penalty counts between calls.

    The first call's `history` is the prompt (or pass `n_prompt` when the first history also
    holds generated tokens, e.g. after a recompute); later calls pass the same list grown by
    the generated tokens, and only the new tail is read.
    """

    def __init__(
        self, params: SamplingParams, vocab_size: int, *, n_prompt: int | None = None
    ) -> None:
        self.params = params
        self.vocab_size = int(vocab_size)
        self._n_prompt = n_prompt
        self._n_seen = 0
        # numpy wants a non-negative seed; OpenAI clients may send any integer.
        seed = None if params.seed is None else int(params.seed) % (1 << 64)
        self._rng = np.random.default_rng(seed)
        p = params
        self._use_rep = p.repetition_penalty != 1.0
        self._use_pf = p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
        self._seen = np.zeros(self.vocab_size, dtype=bool) if self._use_rep else None
        self._counts = np.zeros(self.vocab_size, dtype=np.int32) if self._use_pf else None
        if p.logit_bias:
            self._bias_ids = np.fromiter((int(k) for k in p.logit_bias), dtype=np.int64)
            self._bias_vals = np.fromiter((float(v) for v in p.logit_bias.values()), np.float32)
        else:
            self._bias_ids = None
        self._top_k = p.top_k if p.top_k > 0 else 0

    def _ingest(self, history: Any) -> None:
        n = len(history)
        if n < self._n_seen:
            raise ValueError("history is shorter than in the previous call")
        if n == self._n_seen:
            return
        new = np.asarray(history[self._n_seen:], dtype=np.int64)
        if new.size and (new.min() < 0 or new.max() >= self.vocab_size):
            raise ValueError("history has token ids outside the vocabulary")
        if self._n_prompt is None:
            self._n_prompt = n  # first call: everything so far is prompt
        if self._seen is not None:
            self._seen[new] = True
        if self._counts is not None:
            gen = new[max(0, self._n_prompt - self._n_seen):]
            if gen.size:
                self._counts += np.bincount(gen, minlength=self.vocab_size).astype(np.int32)
        self._n_seen = n

    def adjusted_logits(self, logits: np.ndarray, history: Any) -> np.ndarray:
        """Logits after logit_bias and penalties (float32 copy); updates the counts."""
        x = np.asarray(logits)
        if x.shape != (self.vocab_size,):
            raise ValueError(f"logits shape {x.shape} != ({self.vocab_size},)")
        x = x.astype(np.float32, copy=True)
        if np.isnan(x).any():
            raise ValueError("logits contain NaN")
        self._ingest(history)
        p = self.params
        if self._bias_ids is not None:
            x[self._bias_ids] += self._bias_vals
        if self._seen is not None:
            s = x[self._seen]
            x[self._seen] = np.where(
                s > 0, s / np.float32(p.repetition_penalty), s * np.float32(p.repetition_penalty)
            )
        if self._counts is not None:
            x -= np.float32(p.frequency_penalty) * self._counts.astype(np.float32)
            x -= np.float32(p.presence_penalty) * (self._counts > 0).astype(np.float32)
        return x

    def sample(self, logits: np.ndarray, history: Any) -> SampleResult:
        """Choose the next token from logits [vocab] given prompt + generated ids so far."""
        return self.pick(self.adjusted_logits(logits, history), self._draw)

    def pick(self, x: np.ndarray, draw: Callable[[np.ndarray], int]) -> SampleResult:
        """The token of adjusted logits x (masked by a constraint, if any): the argmax for
        greedy parameters, else draw(x); with the logprobs the parameters ask for. One place
        for what a plain draw and the speculative rule (engine.sample.verify) share."""
        p = self.params
        m = np.max(x)
        if not np.isfinite(m):
            raise ValueError("logits have no finite maximum")
        if p.temperature < GREEDY_TEMPERATURE:
            token = int(np.argmax(x))  # first maximum: ties go to the lowest id
        else:
            token = draw(x)
        if p.logprobs is None:
            return SampleResult(token)
        logp = _log_softmax(x, m)
        k = min(p.logprobs, self.vocab_size)
        idx = _top_indices(logp, k) if k > 0 else np.empty(0, dtype=np.int64)
        top = [(int(i), float(logp[i])) for i in idx]
        return SampleResult(token, float(logp[token]), top)

    def candidates(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The distribution a draw from adjusted logits x samples (temperature > 0): the
        candidate ids after top_k, top_p and min_p, and their unnormalised weights."""
        p = self.params
        # shift before dividing: the largest z is 0 and none can overflow
        x64 = x.astype(np.float64)
        z = (x64 - np.max(x64)) / p.temperature
        if self._top_k and self._top_k < z.shape[0]:
            cand = _top_indices(z, self._top_k)  # best first
        else:
            cand = None
        if p.top_p < 1.0:
            cand = self._nucleus(z, cand)
        if cand is None:
            cand = np.arange(z.shape[0])
        zc = z[cand]
        probs = np.exp(zc - np.max(zc))
        if p.min_p > 0.0:
            keep = probs >= p.min_p * np.max(probs)  # max of probs is 1 after the shift
            cand, probs = cand[keep], probs[keep]
        return cand, probs

    def coin(self, p: float) -> bool:
        """True with probability p, from this sequence's generator."""
        return bool(self._rng.random() < p)

    def draw_from(self, cand: np.ndarray, weights: np.ndarray) -> int:
        """One draw from this sequence's generator over cand with weights (not all zero)."""
        cdf = np.cumsum(weights)
        u = self._rng.random() * cdf[-1]
        i = int(np.searchsorted(cdf, u, side="right"))
        return int(cand[min(i, cand.shape[0] - 1)])

    def _draw(self, x: np.ndarray) -> int:
        return self.draw_from(*self.candidates(x))

    def _nucleus(self, z: np.ndarray, cand: np.ndarray | None) -> np.ndarray:
        """Smallest best-first set whose probability reaches top_p (the crossing token kept)."""
        top_p = self.params.top_p
        if cand is None:
            m = np.max(z)
            total = np.sum(np.exp(z - m))
            # Widen the candidate set until it holds top_p of the mass; real logits rarely
            # need more than the first step, a flat distribution ends in a full sort.
            k = _TOP_P_CANDIDATES
            while True:
                k = min(k, z.shape[0])
                best = _top_indices(z, k)
                if k == z.shape[0] or np.sum(np.exp(z[best] - m)) / total >= top_p:
                    break
                k *= 16
        else:
            best = cand
            m = np.max(z[best])
            total = np.sum(np.exp(z[best] - m))
        probs = np.exp(z[best] - m) / total
        before = np.cumsum(probs) - probs  # mass of the strictly better tokens
        n_keep = max(1, int(np.count_nonzero(before < top_p)))
        return best[:n_keep]

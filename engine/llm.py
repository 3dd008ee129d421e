"""The engine's Python API: load a model, score tokens, generate text.

`LLM` ties the C forward pass (engine.model), the tokenizer, the sampler, incremental
detokenization and stop strings together. It is not thread-safe: callers that serve several
clients (the HTTP server) run every call on one engine thread.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from engine.convert import ensure_converted
from engine.detok import IncrementalDetokenizer, StopStringMatcher
from engine.model import Model
from engine.sampling import Sampler, SamplingParams
from engine.scoring import PromptLogprobs, prompt_logprobs
from engine.tokenizer import Tokenizer

DEFAULT_N_CTX = 4096


class ContextLengthError(ValueError):
    """The prompt (plus the requested completion) does not fit the model's context."""

    def __init__(self, message: str, n_prompt: int, n_ctx: int) -> None:
        super().__init__(message)
        self.n_prompt = n_prompt
        self.n_ctx = n_ctx


@dataclass
class StepOutput:
    """One sampled token and the text it lets the caller emit."""

    token_id: int
    text: str
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None
    # on the first output only, when params.prompt_logprobs is set (engine.scoring); with
    # max_tokens 0 that output has token_id -1, no text and finish_reason "length"
    prompt_logprobs: PromptLogprobs | None = None


@dataclass
class _Budget:
    max_new: int
    stop_ids: set[int] = field(default_factory=set)


def _drain(detok: IncrementalDetokenizer, stops: StopStringMatcher) -> tuple[str, bool]:
    """Text still held back by the detokenizer and the stop matcher, at the end of output."""
    emit, stopped = stops.push(detok.flush())
    if stopped:
        return emit, True
    return emit + stops.flush(), False


def default_model_path() -> Path:
    """The bundled demo model (a Hugging Face folder shipped inside the package)."""
    return Path(__file__).resolve().parent / "demo_model"


class LLM:
    """A loaded model with its tokenizer.

    path: a Colibri folder, or a Hugging Face folder converted once into a cache
    (precision `quant`); None serves the bundled demo model.
    """

    def __init__(
        self,
        path: str | Path | None = None,
        threads: int | None = None,
        n_ctx: int | None = None,
        quant: str = "q8",
    ) -> None:
        source = Path(path) if path is not None else default_model_path()
        if not source.exists():
            raise FileNotFoundError(f"model folder not found: {source}")
        self.path = ensure_converted(source, quant, progress=True)  # first use converts: show it
        self.model = Model.load(self.path, threads=threads, n_ctx=n_ctx, n_seq=1)
        self.tokenizer = Tokenizer.from_dir(self.path)
        self.n_ctx: int = self.model.n_ctx
        self.vocab_size: int = self.model.n_vocab
        self.model_name: str = source.name
        self._lock = threading.Lock()

    # -- scoring -----------------------------------------------------------------------
    def logits(self, token_ids: list[int] | np.ndarray) -> np.ndarray:
        """Logits [len(token_ids), vocab] (float32) of a fresh sequence."""
        ids = np.asarray(token_ids, dtype=np.int32).reshape(-1)
        if ids.size == 0:
            raise ValueError("token_ids is empty")
        if ids.size > self.n_ctx:
            raise ContextLengthError(
                f"{ids.size} tokens exceed the context of {self.n_ctx}", int(ids.size), self.n_ctx
            )
        with self._lock:
            self.model.reset(0)
            out = self.model.forward(ids, np.zeros_like(ids), np.arange(ids.size, dtype=np.int32))
            self.model.reset(0)
        return out

    # -- generation --------------------------------------------------------------------
    def _budget(self, n_prompt: int, params: SamplingParams) -> _Budget:
        if n_prompt == 0:
            raise ValueError("the prompt is empty")
        room = self.n_ctx - n_prompt
        if params.max_tokens == 0 and room >= 0:
            return _Budget(max_new=0)  # prompt scoring only (prompt_logprobs)
        if room <= 0:
            raise ContextLengthError(
                f"the prompt has {n_prompt} tokens, the context holds {self.n_ctx}",
                n_prompt,
                self.n_ctx,
            )
        max_new = room if params.max_tokens is None else params.max_tokens
        if max_new > room:
            raise ContextLengthError(
                f"the prompt ({n_prompt} tokens) plus max_tokens ({max_new}) exceed the "
                f"context of {self.n_ctx} tokens",
                n_prompt,
                self.n_ctx,
            )
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= set(self.tokenizer.eos_token_ids)
        return _Budget(max_new=max_new, stop_ids=stop_ids)

    def generate_tokens(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        abort: threading.Event | None = None,
    ) -> Iterator[StepOutput]:
        """Sample tokens after prompt_ids; the last output carries finish_reason."""
        params.validate(self.vocab_size)
        prompt = [int(t) for t in prompt_ids]
        for t in prompt:
            if not 0 <= t < self.vocab_size:
                raise ValueError(
                    f"token id {t} is outside the vocabulary (0..{self.vocab_size - 1})"
                )
        budget = self._budget(len(prompt), params)
        return self._generate(prompt, params, budget, abort)

    def _generate(
        self,
        prompt: list[int],
        params: SamplingParams,
        budget: _Budget,
        abort: threading.Event | None,
    ) -> Iterator[StepOutput]:
        sampler = Sampler(params, self.vocab_size)
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids=prompt)
        stops = StopStringMatcher(list(params.stop))
        history = list(prompt)
        with self._lock:
            self.model.reset(0)
            try:
                ids = np.asarray(prompt, dtype=np.int32)
                want = np.zeros(ids.size, dtype=np.uint8)
                want[-1] = 1
                if params.prompt_logprobs is not None:
                    want[:] = 1
                rows = self.model.forward(
                    ids, np.zeros_like(ids), np.arange(ids.size, dtype=np.int32), want
                )
                logits = rows[-1].copy() if rows.shape[0] > 1 else rows[-1]
                plp = None
                if params.prompt_logprobs is not None:
                    plp = prompt_logprobs(rows, prompt, params.prompt_logprobs)
                del rows
                if budget.max_new == 0:
                    yield StepOutput(-1, "", finish_reason="length", prompt_logprobs=plp)
                    return
                constraint = params.constraint
                for step in range(budget.max_new):
                    if abort is not None and abort.is_set():
                        yield StepOutput(token_id=-1, text="", finish_reason="abort")
                        return
                    res = sampler.sample(logits, history)
                    tok = res.token_id
                    history.append(tok)
                    finish = None
                    if tok in budget.stop_ids:
                        text, finish = _drain(detok, stops)[0], "stop"
                    else:
                        text, stopped = stops.push(detok.push(tok))
                        if stopped:
                            finish = "stop"
                        elif constraint is not None and constraint.is_finished():
                            tail, _ = _drain(detok, stops)  # the grammar is complete
                            text, finish = text + tail, "stop"
                        elif step == budget.max_new - 1:
                            tail, stopped = _drain(detok, stops)
                            text, finish = text + tail, "stop" if stopped else "length"
                    yield StepOutput(tok, text, res.logprob, res.top_logprobs, finish, plp)
                    plp = None
                    if finish is not None:
                        return
                    pos = len(history) - 1
                    logits = self.model.forward(
                        np.asarray([tok], dtype=np.int32),
                        np.zeros(1, dtype=np.int32),
                        np.asarray([pos], dtype=np.int32),
                    )[0]
            finally:
                self.model.reset(0)

    def _params(self, **kw: object) -> SamplingParams:
        stop = kw.pop("stop", None)
        if isinstance(stop, str):
            stop = [stop]
        params = SamplingParams(**kw)  # type: ignore[arg-type]
        return replace(params, stop=list(stop or []))

    def _encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return [int(t) for t in prompt]

    def stream(
        self,
        prompt: str | list[int],
        max_tokens: int | None = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: str | list[str] | None = None,
        **kw: object,
    ) -> Iterator[str]:
        """Yield text pieces as tokens are sampled."""
        params = self._params(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, stop=stop, **kw
        )
        for out in self.generate_tokens(self._encode_prompt(prompt), params):
            if out.text:
                yield out.text

    def generate(
        self,
        prompt: str | list[int],
        max_tokens: int | None = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: str | list[str] | None = None,
        **kw: object,
    ) -> str:
        """The completion of prompt as one string."""
        return "".join(
            self.stream(prompt, max_tokens, temperature, top_p, seed, stop, **kw)
        )

    def generate_ids(self, prompt_ids: list[int], max_tokens: int, **kw: object) -> list[int]:
        """Token ids of a completion (greedy unless temperature is given); stops at EOS."""
        params = self._params(max_tokens=max_tokens, temperature=kw.pop("temperature", 0.0), **kw)
        return [o.token_id for o in self.generate_tokens(prompt_ids, params) if o.token_id >= 0]

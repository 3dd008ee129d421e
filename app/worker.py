"""The engine thread: the only thread that touches the model, fed by a bounded queue.

The event loop submits a Job (one HTTP request: one or more sequences to generate in turn)
and reads its outputs from an asyncio.Queue that the engine thread fills through
loop.call_soon_threadsafe; the loop itself never waits on the engine. A job leaves through
`cancel()` (client gone, request cancelled): a waiting job is dropped at once, a running one
stops within one token (the engine and this loop both check its abort Event), and the
engine's generator is closed so its state is freed. Refuses work beyond `max_queue`.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from app.metrics import Metrics
from engine import LLM, SamplingParams, StepOutput

log = logging.getLogger("colibri.app")

WAITING, RUNNING, CANCELLED, DONE = "waiting", "running", "cancelled", "done"


class QueueFullError(Exception):
    """The bounded queue is full: the client should retry later (503 + Retry-After)."""


class EngineUnavailableError(Exception):
    """The model is not loaded (yet), failed, or the server is stopping."""


@dataclass
class Sequence:
    """One sequence to generate: a choice of a request."""

    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class TokenInfo:
    """Text forms of a token, for logprobs (computed on the engine thread)."""

    text: str
    bytes: list[int]


@dataclass
class PromptToken:
    """A prompt token with its logprob (None for the first) and the top alternatives."""

    token: TokenInfo
    logprob: float | None
    top: list[tuple[TokenInfo, float]]


@dataclass
class Output:
    """One engine step of one sequence, as the event loop receives it."""

    index: int
    step: StepOutput
    token: TokenInfo | None = None
    top: list[tuple[TokenInfo, float]] | None = None
    prompt: list[PromptToken] | None = None  # on the first output, with prompt logprobs


@dataclass(eq=False)  # identity semantics: jobs live in a set
class Job:
    """One request's work and its output channel."""

    sequences: list[Sequence]
    want_token_text: bool
    loop: asyncio.AbstractEventLoop
    arrival: float = field(default_factory=time.perf_counter)
    abort: threading.Event = field(default_factory=threading.Event)
    out: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    state: str = WAITING
    ended: bool = False  # the consumer saw the end (or the error): nothing to abort


_DONE = object()


class EngineWorker:
    """Owns the LLM and the thread that runs it."""

    def __init__(
        self,
        loader: Callable[[], LLM],
        max_queue: int,
        metrics: Metrics,
        on_fatal: Callable[[BaseException], None] | None = None,
    ) -> None:
        self._loader = loader
        self._max_queue = max_queue
        self._metrics = metrics
        self._on_fatal = on_fatal
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._live: set[Job] = set()
        self._thread = threading.Thread(target=self._run, name="colibri-engine", daemon=True)
        self._token_cache: dict[int, TokenInfo] = {}
        self.n_waiting = 0
        self.n_running = 0
        self.llm: LLM | None = None
        self.loaded = threading.Event()
        self.error: BaseException | None = None
        self.stopping = False

    # -- lifecycle (event loop side) -----------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; it loads the model first."""
        self._thread.start()

    @property
    def ready(self) -> bool:
        return self.loaded.is_set() and self.error is None and not self.stopping

    def stop(self, timeout: float) -> None:
        """Abort whatever is left and join the engine thread (blocking; call off the loop)."""
        with self._lock:
            self.stopping = True
            live = list(self._live)
        for job in live:
            job.abort.set()
        self._jobs.put(None)
        self._thread.join(timeout)

    # -- requests (event loop side) ------------------------------------------------------
    def submit(self, sequences: list[Sequence], want_token_text: bool = False) -> Job:
        """Queue a job; raises QueueFullError or EngineUnavailableError."""
        if not self.ready:
            raise EngineUnavailableError("the model is not ready")
        job = Job(sequences, want_token_text, asyncio.get_running_loop())
        with self._lock:
            if self.n_waiting + self.n_running >= 1 + self._max_queue:
                raise QueueFullError("the request queue is full")
            self.n_waiting += 1
            self._live.add(job)
            self._metrics.set_queue(self.n_waiting, self.n_running)
        self._jobs.put(job)
        return job

    async def outputs(self, job: Job) -> AsyncIterator[Output]:
        """The job's outputs in order; raises what the engine raised. Cancels on exit."""
        try:
            while True:
                item = await job.out.get()
                if item is _DONE:
                    job.ended = True
                    return
                if isinstance(item, BaseException):
                    job.ended = True
                    raise item
                yield item
        finally:
            self.cancel(job)

    def cancel(self, job: Job) -> None:
        """Stop the job: drop it if waiting, abort it (within one token) if running."""
        if job.ended:
            return
        job.abort.set()
        with self._lock:
            if job.state == WAITING:
                job.state = CANCELLED
                self.n_waiting -= 1
                self._live.discard(job)
                self._metrics.add_aborted()
            elif job.state == RUNNING:
                self._metrics.add_aborted()
            self._metrics.set_queue(self.n_waiting, self.n_running)

    # -- engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.llm = self._loader()
        except BaseException as exc:  # noqa: BLE001 - reported, then the server exits
            log.error("could not load the model: %s", exc, exc_info=exc)
            self.error = exc
            if self._on_fatal is not None:
                self._on_fatal(exc)
            return
        self.loaded.set()
        self._metrics.model_loaded = 1
        log.info("model %s loaded (context %d tokens)", self.llm.model_name, self.llm.n_ctx)
        try:
            while True:
                job = self._jobs.get()
                if job is None:
                    return
                self._execute(job)
        except BaseException as exc:  # noqa: BLE001 - a bug in this loop: fail loudly
            log.critical("engine thread died: %s", exc, exc_info=exc)
            self.error = exc
            self._metrics.model_loaded = 0
            if self._on_fatal is not None:
                self._on_fatal(exc)

    def _post(self, job: Job, item: Any) -> None:
        try:
            job.loop.call_soon_threadsafe(job.out.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            job.abort.set()

    def _execute(self, job: Job) -> None:
        with self._lock:
            if job.state != WAITING:
                return
            job.state = RUNNING
            self.n_waiting -= 1
            self.n_running += 1
            self._metrics.set_queue(self.n_waiting, self.n_running)
        try:
            self._generate(job)
        except Exception as exc:  # noqa: BLE001 - this request fails, the server goes on
            self._post(job, exc)
        finally:
            with self._lock:
                job.state = DONE
                self.n_running -= 1
                self._live.discard(job)
                self._metrics.set_queue(self.n_waiting, self.n_running)
            self._metrics.add_e2e(time.perf_counter() - job.arrival)
            self._post(job, _DONE)

    def _generate(self, job: Job) -> None:
        assert self.llm is not None
        first = True
        for index, seq in enumerate(job.sequences):
            if job.abort.is_set():
                return
            self._metrics.add_prompt_tokens(len(seq.prompt_ids))
            steps = self.llm.generate_tokens(seq.prompt_ids, seq.params, job.abort)
            last = None
            try:
                for step in steps:
                    if step.finish_reason == "abort":
                        return
                    if step.token_id < 0 and step.prompt_logprobs is None:
                        return
                    now = time.perf_counter()
                    if step.token_id >= 0:
                        self._metrics.add_token(
                            None if last is None else now - last,
                            now - job.arrival if first else None,
                        )
                        first = False
                        last = now
                    self._post(job, self._output(job, index, step, seq.prompt_ids))
                    if step.finish_reason is not None or job.abort.is_set():
                        break
            finally:
                close = getattr(steps, "close", None)
                if close is not None:
                    close()  # frees the sequence's state now, not at garbage collection

    def _output(self, job: Job, index: int, step: StepOutput, prompt_ids: list[int]) -> Output:
        if not job.want_token_text:
            return Output(index, step)
        top = None
        if step.top_logprobs is not None:
            top = [(self._token_info(t), lp) for t, lp in step.top_logprobs]
        prompt = None
        if step.prompt_logprobs is not None:
            prompt = [PromptToken(self._token_info(t), None if e is None else e[0],
                                  [] if e is None else
                                  [(self._token_info(a), lp) for a, lp in e[1]])
                      for t, e in zip(prompt_ids, step.prompt_logprobs, strict=True)]
        token = self._token_info(step.token_id) if step.token_id >= 0 else None
        return Output(index, step, token, top, prompt)

    def _token_info(self, token_id: int) -> TokenInfo:
        info = self._token_cache.get(token_id)
        if info is None:
            assert self.llm is not None
            tok = self.llm.tokenizer
            text = tok.decode([token_id], skip_special_tokens=False)
            raw = _byte_level_bytes(tok.id_to_piece(token_id))
            info = TokenInfo(text, list(raw if raw is not None else text.encode("utf-8")))
            if len(self._token_cache) < 1 << 18:
                self._token_cache[token_id] = info
        return info


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-ins for the 256 byte values (char -> byte).

    Printable Latin-1 bytes stand for themselves; the others are shifted to U+0100 and up,
    in byte order. This is how GPT-2-style vocabularies spell raw bytes.
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            table[chr(0x100 + shifted)] = b
            shifted += 1
    return table


_BYTE_LEVEL = _byte_level_alphabet()


def _byte_level_bytes(piece: str) -> bytes | None:
    """The raw bytes of a byte-level vocabulary entry; None if piece is not one (then the
    token's decoded text stands in, as for SentencePiece vocabularies)."""
    try:
        return bytes(_BYTE_LEVEL[c] for c in piece)
    except KeyError:
        return None

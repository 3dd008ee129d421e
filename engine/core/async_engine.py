"""AsyncEngine: the engine as an asyncio service, the EngineClient a server drives.
`generate(request_id, prompt_ids, params)` yields a request's outputs as they are sampled and
`abort(request_id)` drops it; that is all a server needs to see of generation.

One engine thread owns the EngineCore: it loads the model, applies queued commands (add,
abort) between steps, runs steps while there is work and sleeps when there is none. Outputs
reach the event loop through `loop.call_soon_threadsafe`, one batch per request per step; the
loop never waits on the engine. Admission is bounded: beyond `max_num_seqs + max_queue` live
requests, `submit` raises QueueFullError at once.
Guarantees: an aborted request (client gone, generator closed) leaves the batch at the next
step boundary and its KV blocks return to the pool; an exception inside one request fails that
request only; an exception in the loop itself marks the engine failed (`error`) and calls
`on_fatal` so the process can exit and be restarted.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from colibri.engine.core.client import Health, ModelInfo
from colibri.engine.core.engine import EngineCore
from colibri.engine.core.options import default
from colibri.engine.core.request import RequestOutput
from colibri.engine.errors import ModelError
from colibri.engine.sample.sampler import SamplingParams
from colibri.engine.text.token_text import TokenTexts

log = logging.getLogger("colibri.engine")


class QueueFullError(Exception):
    """Too many requests are live: the client should retry later (503 + Retry-After)."""


class EngineUnavailableError(Exception):
    """The model is not loaded (yet), failed, or the engine is stopping."""


class EngineDeadError(RuntimeError):
    """The engine thread stopped while the request was live."""


@dataclass
class AsyncEngineConfig:
    """Admission limits of the async engine (the step limits live in SchedulerConfig)."""

    max_queue: int = default("max_queue")  # requests waiting beyond the running batch


_END = object()
_ids = itertools.count()


class Stream:
    """One request's outputs on the event loop side."""

    def __init__(self, engine: AsyncEngine, request_id: str, n_choices: int,
                 want_token_text: bool, sink: asyncio.Queue[Any] | None) -> None:
        self.engine = engine
        self.request_id = request_id
        self.n_choices = n_choices
        self.want_token_text = want_token_text
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Any] = sink if sink is not None else asyncio.Queue()
        self.arrival = time.perf_counter()
        self.finished = 0  # engine thread: choices that ended
        self.closed = False  # loop side: the consumer saw the end, or gave up

    def post(self, item: Any) -> None:
        """From the engine thread: hand item (a list of outputs, an exception or the end
        marker) to the loop."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (self, item))
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.engine.abort(self.request_id)

    def close(self) -> None:
        """From the loop: stop listening; aborts the request unless it already ended."""
        if not self.closed:
            self.closed = True
            self.engine.release(self)

    def finish(self) -> None:
        """From the loop: the consumer saw the end (or the error) of the request."""
        self.closed = True
        self.engine.release(self, ended=True)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                _, item = await self.queue.get()
                if item is _END:
                    self.finish()
                    return
                if isinstance(item, BaseException):
                    self.finish()
                    raise item
                for out in item:
                    yield out
        finally:
            self.close()


class AsyncEngine:
    """Owns the engine thread and the EngineCore it drives."""

    def __init__(self, loader: Callable[[], EngineCore], config: AsyncEngineConfig,
                 on_fatal: Callable[[BaseException], None] | None = None,
                 on_outputs: Callable[[Stream, list[RequestOutput]], None] | None = None) -> None:
        self._loader = loader
        self.config = config
        self._on_fatal = on_fatal
        self._on_outputs = on_outputs
        self._cmds: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="colibri-engine", daemon=True)
        self._lock = threading.Lock()
        self._live: dict[str, Stream] = {}  # loop side and engine side, under _lock
        self._streams: dict[str, Stream] = {}  # engine thread only
        self.core: EngineCore | None = None
        self.token_text: TokenTexts | None = None
        self._info: ModelInfo | None = None
        self._step_observers: list[Callable[[int, int], None]] = []
        self.loaded = threading.Event()
        self.error: BaseException | None = None
        self.stopping = False
        self.n_running = 0
        self.n_waiting = 0

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; it loads the model first."""
        self._thread.start()

    @property
    def ready(self) -> bool:
        return self.loaded.is_set() and self.error is None and not self.stopping

    def health(self) -> Health:
        if self.error is not None:
            return "failed"
        if self.fault is not None:
            return "faulty"
        if self.stopping:
            return "stopping"
        return "ready" if self.loaded.is_set() else "loading"

    @property
    def fault(self) -> str | None:
        core = self.core
        return None if core is None else core.model.fault

    # -- the model (EngineClient) ------------------------------------------------------------
    @property
    def info(self) -> ModelInfo:
        if self._info is None:
            raise EngineUnavailableError("the model is not loaded")
        return self._info

    @property
    def tokenizer(self) -> Any:
        return self._loaded_core().tokenizer

    def context_budget(self, n_prompt: int, requested: int | None) -> int:
        return self._loaded_core().context_budget(n_prompt, requested)

    def token_texts(self, token_ids: list[int]) -> list[Any]:
        tt = self.token_text
        if tt is None:
            raise EngineUnavailableError("the model is not loaded")
        return [tt(t) for t in token_ids]

    def observe_steps(self, fn: Callable[[int, int], None]) -> None:
        self._step_observers.append(fn)

    def stats(self) -> dict[str, float]:
        core = self.core
        return {} if core is None or not self.loaded.is_set() else core.snapshot()

    def expert_cache(self) -> Any:
        return self.core.expert_cache if self.loaded.is_set() and self.core else None

    def _loaded_core(self) -> EngineCore:
        core = self.core
        if core is None or not self.loaded.is_set():
            raise EngineUnavailableError("the model is not loaded")
        return core

    @property
    def n_live(self) -> int:
        with self._lock:
            return len(self._live)

    def stop(self, timeout: float) -> None:
        """Abort what is left and join the engine thread (blocking: call it off the loop)."""
        self.stopping = True
        with self._lock:
            live = list(self._live)
        for rid in live:
            self.abort(rid)
        self._cmds.put(None)
        self._thread.join(timeout)

    # -- requests (event loop side) ----------------------------------------------------------
    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(_ids)}"

    def submit(self, request_id: str, prompt_ids: list[int],
               params: SamplingParams | list[SamplingParams], want_token_text: bool = False,
               sink: asyncio.Queue[Any] | None = None) -> Stream:
        """Validate and queue a request (one SamplingParams per choice); raises
        EngineUnavailableError, QueueFullError, SamplingParamError, ContextLengthError or
        ValueError before anything is queued. Outputs arrive on the returned Stream (or, as
        (stream, item) pairs, on sink, which several streams may share)."""
        core = self.core
        if not self.ready or core is None:
            raise EngineUnavailableError("the model is not ready")
        choices = params if isinstance(params, list) else [params]
        for p in choices:
            core.check_request(prompt_ids, p)  # reads only immutable limits: safe off-thread
        with self._lock:
            limit = core.scheduler.config.max_num_seqs + self.config.max_queue
            if len(self._live) >= limit:
                raise QueueFullError("the request queue is full")
            if request_id in self._live:
                raise ValueError(f"request id {request_id!r} is already live")
            stream = Stream(self, request_id, len(choices), want_token_text, sink)
            self._live[request_id] = stream
        self._cmds.put(("add", stream, list(prompt_ids), choices))
        return stream

    async def generate(self, request_id: str, prompt_ids: list[int],
                       params: SamplingParams | list[SamplingParams],
                       want_token_text: bool = False) -> AsyncIterator[RequestOutput]:
        """The request's outputs in order (choices interleaved); aborts it on exit."""
        stream = self.submit(request_id, prompt_ids, params, want_token_text)
        async for out in stream:
            yield out

    def abort(self, request_id: str) -> None:
        """Drop request_id (any thread); its blocks are freed before the next step."""
        self._cmds.put(("abort", request_id))

    async def reset_prefix_cache(self) -> int:
        """Forget every cached prompt prefix, on the engine thread between two steps; the
        number of cached KV blocks forgotten. Running requests keep their blocks."""
        if not self.ready:
            raise EngineUnavailableError("the model is not ready")
        done: concurrent.futures.Future[int] = concurrent.futures.Future()
        self._cmds.put(("reset_prefix_cache", done))
        return await asyncio.wrap_future(done)

    def release(self, stream: Stream, ended: bool = False) -> None:
        """The loop is done with stream: forget it, and abort it unless it ended."""
        with self._lock:
            if self._live.get(stream.request_id) is stream:
                del self._live[stream.request_id]
        if not ended:
            self.abort(stream.request_id)

    # -- engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            core = self._loader()
            self.core = core
            self.token_text = TokenTexts(core.tokenizer)
            self._info = ModelInfo(
                name=str(core.model_name), path=core.model_path, n_ctx=core.n_ctx,
                max_request_tokens=core.max_request_tokens, vocab_size=core.vocab_size,
                eos_token_ids=frozenset(core.eos_ids))
            log.info("model %s loaded (context %d tokens)", core.model_name, core.n_ctx)
            if self._step_observers:
                observers = list(self._step_observers)

                def on_step(n_seq: int, n_tok: int) -> None:
                    for fn in observers:
                        fn(n_seq, n_tok)

                core.on_step = on_step
        except BaseException as exc:  # noqa: BLE001 - reported, then the server exits
            # the model or its files: one line says what; anything else is a bug to trace
            known = isinstance(exc, (ModelError, OSError))
            log.error("could not load the model: %s", exc, exc_info=None if known else exc)
            self.error = exc
            if self._on_fatal is not None:
                self._on_fatal(exc)
            return
        self.loaded.set()
        try:
            while True:
                if not self._apply_commands(block=not self.core.has_work()):
                    return
                if self.core.has_work():
                    self._post_outputs(self.core.step())
                self.n_running = self.core.n_running
                self.n_waiting = self.core.n_waiting
        except BaseException as exc:  # noqa: BLE001 - a bug in this loop: fail loudly
            log.critical("engine thread died: %s", exc, exc_info=exc)
            self.error = exc
            for stream in list(self._streams.values()):
                stream.post(EngineDeadError("the engine stopped"))
            if self._on_fatal is not None:
                self._on_fatal(exc)
        finally:
            self._refuse_pending()
            try:
                self.core.close()
            except Exception as exc:  # noqa: BLE001 - nothing to save is not worth a crash
                log.warning("could not save the expert routing history: %s", exc)

    def _apply_commands(self, block: bool) -> bool:
        """Apply queued commands; False when told to stop."""
        assert self.core is not None
        while True:
            try:
                cmd = self._cmds.get(block=block)
            except queue.Empty:
                return True
            block = False
            if cmd is None:
                for rid in list(self._streams):
                    self.core.abort(rid)
                self._streams.clear()
                return False
            if cmd[0] == "add":
                _, stream, prompt, choices = cmd
                try:
                    self.core.add_request(stream.request_id, prompt, choices)
                except Exception as exc:  # noqa: BLE001 - this request fails alone
                    stream.post(exc)
                    continue
                self._streams[stream.request_id] = stream
            elif cmd[0] == "abort":
                rid = cmd[1]
                if self._streams.pop(rid, None) is not None:
                    self.core.abort(rid)
            elif cmd[0] == "reset_prefix_cache":
                cmd[1].set_result(self.core.reset_prefix_cache())

    def _refuse_pending(self) -> None:
        """Answer the commands the loop will never apply that someone awaits."""
        while True:
            try:
                cmd = self._cmds.get(block=False)
            except queue.Empty:
                return
            if cmd is not None and cmd[0] == "reset_prefix_cache":
                cmd[1].set_exception(EngineUnavailableError("the engine stopped"))

    def _post_outputs(self, outputs: list[RequestOutput]) -> None:
        by_stream: dict[str, list[RequestOutput]] = {}
        for out in outputs:
            if out.request_id in self._streams:
                by_stream.setdefault(out.request_id, []).append(out)
        for rid, outs in by_stream.items():
            stream = self._streams[rid]
            failed = next((o.error for o in outs if o.error is not None), None)
            if failed is not None:
                assert self.core is not None
                self.core.abort(rid)
                del self._streams[rid]
                stream.post(failed)
                continue
            if stream.want_token_text:
                self._attach_token_text(outs)
            if self._on_outputs is not None:
                self._on_outputs(stream, outs)
            stream.finished += sum(1 for o in outs if o.finish_reason is not None)
            stream.post(outs)
            if stream.finished >= stream.n_choices:
                del self._streams[rid]
                stream.post(_END)

    def _attach_token_text(self, outs: list[RequestOutput]) -> None:
        tt = self.token_text
        assert tt is not None
        for o in outs:
            if o.token_id >= 0:
                o.token = tt(o.token_id)
            if o.top_logprobs is not None:
                o.top = [(tt(t), lp) for t, lp in o.top_logprobs]

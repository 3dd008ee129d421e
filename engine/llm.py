"""The engine's Python API: load a model, score tokens, generate text.

`LLM` is the synchronous facade over the step engine (engine.core): the same scheduler,
paged KV cache and batched sampler the server runs, driven from the caller's thread. It is
not thread-safe: callers that serve several clients (the HTTP server) use engine.AsyncEngine.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np

from colibri.engine.core.engine import ContextLengthError, EngineCore
from colibri.engine.core.loader import EngineConfig, load_engine, resolve_model
from colibri.engine.core.options import default
from colibri.engine.core.request import RequestOutput
from colibri.engine.demo import default_model_path
from colibri.engine.sample.sampler import SamplingParams

DEFAULT_N_CTX = 4096
StepOutput = RequestOutput  # one sampled token and the text it lets the caller emit

__all__ = ["LLM", "ContextLengthError", "StepOutput", "default_model_path"]
_ids = itertools.count()


class LLM:
    """A loaded model with its tokenizer.

    path: a Colibri folder, or a Hugging Face folder converted once into a cache
    (precision `quant`); None serves the bundled demo model. `config` sets everything else
    (KV cache size and type, batch limits); threads/n_ctx/quant override its fields.
    """

    def __init__(
        self,
        path: str | Path | None = None,
        threads: int | None = None,
        n_ctx: int | None = None,
        quant: str = default("quant"),
        config: EngineConfig | None = None,
    ) -> None:
        source, name = resolve_model(path)
        cfg = replace(config or EngineConfig(), quant=quant)
        if threads is not None:
            cfg.threads = threads
        if n_ctx is not None:
            cfg.n_ctx = n_ctx
        self.config = cfg
        self.core: EngineCore = load_engine(source, cfg)
        self.path = self.core.model_path
        self.model = self.core.model
        self.tokenizer = self.core.tokenizer
        self.n_ctx: int = self.model.n_ctx
        self.vocab_size: int = self.model.n_vocab
        self.model_name: str = name
        self.core.model_name = name
        self._lock = threading.Lock()

    @property
    def fault(self) -> str | None:
        """Why the model can no longer serve (logged once when it happened); None if healthy."""
        return self.model.fault

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
            return self.core.score([int(t) for t in ids])

    # -- generation --------------------------------------------------------------------
    def generate_tokens(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        abort: threading.Event | None = None,
    ) -> Iterator[StepOutput]:
        """Sample tokens after prompt_ids; the last output carries finish_reason. Raises
        (before the first token) for bad parameters, token ids or context overflow."""
        prompt = [int(t) for t in prompt_ids]
        rid = f"llm-{next(_ids)}"
        self.core.add_request(rid, prompt, params)
        return self._run([rid], abort)

    def generate_batch(self, prompts: list[list[int]],
                       params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Generated token ids of several prompts run together in one batch (continuous
        batching: each step carries every running sequence)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        rids = [f"llm-{next(_ids)}" for _ in prompts]
        for rid, prompt, p in zip(rids, prompts, plist, strict=True):
            self.core.add_request(rid, [int(t) for t in prompt], p)
        out: dict[str, list[int]] = {rid: [] for rid in rids}
        for o in self._run(rids, None):
            if o.token_id >= 0:
                out[o.request_id].append(o.token_id)
        return [out[r] for r in rids]

    def _run(self, rids: list[str], abort: threading.Event | None) -> Iterator[StepOutput]:
        live = set(rids)
        try:
            with self._lock:
                while live:
                    if abort is not None and abort.is_set():
                        yield StepOutput(rids[0], 0, -1, "", finish_reason="abort")
                        return
                    outs = self.core.step()
                    if not outs and not self.core.has_work():
                        return
                    for o in outs:
                        if o.request_id not in live:
                            continue
                        if o.error is not None:
                            raise o.error
                        if o.finish_reason is not None and o.request_id not in self.core.requests:
                            live.discard(o.request_id)  # every choice of it has ended
                        yield o
        finally:
            for rid in rids:
                self.core.abort(rid)

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
        max_tokens: int | None = default("max_tokens"),
        temperature: float = default("temperature"),
        top_p: float = default("top_p"),
        seed: int | None = None,
        stop: str | list[str] | None = None,
        **kw: object,
    ) -> Iterator[str]:
        """Yield text pieces as tokens are sampled (defaults: those of `colibri generate`, from
        engine.core.options)."""
        params = self._params(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, stop=stop, **kw
        )
        for out in self.generate_tokens(self._encode_prompt(prompt), params):
            if out.text:
                yield out.text

    def generate(
        self,
        prompt: str | list[int],
        max_tokens: int | None = default("max_tokens"),
        temperature: float = default("temperature"),
        top_p: float = default("top_p"),
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

"""A request as the scheduler sees it: one sequence (one choice of a client request) with two
counters, tokens known and tokens computed — there is no separate prefill or decode phase.

Guarantees: `tokens` is prompt + generated; `num_computed` of them are in the KV cache; the
step that computes the last known token also samples the next one. Drafted tokens (speculative
decoding) are never part of `tokens`: a step computes them after the last known token, and
only those the model agrees with join the output. A preempted request keeps
its generated tokens and sampler state and recomputes them later, so it continues exactly
where it stopped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from colibri.engine.sample.sampler import Sampler, SamplingParams
from colibri.engine.text.detok import IncrementalDetokenizer, StopStringMatcher


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestOutput:
    """What one step produced for one choice of a client request."""

    request_id: str
    index: int  # choice index (n > 1)
    token_id: int  # -1: no token (error, abort)
    text: str
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None
    n_prompt_tokens: int = 0
    n_cached_tokens: int = 0
    error: BaseException | None = None
    prompt_logprobs: list[Any] | None = None  # first output only, when asked for
    token: Any = None  # TokenInfo of token_id, when logprobs were asked for
    top: list[tuple[Any, float]] | None = None  # (TokenInfo, logprob) of top_logprobs
    stop_reason: str | None = None  # the stop string that ended it (finish_reason "stop")


@dataclass(eq=False)
class Request:
    """One sequence: a prompt, what was generated after it, and how much of it is computed."""

    request_id: str
    index: int
    prompt: list[int]
    params: SamplingParams
    sampler: Sampler
    detok: IncrementalDetokenizer
    stops: StopStringMatcher
    max_new: int
    stop_ids: frozenset[int]
    parent: Request | None = None  # n > 1: choice 0, whose prompt blocks this one shares
    n_forks: int = 0  # n > 1, choice 0: the other choices still to fork from it
    output: list[int] = field(default_factory=list)
    num_computed: int = 0
    n_cached: int = 0
    status: Status = Status.WAITING
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    n_preempted: int = 0
    prompt_lp: list[Any] | None = None  # prompt logprobs gathered over the prompt's chunks
    sent_prompt_lp: bool = False
    # speculative decoding: the drafter of this sequence (None: it does not speculate) and the
    # tokens drafted for the next step, which that step scores after the last known token
    drafter: Any = None
    drafts: list[int] = field(default_factory=list)
    acceptance: Any = None  # its smoothed acceptance rates (engine.spec.cost), with auto

    @property
    def rid(self) -> str:
        """The request's key in the block manager: client request id and choice index."""
        return f"{self.request_id}#{self.index}"

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def prefill_done(self) -> bool:
        return self.num_computed >= len(self.prompt)


def new_request(request_id: str, index: int, prompt: list[int], params: SamplingParams,
                vocab_size: int, tokenizer: Any, max_new: int, eos_ids: list[int],
                parent: Request | None = None) -> Request:
    """A request ready for the scheduler (parameters already validated)."""
    stop_ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        stop_ids |= set(eos_ids)
    return Request(
        request_id=request_id, index=index, prompt=list(prompt), params=params,
        sampler=Sampler(params, vocab_size),
        detok=IncrementalDetokenizer(tokenizer, prompt_ids=prompt,
                                    skip_special_tokens=params.skip_special_tokens),
        stops=StopStringMatcher(list(params.stop)), max_new=max_new,
        stop_ids=frozenset(stop_ids), parent=parent)

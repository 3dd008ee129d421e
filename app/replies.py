"""The pieces OpenAI's answers are made of: a choice accumulated from engine outputs, ids
and timestamps, usage, and the two logprobs formats (chat and legacy completions).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from colibri.engine import RequestOutput


@dataclass
class PromptToken:
    """A prompt token's text forms with its logprob (None for the first) and the top
    alternatives (TokenInfo, logprob)."""

    token: Any
    logprob: float | None
    top: list[tuple[Any, float]]


@dataclass
class Output:
    """One engine step of one sequence, as the routes receive it."""

    index: int
    step: RequestOutput
    prompt: list[PromptToken] | None = None  # with prompt logprobs and token text: the first

    @property
    def token(self) -> Any:
        return self.step.token

    @property
    def top(self) -> Any:
        return self.step.top


@dataclass
class Choice:
    """One choice being accumulated from engine outputs."""

    index: int
    parts: list[str] = field(default_factory=list)
    n_tokens: int = 0
    n_cached: int = 0  # prompt tokens whose KV came from the prefix cache
    finish_reason: str | None = None
    stop_string: str | None = None  # the stop string that ended it
    logprob_outputs: list[Output] = field(default_factory=list)
    prompt: list[PromptToken] | None = None  # echo with logprobs: the prompt's tokens

    @property
    def text(self) -> str:
        return "".join(self.parts)


_encode = json.JSONEncoder(ensure_ascii=False).encode  # json.dumps(x, ensure_ascii=False)


class ChunkJSON:
    """`json.dumps({**base, key: value}, ensure_ascii=False)` for a stream's fixed base (id,
    created, model...): the base is encoded once, not again in every chunk."""

    def __init__(self, base: dict[str, Any], key: str) -> None:
        assert key not in base
        head = _encode(base)[:-1]
        self._head = f"{head}{', ' if base else ''}{_encode(key)}: "

    def __call__(self, value: Any) -> str:
        return f"{self._head}{_encode(value)}}}"


def new_id(prefix: str) -> str:
    """An OpenAI-style object id."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def add_output(choice: Choice, out: Output, eos_ids: frozenset[int],
               keep_eos: bool = False) -> None:
    """Fold one engine step into its choice. keep_eos: the end-of-sequence token that ended
    it gets a logprobs entry too (echoed completions: scorers count one entry per token)."""
    step = out.step
    choice.parts.append(step.text)
    if step.token_id >= 0:
        choice.n_tokens += 1
    choice.n_cached = max(choice.n_cached, step.n_cached_tokens)
    if out.prompt is not None:
        choice.prompt = out.prompt
    if step.finish_reason is not None:
        choice.finish_reason = step.finish_reason
        choice.stop_string = step.stop_reason
    if out.token is not None and step.token_id >= 0 and (
            keep_eos or not is_eos_stop(out, eos_ids)):
        choice.logprob_outputs.append(out)


def is_eos_stop(out: Output, eos_ids: frozenset[int]) -> bool:
    """The end-of-sequence token that ended a choice (no text, no logprobs entry)."""
    return out.step.finish_reason == "stop" and out.step.token_id in eos_ids


def usage(n_prompt: int, choices: list[Choice]) -> dict[str, Any]:
    """OpenAI's usage object; cached_tokens: prompt tokens served from the prefix cache (the
    first choice's: later choices of a prompt share its prefill)."""
    n_completion = sum(c.n_tokens for c in choices)
    cached = choices[0].n_cached if choices else 0
    return {"prompt_tokens": n_prompt, "completion_tokens": n_completion,
            "total_tokens": n_prompt + n_completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


# -- logprobs formats ------------------------------------------------------------------------
def chat_logprob_entries(outputs: list[Output]) -> list[dict[str, Any]]:
    """Chat format: `{"token", "logprob", "bytes", "top_logprobs": [...]}` per token."""
    entries = []
    for out in outputs:
        assert out.token is not None
        top = [{"token": t.text, "logprob": lp, "bytes": t.bytes} for t, lp in out.top or []]
        entries.append({"token": out.token.text, "logprob": out.step.logprob,
                        "bytes": out.token.bytes, "top_logprobs": top})
    return entries


def completion_logprobs(outputs: list[Output], k: int, offset: int,
                        prompt: list[PromptToken] | None = None) -> dict[str, Any]:
    """Legacy completions format: parallel lists tokens / token_logprobs / top / offsets;
    with prompt (echo), the prompt's tokens come first (the first has no logprob)."""
    tokens: list[str] = []
    lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for p in prompt or []:
        tokens.append(p.token.text)
        lps.append(p.logprob)
        offsets.append(offset)
        offset += len(p.token.text)
        if p.logprob is None:
            tops.append(None)
        else:
            tops.append({t.text: lp for t, lp in p.top} if k > 0 else None)
    for out in outputs:
        assert out.token is not None
        tokens.append(out.token.text)
        lps.append(out.step.logprob)
        offsets.append(offset)
        offset += len(out.token.text)
        tops.append({t.text: lp for t, lp in (out.top or [])} if k > 0 else None)
    return {"tokens": tokens, "token_logprobs": lps,
            "top_logprobs": tops if k > 0 else None, "text_offset": offsets}


async def with_first(first: Output | None,
                     outputs: AsyncIterator[Output]) -> AsyncIterator[Output]:
    """The output first_output already took (if any), then the rest of the stream."""
    if first is not None:
        yield first
    async for out in outputs:
        yield out

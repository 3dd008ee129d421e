"""Constrained decoding: JSON Schema, regular expressions and Lark grammars, via llguidance.

A `ConstraintSpec` says what the output must match; `ConstraintCompiler.compile(spec)` turns
it into a per-request `Constraint` bound to the model's tokenizer. The sampler calls
`apply(logits)` on each step's adjusted logits (disallowed tokens become -inf) and
`accept(token)` after each sampled token. The end-of-sequence token is allowed exactly when
the grammar accepts; `is_finished()` turns true once the grammar admits no further text.
Grammars are validated and compiled once per spec and cached; each request gets its own
matcher state. Given the request's token budget, a constraint looks ahead near the end: once
the greedy way to close the grammar (quotes and brackets first) needs nearly all the tokens
left, it follows that way, so output that would be cut by max_tokens still parses (a
pattern that this path cannot complete may still be cut: finish_reason "length"). Refuses
(ConstraintError, naming the feature) what the library cannot compile.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from colibri.engine.isolate.pool import WorkerPool, WorkerStopped
from colibri.engine.sample.schema_limits import (
    ConstraintLimitError,
    check_pattern,
    check_schema,
)

ConstraintKind = Literal["json_schema", "json_object", "regex", "grammar", "lark_json"]

# JSON comes out with one space after ',' and ':' and no other whitespace: a model cannot
# fill its budget with blanks, and the text reads like json.dumps output.
_JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
_CACHE_SIZE = 256
_MATCHERS_KEPT = 64
# A spec compiles first in a child process with these bounds (a few conjunctions of patterns
# can take the grammar engine minutes and gigabytes; its own limits do not stop that).
COMPILE_TIMEOUT_S = 5.0
COMPILE_MEMORY_BYTES = 512 << 20
# Closing look-ahead: checked in the last _LOOKAHEAD tokens of a budget, with a margin.
_LOOKAHEAD = 96
_CLOSING_MARGIN = 6
MAX_SPEC_CHARS = 200_000

# One background thread computes the next mask while the forward pass runs (llguidance
# releases the GIL while it computes); apply() waits for it.
_mask_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="colibri-mask")


# Formats rewritten to patterns before compiling: the grammar engine's own date-time accepts
# second 60 and the 31st of every month, which strict validators (RFC 3339) reject. These
# allow exactly the dates every month has (February up to the 28th) and seconds 00-59.
_DAY = (r"((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)"
        r"|02-(0[1-9]|1[0-9]|2[0-8]))")
_TIME = (r"([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]{1,6})?"
         r"(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])")
_FORMAT_PATTERNS = {
    "date-time": rf"^[0-9]{{4}}-{_DAY}T{_TIME}$",
    "date": rf"^[0-9]{{4}}-{_DAY}$",
    "time": rf"^{_TIME}$",
}
_DATA_KEYS = frozenset({"enum", "const", "default", "examples"})


def _strict_formats(node: Any) -> Any:
    """A copy of a schema with the formats above turned into patterns (when no pattern is
    given); data keywords (enum, const, default, examples) are left alone."""
    if isinstance(node, list):
        return [_strict_formats(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: (v if k in _DATA_KEYS else _strict_formats(v)) for k, v in node.items()}
    fmt = out.get("format")
    if isinstance(fmt, str) and fmt in _FORMAT_PATTERNS and "pattern" not in out:
        del out["format"]
        out["pattern"] = _FORMAT_PATTERNS[fmt]
    return out


class ConstraintError(ValueError):
    """A constraint the engine cannot compile; `param` is the request field, `message` says
    which feature is unsupported."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True)
class ConstraintSpec:
    """What the output must match. value: a JSON Schema (dict or JSON text) for json_schema,
    ignored for json_object, a regular expression for regex, a Lark grammar for grammar;
    for lark_json, {"grammar": Lark text, "json": {rule: JSON Schema}}: the grammar, whose
    rules named in json are JSON values of their schemas, written as response_format JSON is
    (a model's own tool-call markup around JSON values)."""

    kind: ConstraintKind
    value: Any = None
    param: str = "response_format"

    def key(self) -> str:
        if self.kind == "json_schema":
            v = self.value if isinstance(self.value, str) else json.dumps(
                self.value, sort_keys=True, separators=(",", ":"))
            return "json_schema\0" + v
        if self.kind == "json_object":
            return "json_object"
        if self.kind == "lark_json":
            return self.kind + "\0" + json.dumps(self.value, sort_keys=True,
                                                 separators=(",", ":"))
        return f"{self.kind}\0{self.value}"


def json_lark(schema: Any) -> str:
    """A Lark rule body for a JSON value matching schema, written as response_format JSON is
    (formats as strict patterns, fixed separators). ConstraintLimitError past the limits."""
    check_schema(schema)
    full = {**_strict_formats(schema), "x-guidance": _JSON_OPTIONS}
    return "%json " + json.dumps(full, ensure_ascii=False)


def _lark_json(spec: ConstraintSpec) -> str:
    """The Lark grammar of a lark_json spec, its JSON rules written out."""
    v = spec.value
    if (not isinstance(v, dict) or not isinstance(v.get("grammar"), str)
            or not isinstance(v.get("json", {}), dict)):
        raise ConstraintError("lark_json needs a grammar and a map of JSON rules", spec.param)
    rules = [f"{name}: {json_lark(schema)}" for name, schema in v.get("json", {}).items()]
    return "\n".join([v["grammar"].rstrip("\n"), *rules]) + "\n"


class Constraint:
    """One request's grammar state. Not thread-safe: one sequence, one caller at a time."""

    def __init__(self, matcher: Any, n_vocab: int, overlap: bool = True,
                 max_tokens: int | None = None, closing: np.ndarray | None = None) -> None:
        self._m = matcher
        self._max_tokens = max_tokens
        self._closing = closing
        self._closing_mode = False
        self._n = int(n_vocab)
        self._words = (self._n + 31) // 32
        self._bitmask = np.full(self._words, -1, dtype=np.int32)
        self._allowed = np.empty(self._n, dtype=bool)
        self._overlap = overlap
        self._pending: Future[None] | None = None
        self._ready = False  # _bitmask holds the mask of the current state
        self._finished = False
        self.n_accepted = 0

    def _fill(self) -> None:
        self._m.unsafe_compute_mask_ptr(self._bitmask.ctypes.data, self._words * 4)

    def _wait(self) -> None:
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def mask(self) -> np.ndarray:
        """Boolean [n_vocab]: the tokens allowed next (a view reused between calls)."""
        self._wait()
        if not self._ready:
            self._fill()
            self._ready = True
        bits = np.unpackbits(self._bitmask.view(np.uint8), count=self._n, bitorder="little")
        np.not_equal(bits, 0, out=self._allowed)
        return self._allowed

    def apply(self, logits: np.ndarray) -> None:
        """Set the logits of disallowed tokens to -inf, in place (float32 [n_vocab])."""
        if logits.shape != (self._n,):
            raise ValueError(f"logits shape {logits.shape} != ({self._n},)")
        allowed = self.mask()
        if self._m.is_error():
            raise RuntimeError(f"constraint state is broken: {self._m.get_error()}")
        np.putmask(logits, ~allowed, np.float32(-np.inf))
        if self.closing_now():
            # Out of budget soon: follow the shortest-looking way to a complete match. The
            # scores dwarf any logit, so this is greedy among the allowed tokens.
            np.add(logits, self._closing, out=logits, where=allowed)

    def closing_now(self) -> bool:
        """True once the rest of the budget is needed to close the grammar (then for good)."""
        if self._closing_mode or self._max_tokens is None or self._closing is None:
            return self._closing_mode
        left = self._max_tokens - self.n_accepted
        if left <= _LOOKAHEAD:
            # A sampled token can deepen the structure by a few tokens: keep a margin. A
            # greedy path that does not close at all (a pattern the preference cannot
            # complete) is not taken: the model's own choices are the better bet then.
            cost = self._closing_cost(left)
            self._closing_mode = cost < left and cost + _CLOSING_MARGIN >= left
        return self._closing_mode

    def _closing_cost(self, limit: int) -> int:
        """Tokens the greedy closing path needs from the current state (limit if more)."""
        self._wait()
        assert self._closing is not None
        m = self._m.deep_copy()
        bitmask = np.empty(self._words, dtype=np.int32)
        for k in range(limit):
            if m.is_stopped():
                return k
            if m.is_accepting():
                return k + 1  # the end-of-sequence token
            m.unsafe_compute_mask_ptr(bitmask.ctypes.data, self._words * 4)
            bits = np.unpackbits(bitmask.view(np.uint8), count=self._n, bitorder="little")
            if not bits.any() or not m.consume_token(
                    int(np.argmax(np.where(bits != 0, self._closing, -np.inf)))):
                return limit
        return limit

    def accept(self, token_id: int) -> None:
        """Advance the grammar by one sampled token (which apply() allowed)."""
        self._wait()
        if not self._m.consume_token(int(token_id)):
            raise RuntimeError(f"token {token_id} rejected by the constraint: "
                               f"{self._m.get_error()}")
        self.n_accepted += 1
        self._ready = False
        self._finished = bool(self._m.is_stopped())
        if self._overlap and not self._finished:
            self._pending = _mask_pool.submit(self._fill_ready)

    def _fill_ready(self) -> None:
        self._fill()
        self._ready = True

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of tokens, from the first, the grammar would accept in a row from the
        current state (the state does not change): drafts past that can never be kept."""
        self._wait()
        return int(self._m.validate_tokens([int(t) for t in tokens]))

    def is_finished(self) -> bool:
        """True once the grammar is complete and admits nothing but end-of-sequence."""
        return self._finished

    def is_accepting(self) -> bool:
        """True when the text so far is a complete match (it may still go on)."""
        self._wait()
        return bool(self._m.is_accepting())

    def clone(self) -> Constraint:
        """An independent copy of the current state (for n > 1 from one prefix)."""
        self._wait()
        c = Constraint(self._m.deep_copy(), self._n, self._overlap, self._max_tokens,
                       self._closing)
        c._finished = self._finished
        c._closing_mode = self._closing_mode
        c.n_accepted = self.n_accepted
        return c


class ConstraintCompiler:
    """Compiles specs against one tokenizer. A spec is first compiled in a child process
    bounded in time and memory (engine.isolate); only one that compiled there is compiled
    here, once: its matcher is kept (bounded, least recently used first out) and each request
    gets a copy. A refused spec is remembered too, so a repeat costs nothing."""

    def __init__(self, tokenizer_json: str, n_vocab: int, eos_token_ids: list[int],
                 bounded: bool = True) -> None:
        import llguidance  # imported here: only requests with constraints need it

        self._llg = llguidance
        eos = sorted(eos_token_ids) or None
        self.n_vocab = int(n_vocab)
        self._tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=self.n_vocab, eos_token=eos)
        self._cache: OrderedDict[str, str] = OrderedDict()
        self._matchers: OrderedDict[str, Any] = OrderedDict()
        self._refused: OrderedDict[str, tuple[str, str | None]] = OrderedDict()
        self._lock = threading.Lock()
        self._closing: np.ndarray | None = None
        self._eos = list(eos_token_ids)
        self._pool = WorkerPool(
            "colibri.engine.sample.grammar_worker", COMPILE_MEMORY_BYTES,
            hello={"tokenizer": tokenizer_json, "n_vocab": self.n_vocab,
                   "eos": list(eos_token_ids)}) if bounded else None

    def closing_scores(self) -> np.ndarray:
        """Per-token preference of the closing path (built once). In order: end of sequence;
        a closing quote, with any closing brackets after it (inside a string only a quote
        ends it); '@' and then brackets alone (an e-mail address needs its '@' before its
        closing quote); '.'; then longer tokens (forced text such as keys and enum values
        is covered in fewer steps)."""
        if self._closing is None:
            scores = np.zeros(self.n_vocab, dtype=np.float32)
            brackets = set(b"}]")
            for i in range(min(self.n_vocab, self._tok.vocab_size)):
                raw = self._tok.decode_bytes([i])
                if raw[:1] == b'"' and all(b in brackets for b in raw[1:]):
                    scores[i] = 5e6 + 1e3 * len(raw)
                elif raw == b"@":
                    scores[i] = 4e6
                elif raw and all(b in brackets for b in raw):
                    scores[i] = 3e6 + 1e3 * len(raw)
                elif raw == b".":
                    scores[i] = 2e6
                else:
                    scores[i] = 1e5 + 10.0 * min(len(raw), 64)
            for t in self._eos:
                if 0 <= t < self.n_vocab:
                    scores[t] = 1e7
            self._closing = scores
        return self._closing

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, n_vocab: int) -> ConstraintCompiler:
        """The compiler of an engine Tokenizer (built once per tokenizer, ~tens of ms)."""
        with _compilers_lock:
            comp = _compilers.get(tokenizer)
            if comp is None or comp.n_vocab != n_vocab:
                comp = cls(tokenizer.to_json(), n_vocab, sorted(tokenizer.eos_token_ids))
                _compilers[tokenizer] = comp
            return comp

    def _grammar(self, spec: ConstraintSpec) -> str:
        M = self._llg.LLMatcher
        if spec.kind == "json_schema":
            schema = spec.value
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError:
                    raise ConstraintError("the JSON schema is not valid JSON", spec.param) from None
            if isinstance(schema, bool):
                schema = {} if schema else {"not": {}}
            if not isinstance(schema, dict):
                raise ConstraintError("the JSON schema must be an object", spec.param)
            check_schema(schema)
            try:
                return M.grammar_from_json_schema(_strict_formats(schema),
                                                  overrides=_JSON_OPTIONS)
            except (ValueError, TypeError) as exc:
                raise ConstraintError(f"the JSON schema cannot be compiled: {exc}",
                                      spec.param) from None
        if spec.kind == "json_object":
            return M.grammar_from_json_schema({"type": "object"}, overrides=_JSON_OPTIONS)
        if spec.kind == "lark_json":
            return M.grammar_from_lark(_lark_json(spec))
        if not isinstance(spec.value, str) or not spec.value:
            raise ConstraintError(f"the {spec.kind} must be a non-empty string", spec.param)
        if spec.kind == "regex":
            check_pattern(str(spec.value))
            return M.grammar_from_regex(spec.value)
        if spec.kind == "grammar":
            return M.grammar_from_lark(spec.value)
        raise ConstraintError(f"unknown constraint kind {spec.kind!r}", spec.param)

    def grammar(self, spec: ConstraintSpec) -> str:
        """The validated grammar of spec (cached); ConstraintError names what is unsupported."""
        key = self._key(spec)
        hit = _recall(self._cache, self._lock, key)
        if hit is not None:
            return hit
        try:
            grammar = self._grammar(spec)
        except ConstraintLimitError as exc:  # past schema_limits: the request's own error
            raise ConstraintError(str(exc), spec.param) from None
        is_error, messages = self._llg.LLMatcher.validate_grammar_with_warnings(
            grammar, self._tok, limits=self._limits())
        if is_error:
            detail = "; ".join(messages) or "invalid grammar"
            what = "JSON schema" if spec.kind in ("json_schema", "json_object") else spec.kind
            raise ConstraintError(f"the {what} uses something this server cannot enforce: "
                                  f"{detail}", spec.param)
        _remember(self._cache, self._lock, key, grammar, _CACHE_SIZE)
        return grammar

    def _limits(self) -> Any:
        return self._llg.LLParserLimits(verbose_errors=False)

    @staticmethod
    def _key(spec: ConstraintSpec) -> str:
        key = spec.key()
        if len(key) > MAX_SPEC_CHARS:
            raise ConstraintError(f"the constraint is over {MAX_SPEC_CHARS} characters",
                                  spec.param)
        return key

    def matcher(self, spec: ConstraintSpec) -> Any:
        """A compiled matcher of spec in its start state, whose first mask allows something;
        ConstraintError otherwise. Compiles in this process: call it on specs that compiled
        within bounds (see compile), or where no bound is wanted."""
        matcher = self._llg.LLMatcher(self._tok, self.grammar(spec), log_level=0,
                                      limits=self._limits())
        if matcher.is_error():
            raise ConstraintError(f"the constraint cannot be compiled: {matcher.get_error()}",
                                  spec.param)
        # the first mask now, off the engine's step: a grammar that cannot match anything (a
        # $ref cycle, say) fails here as this request's error, not inside a batch
        probe = Constraint(matcher.deep_copy(), self.n_vocab, overlap=False)
        allowed = probe.mask()
        if probe._m.is_error() or not allowed.any():
            error = probe._m.get_error()
            detail = error.splitlines()[0] if probe._m.is_error() and error else ""
            raise ConstraintError("no output can match the constraint (a $ref that refers to "
                                  "itself, for one)" + (f": {detail}" if detail else ""),
                                  spec.param)
        return matcher

    def _checked_matcher(self, spec: ConstraintSpec, timeout_s: float,
                         cancel: threading.Event | None) -> Any:
        """The kept matcher of spec, compiled first in a bounded child process."""
        key = self._key(spec)
        hit = _recall(self._matchers, self._lock, key)
        if hit is not None:
            return hit
        refused = _recall(self._refused, self._lock, key)
        if refused is not None:
            raise ConstraintError(refused[0], refused[1])
        if self._pool is not None:
            try:
                reply = self._pool.call({"kind": spec.kind, "value": spec.value,
                                         "param": spec.param}, timeout_s, cancel,
                                        "compiling the constraint")
            except WorkerStopped as e:
                if e.reason == "cancelled":
                    raise ConstraintError(str(e), spec.param) from None
                why = (f"within {timeout_s:g} s" if e.reason == "timeout"
                       else f"within {COMPILE_MEMORY_BYTES >> 20} MiB of memory")
                reply = {"error": f"the constraint is too complex to compile {why}",
                         "param": spec.param}
            if reply.get("error") is not None:
                refusal = (str(reply["error"]), reply.get("param") or spec.param)
                _remember(self._refused, self._lock, key, refusal, _CACHE_SIZE)
                raise ConstraintError(*refusal)
        matcher = self.matcher(spec)
        _remember(self._matchers, self._lock, key, matcher, _MATCHERS_KEPT)
        return matcher

    def compile(self, spec: ConstraintSpec, max_tokens: int | None = None,
                overlap: bool = True, timeout_s: float = COMPILE_TIMEOUT_S,
                cancel: threading.Event | None = None) -> Constraint:
        """A fresh per-request Constraint for spec; max_tokens: the request's token budget
        (None: no closing steer). A spec that does not compile within timeout_s and the
        memory bound, or whose compile is cancelled, is a ConstraintError."""
        kept = self._checked_matcher(spec, timeout_s, cancel)
        with self._lock:
            matcher = kept.deep_copy()
        closing = self.closing_scores() if max_tokens is not None else None
        return Constraint(matcher, self.n_vocab, overlap, max_tokens, closing)

    def close(self) -> None:
        """Stop the compile processes (started again on the next compile)."""
        if self._pool is not None:
            self._pool.close()


def _recall(cache: OrderedDict[str, Any], lock: threading.Lock, key: str) -> Any:
    """cache's entry for key (now the most recently used), or None."""
    with lock:
        hit = cache.get(key)
        if hit is not None:
            cache.move_to_end(key)
        return hit


def _remember(cache: OrderedDict[str, Any], lock: threading.Lock, key: str, value: Any,
              size: int) -> None:
    with lock:
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > size:
            cache.popitem(last=False)


_compilers: weakref.WeakKeyDictionary[Any, ConstraintCompiler] = weakref.WeakKeyDictionary()
_compilers_lock = threading.Lock()


def compile_constraints(tokenizer: Any, n_vocab: int, spec: ConstraintSpec | None,
                        budgets: list[int], timeout_s: float = COMPILE_TIMEOUT_S,
                        cancel: threading.Event | None = None) -> list[Constraint | None]:
    """One fresh constraint per sequence of a request (None each without a spec); budgets:
    each sequence's token budget. ConstraintError names what cannot be enforced, and a spec
    that does not compile within timeout_s (or its memory bound) or whose compile was
    cancelled. Blocks up to timeout_s: run it off any event loop."""
    if spec is None:
        return [None] * len(budgets)
    compiler = ConstraintCompiler.for_tokenizer(tokenizer, n_vocab)
    return [compiler.compile(spec, max_tokens=b, timeout_s=timeout_s, cancel=cancel)
            for b in budgets]

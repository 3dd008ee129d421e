"""Limits a constraint is checked against before the grammar engine sees it.

The grammar engine compiles lazily: a schema nested thousands of levels deep overflows the
Python stack while it is being prepared, and a pattern such as `^a{1000000}$` compiles in
microseconds but builds its lexer states one generated token at a time, failing (or eating
memory) in the middle of a request. Both are refused here, as the request's own error, before
any work is queued: nesting deeper than MAX_SCHEMA_DEPTH, and a pattern whose counted
repetitions multiply past MAX_PATTERN_REPEAT.
"""

from __future__ import annotations

import re
import re._constants as sre_constants
import re._parser as sre_parse
from typing import Any

MAX_SCHEMA_DEPTH = 128  # levels of objects and lists in one JSON schema
MAX_PATTERN_REPEAT = 10_000  # characters a pattern's counted repetitions can spell out


class ConstraintLimitError(ValueError):
    """A constraint past one of the limits above (the message says which)."""


_REPEATS = {sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT,
            getattr(sre_constants, "POSSESSIVE_REPEAT", sre_constants.MAX_REPEAT)}


def check_schema(schema: Any) -> None:
    """ConstraintLimitError when schema nests too deep or one of its patterns (`pattern`, the
    keys of `patternProperties`) repeats too much. Iterative: any depth is safe to check."""
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise ConstraintLimitError(
                f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
        if isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
        elif isinstance(node, dict):
            for key, value in node.items():
                if key == "pattern" and isinstance(value, str):
                    check_pattern(value)
                elif key == "patternProperties" and isinstance(value, dict):
                    for pattern in value:
                        check_pattern(str(pattern))
                stack.append((value, depth + 1))


def check_pattern(pattern: str) -> None:
    """ConstraintLimitError when the pattern's counted repetitions multiply past
    MAX_PATTERN_REPEAT (`a{1000000}`, `((x{1000}){1000}){1000}`). A pattern Python's own
    parser does not read is left to the grammar engine."""
    try:
        parsed = sre_parse.parse(pattern)
    except (re.error, RecursionError, OverflowError, ValueError):
        return
    try:
        size = _spelled(parsed)
    except RecursionError:
        raise ConstraintLimitError(f"the pattern {_short(pattern)} nests too deep") from None
    if size > MAX_PATTERN_REPEAT:
        raise ConstraintLimitError(
            f"the pattern {_short(pattern)} repeats to {size} characters; at most "
            f"{MAX_PATTERN_REPEAT} are supported")


def _spelled(items: Any) -> int:
    """The longest run of characters a parsed pattern spells with its repetitions counted
    (an unbounded repetition counts its minimum, as the lexer loops over it)."""
    total = 0
    for op, arg in items:
        if op in _REPEATS:
            lo, hi, sub = arg
            times = lo if hi == sre_constants.MAXREPEAT else hi
            total += max(int(times), 1) * _spelled(sub)
        elif op == sre_constants.SUBPATTERN:
            total += _spelled(arg[-1])
        elif op == sre_constants.BRANCH:
            total += max((_spelled(b) for b in arg[1]), default=0)
        elif op in (sre_constants.ASSERT, sre_constants.ASSERT_NOT):
            total += _spelled(arg[1])
        elif op != sre_constants.AT:  # ^ $ \b spell nothing
            total += 1
    return total


def _short(pattern: str) -> str:
    return repr(pattern if len(pattern) <= 60 else pattern[:57] + "...")

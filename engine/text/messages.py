"""Chat messages and other client values, checked before a template sees them.

Guarantees: what leaves here is plain JSON data (dicts with str keys, lists, str, finite
numbers, bools, None) whose strings are valid Unicode, and every message has a known role and
string content. Refuses, naming the field: lone surrogates, non-JSON values, unknown roles,
content parts other than text.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from colibri.engine.text.errors import TokenizerError

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})

_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(text: Any, param: str = "prompt") -> str:
    """Return text if it is a str of valid Unicode (no lone surrogates), else raise."""
    if not isinstance(text, str):
        raise TokenizerError(f"{param} must be a string", param)
    m = _SURROGATE.search(text)
    if m is not None:
        raise TokenizerError(
            f"{param} contains invalid Unicode (lone surrogate at index {m.start()})", param
        )
    return text


def plain_json(value: Any, param: str) -> Any:
    """Copy a JSON-like value, refusing anything that is not plain JSON data."""
    if value is None or type(value) in (bool, int):
        return value
    if type(value) is float:
        if not math.isfinite(value):
            raise TokenizerError(f"{param} must be a finite number", param)
        return value
    if isinstance(value, str):
        return check_text(str.__str__(value), param)
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TokenizerError(f"{param} has a non-string key", param)
            out[check_text(k, param)] = plain_json(v, f"{param}.{k}")
        return out
    if isinstance(value, (list, tuple)):
        return [plain_json(v, f"{param}[{i}]") for i, v in enumerate(value)]
    raise TokenizerError(f"{param} has an unsupported type {type(value).__name__}", param)


def join_text_parts(texts: Iterable[str]) -> str:
    """A message's text parts as one string, the one way every entry point joins them:
    concatenated as sent, so parts tokenize exactly like the same text sent as a string."""
    return "".join(texts)


def _content_text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return check_text(content, param)
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            p = f"{param}[{j}]"
            if not isinstance(part, Mapping):
                raise TokenizerError(f"{p} must be an object", p)
            if part.get("type") != "text":
                got = part.get("type")
                raise TokenizerError(f"{p}.type must be 'text' (got {got!r})", p + ".type")
            texts.append(check_text(part.get("text"), p + ".text"))
        return join_text_parts(texts)
    raise TokenizerError(f"{param} must be a string or a list of text parts", param)


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Validate chat messages and return plain dicts with string content.

    Content may be a string or a list of {"type": "text", "text": ...} parts (joined by
    join_text_parts); None content is dropped (assistant messages that only carry tool calls).
    Other keys pass through as plain JSON data. Raises TokenizerError naming the field.
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise TokenizerError("messages must be a non-empty list", "messages")
    out = []
    for i, msg in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(msg, Mapping):
            raise TokenizerError(f"{param} must be an object", param)
        role = msg.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise TokenizerError(
                f"{param}.role must be one of {sorted(CHAT_ROLES)} (got {role!r})", param + ".role"
            )
        clean: dict[str, Any] = {"role": role}
        for key, value in msg.items():
            if key == "role" or value is None:
                continue  # like transformers: templates handle a missing key better than None
            if key == "content":
                clean["content"] = _content_text(value, f"{param}.content")
            else:
                clean[key] = plain_json(value, f"{param}.{key}")
        if "content" not in clean and role != "assistant":
            raise TokenizerError(f"{param}.content is required", param + ".content")
        out.append(clean)
    return out


def map_strings(value: Any, fn: Callable[[str], Any]) -> Any:
    """Apply fn to every string leaf (not dict keys) of a JSON-like value."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {k: map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [map_strings(v, fn) for v in value]
    return value


def json_keys(value: Any) -> list[str]:
    """Every dict key inside a JSON-like value."""
    out: list[str] = []
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            out.extend(v)
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return out


def map_message_strings(messages: list[dict[str, Any]],
                        fn: Callable[[str], Any]) -> list[dict[str, Any]]:
    """map_strings over messages, leaving each role alone (templates branch on it)."""
    return [
        {k: (v if k == "role" else map_strings(v, fn)) for k, v in m.items()} for m in messages
    ]

"""The jinja2 environment chat templates render in, and the limits every template obeys.

Guarantees: templates run in jinja2's immutable sandbox, which also refuses string, list and
number arithmetic that would build a value past the size cap, namespace attributes starting
with '_', and output past the cap. render_template is what the render process of
engine.text.template_sandbox runs; the server process never renders a template itself.
Refuses: templates over MAX_TEMPLATE_CHARS (checked where a template comes in).
"""

from __future__ import annotations

import functools
import json
import math
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.exceptions import SecurityError, TemplateError, TemplateNotFound
from jinja2.sandbox import ImmutableSandboxedEnvironment

from colibri.engine.text.errors import ChatTemplateError, TemplateFaultError, TemplateLimitError

MAX_TEMPLATE_CHARS = 200_000
# The rendering is capped at a fixed allowance plus a multiple of the text the caller passed in,
# so long conversations render while a template that loops or multiplies strings cannot grow
# without bound.
RENDER_BASE_CHARS = 1 << 20
RENDER_INPUT_FACTOR = 4


class _SizeCapError(SecurityError):
    """A value the template builds would pass the size cap."""


class _CappedEnvironment(ImmutableSandboxedEnvironment):
    """Immutable sandbox that also refuses string/list arithmetic producing huge values."""

    intercepted_binops = frozenset({"+", "*", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        limit = context.get("_clb_cap", RENDER_BASE_CHARS)
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                    if len(seq) * max(n, 0) > limit:
                        raise _SizeCapError("chat template builds a value over the size cap")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and right > 0:
                if abs(left) > 1 and right * math.log2(abs(left)) > 4096:
                    raise _SizeCapError("chat template computes a number over the size cap")
        elif operator == "+":
            if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
                if len(left) + len(right) > limit:
                    raise _SizeCapError("chat template builds a value over the size cap")
        return super().call_binop(context, operator, left, right)


class TemplateRaisedError(TemplateError):
    """What a template's `raise_exception(...)` raises: the template refusing its input."""


def _raise_exception(message: str) -> None:
    raise TemplateRaisedError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes HTML characters; templates from the Hub expect plain JSON.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _SafeNamespace(jinja2.utils.Namespace):
    """jinja's namespace() without underscore attributes (no reach into CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - mirrors jinja's signature
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _SafeNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _SafeNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"namespace attribute {name!r} may not start with '_'")


def _make_env() -> _CappedEnvironment:
    env = _CappedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols],
        # a chat template is one string: include / import / extends find nothing
        loader=jinja2.FunctionLoader(lambda name: None),
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _SafeNamespace
    return env


_ENV = _make_env()
# names a template finds in its environment (jinja's range, dict, namespace, ... and ours)
TEMPLATE_GLOBALS = frozenset(_ENV.globals)


@functools.lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    try:
        return _ENV.from_string(template)
    except TemplateError as e:
        raise TemplateFaultError(f"chat template does not compile: {e}", "chat_template") from e


def render_template(template: str, context: dict[str, Any], cap: int) -> str:
    """Render with the output capped at `cap` characters."""
    compiled = _compile(template)
    out: list[str] = []
    n = 0
    try:
        # Globals are shared, so the binop cap travels in the render context instead.
        for chunk in compiled.generate(**context, _clb_cap=cap):
            n += len(chunk)
            if n > cap:
                raise TemplateLimitError(f"chat template output exceeds {cap} characters")
            out.append(chunk)
    except ChatTemplateError:
        raise
    except TemplateNotFound as e:  # the file itself, whatever the input
        raise TemplateFaultError(f"chat template includes {e.name!r}: a chat template is one "
                                 "file and can include no other", "messages") from e
    except _SizeCapError as e:  # past a limit, like output past the cap
        raise TemplateLimitError(str(e), "chat_template") from e
    except SecurityError as e:
        raise TemplateFaultError(f"chat template failed to render: {e}", "messages") from e
    except TemplateRaisedError as e:  # the template refuses the messages it was given
        raise ChatTemplateError(f"chat template refused the messages: {e}", "messages") from e
    except Exception as e:  # noqa: BLE001 - input the template does not handle: a bad request
        raise ChatTemplateError(f"chat template failed to render: {e}", "messages") from e
    return "".join(out)

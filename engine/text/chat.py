"""Chat templating: picks the model's template or a client's, renders it for checked messages
and splits the rendering into the template's own text and the client's strings.

Guarantees: every template renders in the killable render process (template_sandbox) with an
output cap that grows with the client's text; client strings come back marked as client text,
so special-token text inside them is never read as a special token. When a template transforms
client strings beyond telling them apart, the rendering is returned whole, and only if no client
string holds special-token text.
Refuses: client templates unless allowed, templates over MAX_TEMPLATE_CHARS, client keys holding
special-token text.
"""

from __future__ import annotations

import re
import secrets
import threading
from collections.abc import Mapping
from typing import Any

from colibri.engine.text.errors import (
    ChatTemplateError,
    ChatTemplateRefused,
    ModelTemplateError,
    TemplateFaultError,
    TemplateLimitError,
    TokenizerError,
)
from colibri.engine.text.messages import (
    check_text,
    json_keys,
    map_message_strings,
    map_strings,
    normalize_messages,
    plain_json,
)
from colibri.engine.text.special_tokens import SpecialTokens
from colibri.engine.text.template_env import (
    MAX_TEMPLATE_CHARS,
    RENDER_BASE_CHARS,
    RENDER_INPUT_FACTOR,
    TEMPLATE_GLOBALS,
)
from colibri.engine.text.template_sandbox import SANDBOX

# A rendering split at the client's strings: [(text, is_template)].
Pieces = list[tuple[str, bool]]


class ChatTemplates:
    """A model's chat templates (by name; "default" is the one used) and the special-token
    strings (bos_token, eos_token, pad_token, unk_token) every template is rendered with."""

    def __init__(self, templates: Mapping[str, str], token_strings: Mapping[str, str | None],
                 specials: SpecialTokens) -> None:
        self.templates: dict[str, str] = dict(templates)
        self.default: str | None = self.templates.get("default")
        self._token_strings = {k: v or "" for k, v in token_strings.items()}
        self._specials = specials

    def _select(self, chat_template: str | None, allow_custom_template: bool) -> str:
        if chat_template is not None:
            if not allow_custom_template:
                raise ChatTemplateRefused(
                    "custom chat templates are disabled on this server", "chat_template"
                )
            check_text(chat_template, "chat_template")
            if len(chat_template) > MAX_TEMPLATE_CHARS:
                raise ChatTemplateError(
                    f"chat_template is over {MAX_TEMPLATE_CHARS} characters", "chat_template"
                )
            return chat_template
        if self.default is None:
            raise ChatTemplateError("this model has no chat template", "messages")
        return self.default

    def _context(
        self,
        messages: list[dict[str, Any]],
        tools: Any,
        add_generation_prompt: bool,
        template_kwargs: dict[str, Any],
    ) -> dict[str, Any]:
        ctx: dict[str, Any] = dict(template_kwargs)
        ctx.update(messages=messages, tools=tools,
                   add_generation_prompt=bool(add_generation_prompt), **self._token_strings)
        return ctx

    def _check_variables(self, kwargs: dict[str, Any]) -> None:
        """Extra template variables may not stand in for what the renderer provides."""
        taken = {"messages", "tools", "add_generation_prompt"} | set(self._token_strings)
        for key in kwargs:
            if (not key.isidentifier() or key.startswith("_") or key in taken
                    or key in TEMPLATE_GLOBALS):
                raise TokenizerError(f"chat_template_kwargs may not set {key!r}",
                                     "chat_template_kwargs")

    def render(
        self,
        messages: Any,
        add_generation_prompt: bool,
        chat_template: str | None,
        allow_custom_template: bool,
        tools: Any,
        template_kwargs: Mapping[str, Any] | None,
        with_sentinels: bool,
        render_timeout_s: float = 2.0,
        cancel: threading.Event | None = None,
    ) -> tuple[str, Pieces | None]:
        """The rendering, and (with_sentinels) the same text split into Pieces, or None when
        the template transformed the client's strings (see the module docstring).

        Raises TokenizerError / ChatTemplateError on bad input (a client template past a
        limit: TemplateLimitError), ModelTemplateError when the model's own template runs
        past a limit.
        """
        template = self._select(chat_template, allow_custom_template)
        msgs = normalize_messages(messages)
        tools = plain_json(tools, "tools") if tools is not None else None
        kwargs = (plain_json(dict(template_kwargs), "chat_template_kwargs")
                  if template_kwargs else {})
        self._check_variables(kwargs)
        client_strings: list[str] = []
        map_message_strings(msgs, client_strings.append)
        map_strings(tools, client_strings.append)
        map_strings(kwargs, client_strings.append)
        named = (("messages", msgs), ("tools", tools), ("chat_template_kwargs", kwargs))
        for param, value in named:
            # Keys are not replaced by markers below, so they must not carry special tokens.
            if any(self._specials.found_in(k) for k in json_keys(value)):
                raise TokenizerError(f"{param} has a key containing special-token text", param)
        cap = RENDER_BASE_CHARS + RENDER_INPUT_FACTOR * sum(len(s) for s in client_strings)

        # Every template, the model's and a client's, renders in a process that is stopped
        # after render_timeout_s, at its memory limit or when `cancel` is set.
        def render(t: str, ctx: dict[str, Any], c: int) -> str:
            try:
                return SANDBOX.render(t, ctx, c, render_timeout_s, cancel)
            except (TemplateLimitError, TemplateFaultError) as e:
                if chat_template is not None:  # a client's template: that client's 400
                    raise
                raise ModelTemplateError(
                    f"the model's chat template could not be rendered: {e}. The template "
                    "shipped in the model folder (chat_template.jinja, chat_template.json or "
                    "tokenizer_config.json) needs fixing; the request is not at fault"
                ) from None

        real = render(template, self._context(msgs, tools, add_generation_prompt, kwargs), cap)
        if not with_sentinels:
            return real, None

        # Render again with every client string replaced by a unique marker, then split there.
        nonce = secrets.token_hex(8)
        marker_re = re.compile("\ue000" + nonce + r":(\d+)\ue001")
        table: list[str] = []

        def to_marker(s: str) -> str:
            # Whitespace stays outside the marker so that templates which trim content
            # (Llama 3 does) still render the marker where the text goes.
            core = s.strip()
            if not core:
                return s
            lead, trail = s[: len(s) - len(s.lstrip())], s[len(s.rstrip()):]
            table.append(core)
            return f"{lead}\ue000{nonce}:{len(table) - 1}\ue001{trail}"

        s_msgs = map_message_strings(msgs, to_marker)
        s_tools = map_strings(tools, to_marker)
        s_kwargs = map_strings(kwargs, to_marker)
        marked = render(template, self._context(s_msgs, s_tools, add_generation_prompt,
                                                s_kwargs), cap + 64 * len(table))
        parts = marker_re.split(marked)
        # parts alternates template text and marker indices: [t0, i0, t1, i1, ..., tn]
        pieces: Pieces = []
        for k, part in enumerate(parts):
            if k % 2 == 0:
                pieces.append((part, True))
            else:
                idx = int(part)
                if idx >= len(table):
                    pieces = []
                    break
                pieces.append((table[idx], False))
        if pieces and "".join(p for p, _ in pieces) == real:
            return real, pieces
        if any(self._specials.found_in(s) for s in client_strings):
            raise ChatTemplateError(
                "message text contains special-token text and this chat template transforms "
                "message text, so it cannot be kept apart from the template's markers",
                "messages",
            )
        return real, None

"""Tokenizer and chat templates: Hugging Face tokenizer.json + tokenizer_config.json.

Guarantees: text a client sends (prompts, message content) is tokenized with special-token
text as plain text, so a user cannot forge role markers; only the chat template's own text can
produce special tokens. Templates render in jinja2's immutable sandbox with size caps.
Refuses: lone surrogates in text, malformed messages, client templates unless allowed.
"""

from __future__ import annotations

import functools
import json
import math
import re
import secrets
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from colibri.engine.errors import TokenIdError, check_token_ids
from colibri.engine.format.jsonfile import read_json_object

MAX_TEMPLATE_CHARS = 200_000
# The rendering is capped at a fixed allowance plus a multiple of the text the caller passed in,
# so long conversations render while a template that loops or multiplies strings cannot grow
# without bound.
RENDER_BASE_CHARS = 1 << 20
RENDER_INPUT_FACTOR = 4
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})

_SURROGATE = re.compile("[\ud800-\udfff]")


class TokenizerError(ValueError):
    """Bad input for the tokenizer; `param` names the offending request field when known."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ChatTemplateError(TokenizerError):
    """The chat template failed to compile or render (includes `raise_exception`)."""


class ChatTemplateRefused(ChatTemplateError):
    """A caller-supplied chat template was given but custom templates are not allowed."""


class TemplateLimitError(ChatTemplateError):
    """The render ran out of time or memory, or its output passed the size cap."""


class ModelTemplateError(RuntimeError):
    """The model's own chat template ran past a render limit: the model folder's template
    needs fixing, the request is not at fault (the server answers 500 and keeps serving)."""


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


# --- sandboxed jinja environment -------------------------------------------------------------


class _CappedEnvironment(ImmutableSandboxedEnvironment):
    """Immutable sandbox that also refuses string/list arithmetic producing huge values."""

    intercepted_binops = frozenset({"+", "*", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        limit = context.get("_clb_cap", RENDER_BASE_CHARS)
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                    if len(seq) * max(n, 0) > limit:
                        raise SecurityError("chat template builds a value over the size cap")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and right > 0:
                if abs(left) > 1 and right * math.log2(abs(left)) > 4096:
                    raise SecurityError("chat template computes a number over the size cap")
        elif operator == "+":
            if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
                if len(left) + len(right) > limit:
                    raise SecurityError("chat template builds a value over the size cap")
        return super().call_binop(context, operator, left, right)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


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
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _SafeNamespace
    return env


_ENV = _make_env()


@functools.lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    try:
        return _ENV.from_string(template)
    except TemplateError as e:
        raise ChatTemplateError(f"chat template does not compile: {e}", "chat_template") from e


def _render(template: str, context: dict[str, Any], cap: int) -> str:
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
    except Exception as e:  # a template is data: whatever it does wrong is a bad request
        raise ChatTemplateError(f"chat template failed to render: {e}", "messages") from e
    return "".join(out)


# --- messages ----------------------------------------------------------------------------------


def _plain(value: Any, param: str) -> Any:
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
            out[check_text(k, param)] = _plain(v, f"{param}.{k}")
        return out
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{param}[{i}]") for i, v in enumerate(value)]
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

    Content may be a string or a list of {"type": "text", "text": ...} parts (joined with
    newlines); None content is dropped (assistant messages that only carry tool calls).
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
                clean[key] = _plain(value, f"{param}.{key}")
        if "content" not in clean and role != "assistant":
            raise TokenizerError(f"{param}.content is required", param + ".content")
        out.append(clean)
    return out


def _map_strings(value: Any, fn: Any) -> Any:
    """Apply fn to every string leaf (not dict keys) of a JSON-like value."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_strings(v, fn) for v in value]
    return value


def _keys(value: Any) -> list[str]:
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


def _map_message_strings(messages: list[dict[str, Any]], fn: Any) -> list[dict[str, Any]]:
    """_map_strings over messages, leaving each role alone (templates branch on it)."""
    return [
        {k: (v if k == "role" else _map_strings(v, fn)) for k, v in m.items()} for m in messages
    ]


def _token_content(spec: Any) -> str | None:
    """A special-token entry in a config: a string, an AddedToken dict, or null."""
    if isinstance(spec, str):
        return spec
    if isinstance(spec, Mapping) and isinstance(spec.get("content"), str):
        return spec["content"]
    return None


def _read_json(path: Path) -> dict[str, Any]:
    return read_json_object(path, "tokenizer file") if path.is_file() else {}


def _named_templates(raw: Any) -> dict[str, str]:
    """A `chat_template` value (one string, or a list of {name, template}) as a dict."""
    if isinstance(raw, str):
        return {"default": raw}
    out: dict[str, str] = {}
    if isinstance(raw, list):
        for entry in raw:
            if isinstance(entry, Mapping) and isinstance(entry.get("template"), str):
                out[str(entry.get("name", "default"))] = entry["template"]
    return out


def _chat_templates(d: Path, cfg: dict[str, Any]) -> dict[str, str]:
    """The folder's chat templates by name, from the first place that has any, in the order
    transformers reads them: chat_template.jinja plus additional_chat_templates/*.jinja,
    then chat_template.json, then tokenizer_config.json's `chat_template`."""
    files: dict[str, str] = {}
    if (d / "chat_template.jinja").is_file():
        files["default"] = (d / "chat_template.jinja").read_text(encoding="utf-8")
    extra = d / "additional_chat_templates"
    if extra.is_dir():
        for f in sorted(extra.glob("*.jinja")):
            if f.is_file():
                files[f.name.removesuffix(".jinja")] = f.read_text(encoding="utf-8")
    if files:
        return files
    if (d / "chat_template.json").is_file():
        found = _named_templates(_read_json(d / "chat_template.json").get("chat_template"))
        if found:
            return found
    return _named_templates(cfg.get("chat_template"))


@dataclass(frozen=True)
class _Special:
    token_id: int
    lstrip: bool
    rstrip: bool


class Tokenizer:
    """A Hugging Face fast tokenizer with Colibri's safety rules for client text."""

    def __init__(
        self,
        hf: HFTokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
        chat_templates: Mapping[str, str] | None = None,
        extra_eos_token_ids: list[int] | None = None,
        extra_bos_token_id: int | None = None,
    ) -> None:
        # Two copies so that no shared flag is flipped per call (encoding runs in worker threads):
        # _tok recognises special-token text (template pieces), _plain treats it as plain text.
        self._tok = HFTokenizer.from_str(hf.to_str())
        self._tok.encode_special_tokens = False
        self._plain = HFTokenizer.from_str(hf.to_str())
        self._plain.encode_special_tokens = True
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_token, self.eos_token = bos_token, eos_token
        self.pad_token, self.unk_token = pad_token, unk_token
        self.add_bos_token, self.add_eos_token = add_bos_token, add_eos_token
        self.chat_templates: dict[str, str] = dict(chat_templates or {})
        self.chat_template: str | None = self.chat_templates.get("default")

        self.bos_token_id: int | None = self._id_of(bos_token)
        if self.bos_token_id is None and extra_bos_token_id is not None:
            self.bos_token_id = extra_bos_token_id
        self.eos_token_id: int | None = self._id_of(eos_token)
        eos = {self.eos_token_id} if self.eos_token_id is not None else set()
        for tid in extra_eos_token_ids or []:
            if 0 <= tid < self.vocab_size:
                eos.add(tid)
        self.eos_token_ids: set[int] = eos
        self.pad_token_id: int | None = self._id_of(pad_token)

        self._specials: dict[str, _Special] = {}
        for tid, added in self._tok.get_added_tokens_decoder().items():
            if added.special:
                self._specials[added.content] = _Special(tid, added.lstrip, added.rstrip)
        self.special_token_ids: frozenset[int] = frozenset(
            s.token_id for s in self._specials.values()
        )
        names = sorted(self._specials, key=len, reverse=True)
        self._special_re = re.compile("|".join(re.escape(n) for n in names)) if names else None

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json and optional special_tokens_map.json,
        generation_config.json, chat_template.jinja / chat_template.json from a directory."""
        d = Path(path)
        tj = d / "tokenizer.json"
        if not tj.is_file():
            raise FileNotFoundError(f"{tj} not found (only fast tokenizers are supported)")
        try:
            hf = HFTokenizer.from_file(str(tj))
        except Exception as e:  # the Rust parser raises a bare Exception ("EOF while parsing")
            raise ValueError(f"{tj}: not a valid tokenizer.json ({e})") from None
        cfg = _read_json(d / "tokenizer_config.json")
        smap = _read_json(d / "special_tokens_map.json")
        gen = _read_json(d / "generation_config.json")

        def special(name: str) -> str | None:
            tok = _token_content(cfg.get(name))
            return tok if tok is not None else _token_content(smap.get(name))

        templates = _chat_templates(d, cfg)
        for name, text in templates.items():
            if len(text) > MAX_TEMPLATE_CHARS:
                raise ValueError(f"chat template {name!r} is over {MAX_TEMPLATE_CHARS} characters")

        gen_eos = gen.get("eos_token_id")
        extra_eos = gen_eos if isinstance(gen_eos, list) else [gen_eos]
        gen_bos = gen.get("bos_token_id")
        return cls(
            hf,
            bos_token=special("bos_token"),
            eos_token=special("eos_token"),
            pad_token=special("pad_token"),
            unk_token=special("unk_token"),
            add_bos_token=bool(cfg.get("add_bos_token", False)),
            add_eos_token=bool(cfg.get("add_eos_token", False)),
            chat_templates=templates,
            extra_eos_token_ids=[t for t in extra_eos if type(t) is int],
            extra_bos_token_id=gen_bos if type(gen_bos) is int else None,
        )

    def to_json(self) -> str:
        """The tokenizer.json text (for libraries that build their own view of the vocabulary)."""
        return str(self._tok.to_str())

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    # --- plain text ----------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text; special-token text inside it is tokenized as plain text.

        add_special_tokens adds what the tokenizer adds around a sequence (its post-processor,
        and BOS / EOS when tokenizer_config asks for them). Raises TokenizerError on lone
        surrogates.
        """
        check_text(text, "prompt")
        ids = self._plain.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens:
            if self.add_bos_token and self.bos_token_id is not None:
                if not ids or ids[0] != self.bos_token_id:
                    ids.insert(0, self.bos_token_id)
            if self.add_eos_token and self.eos_token_id is not None:
                if not ids or ids[-1] != self.eos_token_id:
                    ids.append(self.eos_token_id)
        return ids

    def special_token_id(self, text: str) -> int | None:
        """The id of the special token spelled exactly `text`, else None."""
        special = self._specials.get(text)
        return None if special is None else special.token_id

    def check_ids(self, ids: Any, param: str = "prompt") -> list[int]:
        """Return ids as a list of ints, raising TokenizerError if any is not an id of the
        vocabulary (the engine's one check of ids); an empty list is allowed."""
        try:
            return check_token_ids(ids, self.vocab_size, param, allow_empty=True)
        except TokenIdError as exc:
            raise TokenizerError(str(exc), param) from None

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        """Text of token ids (invalid UTF-8 byte sequences become U+FFFD)."""
        return self._tok.decode(self.check_ids(ids, "ids"), skip_special_tokens=skip_special_tokens)

    def id_to_piece(self, token_id: int) -> str:
        """The vocabulary entry of a token (byte-level pieces are shown in their mapped form)."""
        piece = self._tok.id_to_token(int(token_id))
        if piece is None:
            raise TokenizerError(f"token id {token_id} is outside the vocabulary", "ids")
        return piece

    def contains_special_text(self, text: str) -> bool:
        """Whether text contains the text of any special token."""
        return self._special_re is not None and self._special_re.search(text) is not None

    # --- chat ------------------------------------------------------------------------------------

    def _template(self, chat_template: str | None, allow_custom_template: bool) -> str:
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
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template", "messages")
        return self.chat_template

    def _context(
        self,
        messages: list[dict[str, Any]],
        tools: Any,
        add_generation_prompt: bool,
        template_kwargs: dict[str, Any],
    ) -> dict[str, Any]:
        ctx: dict[str, Any] = dict(template_kwargs)
        ctx.update(
            messages=messages,
            tools=tools,
            add_generation_prompt=bool(add_generation_prompt),
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            pad_token=self.pad_token or "",
            unk_token=self.unk_token or "",
        )
        return ctx

    def render_chat(
        self,
        messages: Any,
        add_generation_prompt: bool = True,
        *,
        chat_template: str | None = None,
        allow_custom_template: bool = False,
        tools: Any = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The chat template's text for messages (for display and debugging)."""
        text, _ = self._render_both(
            messages, add_generation_prompt, chat_template, allow_custom_template, tools,
            template_kwargs, with_sentinels=False,
        )
        return text

    def apply_chat_template(
        self,
        messages: Any,
        add_generation_prompt: bool = True,
        *,
        chat_template: str | None = None,
        allow_custom_template: bool = False,
        tools: Any = None,
        template_kwargs: Mapping[str, Any] | None = None,
        render_timeout_s: float = 2.0,
        cancel: threading.Event | None = None,
    ) -> list[int]:
        """Token ids of the rendered chat. Special tokens come only from the template's text;
        message content (and every other string the client sent) is tokenized as plain text.

        chat_template: a caller-supplied template, refused (ChatTemplateRefused) unless
        allow_custom_template. Any template, this one or the model's, renders in a separate
        process (engine.text.template_sandbox), stopped after render_timeout_s or as soon as
        `cancel` is set. Raises TokenizerError / ChatTemplateError on bad input (a client
        template past a limit: TemplateLimitError), ModelTemplateError when the model's own
        template runs past a limit.
        """
        real, pieces = self._render_both(
            messages, add_generation_prompt, chat_template, allow_custom_template, tools,
            template_kwargs, with_sentinels=True, render_timeout_s=render_timeout_s,
            cancel=cancel,
        )
        if pieces is None:
            # The template transformed the client's strings (e.g. escaped or split them), so
            # they cannot be told apart from template text. That is only safe when no client
            # string contains special-token text; _render_both checked that.
            return self._encode_segments([(real, True)])
        return self._encode_segments(pieces)

    def _render_both(
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
    ) -> tuple[str, list[tuple[str, bool]] | None]:
        template = self._template(chat_template, allow_custom_template)
        msgs = normalize_messages(messages)
        tools = _plain(tools, "tools") if tools is not None else None
        kwargs = _plain(dict(template_kwargs), "chat_template_kwargs") if template_kwargs else {}
        client_strings: list[str] = []
        _map_message_strings(msgs, client_strings.append)
        _map_strings(tools, client_strings.append)
        _map_strings(kwargs, client_strings.append)
        named = (("messages", msgs), ("tools", tools), ("chat_template_kwargs", kwargs))
        for param, value in named:
            # Keys are not replaced by markers below, so they must not carry special tokens.
            if any(self.contains_special_text(k) for k in _keys(value)):
                raise TokenizerError(f"{param} has a key containing special-token text", param)
        cap = RENDER_BASE_CHARS + RENDER_INPUT_FACTOR * sum(len(s) for s in client_strings)
        # Every template, the model's and a client's, renders in a process that is stopped
        # after render_timeout_s, at its memory limit or when `cancel` is set.
        from colibri.engine.text.template_sandbox import SANDBOX

        def render(t: str, ctx: dict[str, Any], c: int) -> str:
            try:
                return SANDBOX.render(t, ctx, c, render_timeout_s, cancel)
            except TemplateLimitError as e:
                if chat_template is not None:
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

        s_msgs = _map_message_strings(msgs, to_marker)
        s_tools = _map_strings(tools, to_marker)
        s_kwargs = _map_strings(kwargs, to_marker)
        marked = render(template, self._context(s_msgs, s_tools, add_generation_prompt,
                                                s_kwargs), cap + 64 * len(table))
        parts = marker_re.split(marked)
        # parts alternates template text and marker indices: [t0, i0, t1, i1, ..., tn]
        pieces: list[tuple[str, bool]] = []
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
        if any(self.contains_special_text(s) for s in client_strings):
            raise ChatTemplateError(
                "message text contains special-token text and this chat template transforms "
                "message text, so it cannot be kept apart from the template's markers",
                "messages",
            )
        return real, None

    def _encode_segments(self, pieces: list[tuple[str, bool]]) -> list[int]:
        """Encode [(text, is_template)]: special tokens recognised in template text only.

        Text between template special tokens is joined and encoded as one run, as the HF
        tokenizer does with a whole string (it splits at added tokens first), so the ids
        equal encoding the full rendering whenever client text has no special-token text.
        """
        out: list[int] = []
        run: list[str] = []

        def flush_run(strip_right: bool) -> None:
            text = "".join(run)
            run.clear()
            if strip_right:
                text = text.rstrip()
            if text:
                out.extend(self._plain.encode(text, add_special_tokens=False).ids)

        strip_next_left = False
        for text, is_template in pieces:
            if not is_template or self._special_re is None:
                if strip_next_left:
                    text = text.lstrip()
                    strip_next_left = bool(text == "")
                run.append(text)
                continue
            pos = 0
            for m in self._special_re.finditer(text):
                chunk = text[pos:m.start()]
                if strip_next_left:
                    chunk = chunk.lstrip()
                run.append(chunk)
                sp = self._specials[m.group(0)]
                flush_run(sp.lstrip)
                out.append(sp.token_id)
                strip_next_left = sp.rstrip
                pos = m.end()
            rest = text[pos:]
            if strip_next_left:
                rest = rest.lstrip()
                strip_next_left = bool(rest == "")
            run.append(rest)
        flush_run(False)
        return out

"""Tokenizer: encode and decode with a Hugging Face fast tokenizer, under Colibri's rule for
client text.

Guarantees: text a client sends (prompts, message content) is tokenized with special-token
text as plain text, so a user cannot forge role markers; only the chat template's own text can
produce special tokens (chat.py renders, special_tokens.py encodes the pieces). Loading reads
the folder through tokenizer_files.py.
Refuses: lone surrogates in text, ids outside the vocabulary.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from colibri.engine.errors import TokenIdError, check_token_ids
from colibri.engine.text.chat import ChatTemplates
from colibri.engine.text.errors import TokenizerError
from colibri.engine.text.messages import check_text
from colibri.engine.text.special_tokens import SpecialTokens
from colibri.engine.text.tokenizer_files import read_tokenizer_files


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

        self._specials = SpecialTokens(self._tok)
        self.special_token_ids: frozenset[int] = self._specials.ids
        strings = {"bos_token": bos_token, "eos_token": eos_token, "pad_token": pad_token,
                   "unk_token": unk_token}
        self._chat = ChatTemplates(chat_templates or {}, strings, self._specials)
        self.chat_templates: dict[str, str] = self._chat.templates
        self.chat_template: str | None = self._chat.default

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json and optional special_tokens_map.json,
        generation_config.json, chat_template.jinja / chat_template.json from a directory."""
        files = read_tokenizer_files(path)
        return cls(files.hf, **files.settings())

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
        return self._specials.id_of(text)

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

    def split_special(self, text: str) -> list[str | int]:
        """text as its plain pieces and the ids of the special tokens spelled in it (what a
        grammar must allow as those tokens, not as their text)."""
        return self._specials.split(text)

    def contains_special_text(self, text: str) -> bool:
        """Whether text contains the text of any special token."""
        return self._specials.found_in(text)

    # --- chat ------------------------------------------------------------------------------------

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
        text, _ = self._chat.render(
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
        real, pieces = self._chat.render(
            messages, add_generation_prompt, chat_template, allow_custom_template, tools,
            template_kwargs, with_sentinels=True, render_timeout_s=render_timeout_s,
            cancel=cancel,
        )
        if pieces is None:
            # The template transformed the client's strings (e.g. escaped or split them), so
            # they cannot be told apart from template text. That is only safe when no client
            # string contains special-token text; ChatTemplates.render checked that.
            pieces = [(real, True)]
        return self._specials.encode_segments(pieces, self._encode_plain)

    def _encode_plain(self, text: str) -> list[int]:
        return self._plain.encode(text, add_special_tokens=False).ids

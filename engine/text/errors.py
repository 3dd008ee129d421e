"""Errors of the text layer: client text the tokenizer refuses, and chat templates that fail to
compile or render, or run past a limit.

Each is a ValueError (a bad request) whose `param` names the request field at fault, except
ModelTemplateError: there the model folder's own template is at fault, not the request.
"""

from __future__ import annotations


class TokenizerError(ValueError):
    """Bad input for the tokenizer; `param` names the offending request field when known."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ChatTemplateError(TokenizerError):
    """The chat template failed to compile or render (includes `raise_exception`)."""


class ChatTemplateRefused(ChatTemplateError):
    """A caller-supplied chat template was given but custom templates are not allowed."""


class TemplateFaultError(ChatTemplateError):
    """The template itself is at fault whatever the input: it does not compile, or it reaches
    past the sandbox (`__globals__`, `include`). Not a `raise_exception` of its own (it refuses
    the input it was given) nor a render that breaks on unusual messages (a bad request)."""


class TemplateLimitError(ChatTemplateError):
    """The render ran out of time or memory, or its output passed the size cap."""


class ModelTemplateError(RuntimeError):
    """The model's own chat template ran past a render limit or is at fault whatever the input
    (TemplateFaultError): the model folder's template needs fixing, the request is not at fault
    (the server answers 500 and keeps serving)."""

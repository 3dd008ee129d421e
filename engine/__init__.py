"""Colibri engine: model format, converter, C forward pass, tokenizer and sampler.

The server (app/) uses only what this module exports. Exports resolve lazily, so importing
a light submodule (colibri.engine.format.quant, .format.convert) never loads the C extension.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    # the Python API
    "LLM": "colibri.engine.llm",
    "SamplingParams": "colibri.engine.sample.sampler",
    "convert": "colibri.engine.format.convert",
    "ModelError": "colibri.engine.format.modelcheck",
    # the engine boundary: what the server drives and how it loads it
    "EngineClient": "colibri.engine.core.client",
    "ModelInfo": "colibri.engine.core.client",
    "RequestOutput": "colibri.engine.core.request",
    "AsyncEngine": "colibri.engine.core.async_engine",
    "AsyncEngineConfig": "colibri.engine.core.async_engine",
    "EngineCore": "colibri.engine.core.engine",
    "EngineConfig": "colibri.engine.core.loader",
    "engine_loader": "colibri.engine.core.loader",
    # errors a request can meet
    "ContextLengthError": "colibri.engine.core.engine",
    "EngineUnavailableError": "colibri.engine.core.async_engine",
    "QueueFullError": "colibri.engine.core.async_engine",
    "ModelFaultError": "colibri.engine.errors",
    "TokenIdError": "colibri.engine.errors",
    "SamplingParamError": "colibri.engine.sample.sampler",
    "ModelTemplateError": "colibri.engine.text.errors",
    "ConstraintError": "colibri.engine.sample.constraints",
    # checks of a request's fields
    "check_token_ids": "colibri.engine.errors",
    "MIN_REPETITION_PENALTY": "colibri.engine.sample.sampler",
    "join_text_parts": "colibri.engine.text.messages",
    # chat prompts, tool calls and output constraints
    "ChatPlan": "colibri.engine.core.chat_plan",
    "plan_chat": "colibri.engine.core.chat_plan",
    "render_chat": "colibri.engine.core.chat_plan",
    "ToolCall": "colibri.engine.text.reply_types",
    "ParsedReply": "colibri.engine.text.reply_types",
    "ReplyDelta": "colibri.engine.text.reply_types",
    "parse_reply": "colibri.engine.text.reply",
    "ConstraintSpec": "colibri.engine.sample.constraints",
    "compile_constraints": "colibri.engine.sample.constraints",
    # the command line and its options table
    "options": "colibri.engine.core.options",
    "check_model": "colibri.engine.format.modelcheck",
    "cli_main": "colibri.engine.tools.cli",
}

__all__ = [
    "__version__",
    "LLM",
    "SamplingParams",
    "convert",
    "ModelError",
    "EngineClient",
    "ModelInfo",
    "RequestOutput",
    "AsyncEngine",
    "AsyncEngineConfig",
    "EngineCore",
    "EngineConfig",
    "engine_loader",
    "ContextLengthError",
    "EngineUnavailableError",
    "QueueFullError",
    "ModelFaultError",
    "TokenIdError",
    "SamplingParamError",
    "ModelTemplateError",
    "ConstraintError",
    "check_token_ids",
    "MIN_REPETITION_PENALTY",
    "join_text_parts",
    "ChatPlan",
    "plan_chat",
    "render_chat",
    "ToolCall",
    "ParsedReply",
    "ReplyDelta",
    "parse_reply",
    "ConstraintSpec",
    "compile_constraints",
    "options",
    "check_model",
    "cli_main",
]

if TYPE_CHECKING:  # pragma: no cover
    from colibri.engine.core import options
    from colibri.engine.core.async_engine import (
        AsyncEngine,
        AsyncEngineConfig,
        EngineUnavailableError,
        QueueFullError,
    )
    from colibri.engine.core.chat_plan import ChatPlan, plan_chat, render_chat
    from colibri.engine.core.client import EngineClient, ModelInfo
    from colibri.engine.core.engine import ContextLengthError, EngineCore
    from colibri.engine.core.loader import EngineConfig, engine_loader
    from colibri.engine.core.request import RequestOutput
    from colibri.engine.errors import ModelFaultError, TokenIdError, check_token_ids
    from colibri.engine.format.convert import convert
    from colibri.engine.format.modelcheck import ModelError, check_model
    from colibri.engine.llm import LLM
    from colibri.engine.sample.constraints import (
        ConstraintError,
        ConstraintSpec,
        compile_constraints,
    )
    from colibri.engine.sample.sampler import (
        MIN_REPETITION_PENALTY,
        SamplingParamError,
        SamplingParams,
    )
    from colibri.engine.text.errors import ModelTemplateError
    from colibri.engine.text.messages import join_text_parts
    from colibri.engine.text.reply import parse_reply
    from colibri.engine.text.reply_types import ParsedReply, ReplyDelta, ToolCall
    from colibri.engine.tools.cli import main as cli_main


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'colibri.engine' has no attribute {name!r}")
    if name == "options":
        value: Any = importlib.import_module(module)
    else:
        value = getattr(importlib.import_module(module), "main" if name == "cli_main" else name)
    globals()[name] = value
    return value

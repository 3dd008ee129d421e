"""Colibri engine: model format, converter, C forward pass, tokenizer and sampler.

The server (app/) uses only what this module exports. Exports resolve lazily, so importing
a light submodule (engine.quant, engine.convert) never loads the C extension.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "engine.llm",
    "StepOutput": "engine.llm",
    "ContextLengthError": "engine.core.engine",
    "default_model_path": "engine.llm",
    "SamplingParams": "engine.sampling",
    "AsyncEngine": "engine.core.async_engine",
    "AsyncEngineConfig": "engine.core.async_engine",
    "EngineUnavailableError": "engine.core.async_engine",
    "QueueFullError": "engine.core.async_engine",
    "RequestOutput": "engine.core.request",
    "EngineConfig": "engine.core.loader",
    "ModelFaultError": "engine.errors",
    "MIN_REPETITION_PENALTY": "engine.sampling",
    "SamplingParamError": "engine.sampling",
    "Tokenizer": "engine.tokenizer",
    "ConstraintCompiler": "engine.constraints",
    "ConstraintError": "engine.constraints",
    "ConstraintSpec": "engine.constraints",
    "ToolCall": "engine.toolcalls",
    "ToolCallParser": "engine.toolcalls",
    "template_tools": "engine.toolcalls",
    "forced_calls_schema": "engine.toolcalls",
    "forced_calls": "engine.toolcalls",
    "generic_preamble": "engine.toolcalls",
    "history_call_text": "engine.toolcalls",
    "convert": "engine.convert",
    "DEFAULT_QUANT": "engine.convert",
    "QUANT_PRESETS": "engine.convert",
    "ModelError": "engine.modelcheck",
    "check_model": "engine.modelcheck",
    "ensure_converted": "engine.convert",
    "cli_main": "engine.cli",
}

__all__ = [
    "DEFAULT_QUANT",
    "LLM",
    "MIN_REPETITION_PENALTY",
    "ConstraintCompiler",
    "ConstraintError",
    "ConstraintSpec",
    "ToolCall",
    "ToolCallParser",
    "forced_calls",
    "forced_calls_schema",
    "generic_preamble",
    "history_call_text",
    "template_tools",
    "AsyncEngine",
    "AsyncEngineConfig",
    "EngineConfig",
    "EngineUnavailableError",
    "QueueFullError",
    "RequestOutput",
    "ContextLengthError",
    "ModelError",
    "QUANT_PRESETS",
    "ModelFaultError",
    "SamplingParamError",
    "SamplingParams",
    "StepOutput",
    "Tokenizer",
    "__version__",
    "check_model",
    "cli_main",
    "convert",
    "default_model_path",
    "ensure_converted",
]

if TYPE_CHECKING:  # pragma: no cover
    from engine.cli import main as cli_main
    from engine.constraints import ConstraintCompiler, ConstraintError, ConstraintSpec
    from engine.convert import DEFAULT_QUANT, QUANT_PRESETS, convert, ensure_converted
    from engine.core.async_engine import (
        AsyncEngine,
        AsyncEngineConfig,
        EngineUnavailableError,
        QueueFullError,
    )
    from engine.core.engine import ContextLengthError
    from engine.core.loader import EngineConfig
    from engine.core.request import RequestOutput
    from engine.errors import ModelFaultError
    from engine.llm import LLM, StepOutput, default_model_path
    from engine.modelcheck import ModelError, check_model
    from engine.sampling import MIN_REPETITION_PENALTY, SamplingParamError, SamplingParams
    from engine.tokenizer import Tokenizer
    from engine.toolcalls import (
        ToolCall,
        ToolCallParser,
        forced_calls,
        forced_calls_schema,
        generic_preamble,
        history_call_text,
        template_tools,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    attr = "main" if name == "cli_main" else name
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value

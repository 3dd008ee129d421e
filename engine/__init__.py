"""Colibri engine: model format, converter, C forward pass, tokenizer and sampler.

The server (app/) uses only what this module exports. Exports resolve lazily, so importing
a light submodule (engine.format.quant, engine.format.convert) never loads the C extension.
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
    "SamplingParams": "engine.sample.sampler",
    "AsyncEngine": "engine.core.async_engine",
    "AsyncEngineConfig": "engine.core.async_engine",
    "EngineUnavailableError": "engine.core.async_engine",
    "QueueFullError": "engine.core.async_engine",
    "RequestOutput": "engine.core.request",
    "EngineConfig": "engine.core.loader",
    "ExpertCacheConfig": "engine.executor.expert_cache",
    "add_expert_cache_args": "engine.tools.cache_args",
    "KV_CACHE_TYPES": "engine.tools.cache_args",
    "ModelFaultError": "engine.errors",
    "TokenIdError": "engine.errors",
    "check_token_ids": "engine.errors",
    "MIN_REPETITION_PENALTY": "engine.sample.sampler",
    "SamplingParamError": "engine.sample.sampler",
    "Tokenizer": "engine.text.tokenizer",
    "join_text_parts": "engine.text.tokenizer",
    "ModelTemplateError": "engine.text.tokenizer",
    "ConstraintCompiler": "engine.sample.constraints",
    "ConstraintError": "engine.sample.constraints",
    "ConstraintSpec": "engine.sample.constraints",
    "ToolCall": "engine.text.toolcalls",
    "ToolCallParser": "engine.text.toolcalls",
    "template_tools": "engine.text.toolcalls",
    "forced_calls_schema": "engine.text.toolcalls",
    "forced_calls": "engine.text.toolcalls",
    "generic_preamble": "engine.text.toolcalls",
    "history_call_text": "engine.text.toolcalls",
    "convert": "engine.format.convert",
    "DEFAULT_QUANT": "engine.format.convert",
    "QUANT_PRESETS": "engine.format.convert",
    "ModelError": "engine.format.modelcheck",
    "check_model": "engine.format.modelcheck",
    "ensure_converted": "engine.format.convert",
    "cli_main": "engine.tools.cli",
}

__all__ = [
    "DEFAULT_QUANT",
    "KV_CACHE_TYPES",
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
    "ExpertCacheConfig",
    "add_expert_cache_args",
    "EngineUnavailableError",
    "QueueFullError",
    "RequestOutput",
    "ContextLengthError",
    "ModelError",
    "QUANT_PRESETS",
    "ModelFaultError",
    "ModelTemplateError",
    "SamplingParamError",
    "SamplingParams",
    "StepOutput",
    "TokenIdError",
    "Tokenizer",
    "__version__",
    "check_model",
    "check_token_ids",
    "cli_main",
    "convert",
    "default_model_path",
    "ensure_converted",
    "join_text_parts",
]

if TYPE_CHECKING:  # pragma: no cover
    from engine.core.async_engine import (
        AsyncEngine,
        AsyncEngineConfig,
        EngineUnavailableError,
        QueueFullError,
    )
    from engine.core.engine import ContextLengthError
    from engine.core.loader import EngineConfig
    from engine.core.request import RequestOutput
    from engine.errors import ModelFaultError, TokenIdError, check_token_ids
    from engine.executor.expert_cache import ExpertCacheConfig
    from engine.format.convert import DEFAULT_QUANT, QUANT_PRESETS, convert, ensure_converted
    from engine.format.modelcheck import ModelError, check_model
    from engine.llm import LLM, StepOutput, default_model_path
    from engine.sample.constraints import ConstraintCompiler, ConstraintError, ConstraintSpec
    from engine.sample.sampler import MIN_REPETITION_PENALTY, SamplingParamError, SamplingParams
    from engine.text.tokenizer import ModelTemplateError, Tokenizer
    from engine.text.toolcalls import (
        ToolCall,
        ToolCallParser,
        forced_calls,
        forced_calls_schema,
        generic_preamble,
        history_call_text,
        template_tools,
    )
    from engine.tools.cache_args import KV_CACHE_TYPES, add_expert_cache_args
    from engine.tools.cli import main as cli_main


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    attr = "main" if name == "cli_main" else name
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value

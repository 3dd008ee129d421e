"""Colibri engine: model format, converter, C forward pass, tokenizer and sampler.

The server (app/) uses only what this module exports. Exports resolve lazily, so importing
a light submodule (engine.format.quant, engine.format.convert) never loads the C extension.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "colibri.engine.llm",
    "StepOutput": "colibri.engine.llm",
    "ContextLengthError": "colibri.engine.core.engine",
    "default_model_path": "colibri.engine.llm",
    "SamplingParams": "colibri.engine.sample.sampler",
    "AsyncEngine": "colibri.engine.core.async_engine",
    "EngineClient": "colibri.engine.core.client",
    "ModelInfo": "colibri.engine.core.client",
    "EngineCore": "colibri.engine.core.engine",
    "engine_loader": "colibri.engine.core.loader",
    "AsyncEngineConfig": "colibri.engine.core.async_engine",
    "EngineUnavailableError": "colibri.engine.core.async_engine",
    "QueueFullError": "colibri.engine.core.async_engine",
    "RequestOutput": "colibri.engine.core.request",
    "EngineConfig": "colibri.engine.core.loader",
    "ExpertCacheConfig": "colibri.engine.core.options",
    "OPTION": "colibri.engine.core.options",
    "add_option_args": "colibri.engine.core.options",
    "command_options": "colibri.engine.core.options",
    "engine_env_variables": "colibri.engine.core.options",
    "add_expert_cache_args": "colibri.engine.tools.cache_args",
    "KV_CACHE_TYPES": "colibri.engine.tools.cache_args",
    "ModelFaultError": "colibri.engine.errors",
    "TokenIdError": "colibri.engine.errors",
    "check_token_ids": "colibri.engine.errors",
    "MIN_REPETITION_PENALTY": "colibri.engine.sample.sampler",
    "SamplingParamError": "colibri.engine.sample.sampler",
    "Tokenizer": "colibri.engine.text.tokenizer",
    "join_text_parts": "colibri.engine.text.messages",
    "ModelTemplateError": "colibri.engine.text.errors",
    "ConstraintCompiler": "colibri.engine.sample.constraints",
    "ConstraintError": "colibri.engine.sample.constraints",
    "ConstraintSpec": "colibri.engine.sample.constraints",
    "ToolCall": "colibri.engine.text.toolcalls",
    "ToolCallParser": "colibri.engine.text.toolcalls",
    "template_tools": "colibri.engine.text.toolcalls",
    "forced_calls_schema": "colibri.engine.text.toolcalls",
    "forced_calls": "colibri.engine.text.toolcalls",
    "generic_preamble": "colibri.engine.text.toolcalls",
    "history_call_text": "colibri.engine.text.toolcalls",
    "convert": "colibri.engine.format.convert",
    "DEFAULT_QUANT": "colibri.engine.format.convert",
    "QUANT_PRESETS": "colibri.engine.format.convert",
    "ModelError": "colibri.engine.format.modelcheck",
    "check_model": "colibri.engine.format.modelcheck",
    "ensure_converted": "colibri.engine.format.convert",
    "cli_main": "colibri.engine.tools.cli",
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
    "EngineClient",
    "EngineCore",
    "ModelInfo",
    "engine_loader",
    "AsyncEngineConfig",
    "EngineConfig",
    "ExpertCacheConfig",
    "OPTION",
    "add_option_args",
    "command_options",
    "engine_env_variables",
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
    from colibri.engine.core.async_engine import (
        AsyncEngine,
        AsyncEngineConfig,
        EngineUnavailableError,
        QueueFullError,
    )
    from colibri.engine.core.client import EngineClient, ModelInfo
    from colibri.engine.core.engine import ContextLengthError, EngineCore
    from colibri.engine.core.loader import EngineConfig, engine_loader
    from colibri.engine.core.options import (
        OPTION,
        ExpertCacheConfig,
        add_option_args,
        command_options,
        engine_env_variables,
    )
    from colibri.engine.core.request import RequestOutput
    from colibri.engine.errors import ModelFaultError, TokenIdError, check_token_ids
    from colibri.engine.format.convert import (
        DEFAULT_QUANT,
        QUANT_PRESETS,
        convert,
        ensure_converted,
    )
    from colibri.engine.format.modelcheck import ModelError, check_model
    from colibri.engine.llm import LLM, StepOutput, default_model_path
    from colibri.engine.sample.constraints import (
        ConstraintCompiler,
        ConstraintError,
        ConstraintSpec,
    )
    from colibri.engine.sample.sampler import (
        MIN_REPETITION_PENALTY,
        SamplingParamError,
        SamplingParams,
    )
    from colibri.engine.text.errors import ModelTemplateError
    from colibri.engine.text.messages import join_text_parts
    from colibri.engine.text.tokenizer import Tokenizer
    from colibri.engine.text.toolcalls import (
        ToolCall,
        ToolCallParser,
        forced_calls,
        forced_calls_schema,
        generic_preamble,
        history_call_text,
        template_tools,
    )
    from colibri.engine.tools.cache_args import KV_CACHE_TYPES, add_expert_cache_args
    from colibri.engine.tools.cli import main as cli_main


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'colibri.engine' has no attribute {name!r}")
    attr = "main" if name == "cli_main" else name
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value

"""Server settings: command-line options over COLIBRI_* environment variables over `.env`.

Each field is an option of the engine's options table (`colibri.engine.options.OPTION`):
its default, description and limits come from there, and one check (Option.check)
validates the field whether it came from a flag, the environment or `.env`. The field names and
types are written here so code that reads `settings.max_queue` is typed; tests/test_options.py
holds them to the table. The defaults are the safe ones (bind to 127.0.0.1, no CORS, client
chat templates refused).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, SecretStr, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from colibri.engine import options


def _option(name: str) -> Any:
    """The pydantic field of option `name`: its default and help from the table."""
    o = options.OPTION[name]
    if isinstance(o.default, list):
        return Field(default_factory=lambda: list(o.default), description=o.help)
    return Field(o.default, description=o.help)


class Settings(BaseSettings):
    """Everything `colibri serve` can be told."""

    # an empty variable (COLIBRI_THREADS=) means unset, so .env.example copied as it is works
    model_config = SettingsConfigDict(
        env_prefix="COLIBRI_", env_file=".env", env_file_encoding="utf-8", extra="ignore",
        env_ignore_empty=True,
    )

    # -- model ------------------------------------------------------------------------
    model: str | None = _option("model")
    served_model_name: str | None = _option("served_model_name")
    accept_any_model: bool = _option("accept_any_model")
    quant: str = _option("quant")
    threads: int | None = _option("threads")
    device: str = _option("device")
    gpu_memory_mb: float | None = _option("gpu_memory_mb")
    device_profile: str | None = _option("device_profile")
    n_ctx: int | None = _option("n_ctx")

    # -- batching and KV cache --------------------------------------------------------
    max_num_seqs: int = _option("max_num_seqs")
    max_num_batched_tokens: int = _option("max_num_batched_tokens")
    prefill_tokens_while_decoding: int = _option("prefill_tokens_while_decoding")
    kv_cache_mb: float | None = _option("kv_cache_mb")
    kv_cache_type: Literal["auto", "f32", "f16", "q8"] = _option("kv_cache_type")
    prefix_cache: bool = _option("prefix_cache")
    kv_window_pool: bool = _option("kv_window_pool")

    # -- expert cache -----------------------------------------------------------------
    expert_cache_mb: float | None = _option("expert_cache_mb")
    expert_cache_size: int | None = _option("expert_cache_size")
    prefetch_window: int = _option("prefetch_window")
    expert_load: Literal["auto", "direct", "pread", "mmap", "uring"] = _option("expert_load")
    expert_prefetch: bool = _option("expert_prefetch")
    expert_pin: bool = _option("expert_pin")
    expert_huge_pages: bool = _option("expert_huge_pages")
    expert_prefetch_depth: Literal["auto", "1", "2"] = _option("expert_prefetch_depth")
    expert_readers: int | None = _option("expert_readers")
    expert_read_timeout_s: float = _option("expert_read_timeout_s")

    # -- speculative decoding ---------------------------------------------------------
    speculative: Literal["off", "auto", "ngram", "mtp"] = _option("speculative")
    num_speculative_tokens: int | None = _option("num_speculative_tokens")

    # -- network ----------------------------------------------------------------------
    host: str = _option("host")
    port: int = _option("port")
    api_key: SecretStr | None = _option("api_key")
    cors_origins: list[str] = _option("cors_origins")
    allowed_hosts: list[str] = _option("allowed_hosts")
    log_level: str = _option("log_level")
    docs: bool = _option("docs")

    # -- limits -----------------------------------------------------------------------
    max_queue: int = _option("max_queue")
    retry_after_s: int = _option("retry_after_s")
    max_body_bytes: int = _option("max_body_bytes")
    max_header_bytes: int = _option("max_header_bytes")
    max_n: int = _option("max_n")
    max_stop: int = _option("max_stop")
    max_stop_chars: int = _option("max_stop_chars")
    max_logprobs: int = _option("max_logprobs")
    send_timeout_s: float = _option("send_timeout_s")
    header_timeout_s: float = _option("header_timeout_s")
    body_timeout_s: float = _option("body_timeout_s")
    constraint_timeout_s: float = _option("constraint_timeout_s")
    max_connections: int = _option("max_connections")
    drain_timeout_s: float = _option("drain_timeout_s")

    # -- chat templates ---------------------------------------------------------------
    allow_client_chat_template: bool = _option("allow_client_chat_template")
    max_chat_template_chars: int = _option("max_chat_template_chars")
    client_template_timeout_s: float = _option("client_template_timeout_s")
    model_template_timeout_s: float = _option("model_template_timeout_s")

    # -- replicas (Ray Serve) ---------------------------------------------------------
    replicas: int = _option("replicas")
    min_replicas: int | None = _option("min_replicas")
    max_replicas: int | None = _option("max_replicas")
    replica_routing: Literal["prefix", "round_robin"] = _option("replica_routing")
    replica_gpus: float = _option("replica_gpus")
    ray_address: str | None = _option("ray_address")

    @field_validator("*")
    @classmethod
    def _within_limits(cls, v: Any, info: ValidationInfo) -> Any:
        """The option's own check: the same limits as the engine's commands apply."""
        name = str(info.field_name)
        try:
            return options.OPTION[name].check(v)
        except ValueError as e:
            raise ValueError(f"{name} {e}") from None

    def model_names(self, loaded_name: str) -> list[str]:
        """Names a request's `model` may use: the served name first."""
        names = [self.served_model_name] if self.served_model_name else []
        if loaded_name not in names:
            names.append(loaded_name)
        return names

"""Server settings: command-line options over COLIBRI_* environment variables over `.env`.

Every field here is documented in `.env.example`; the defaults are the safe ones (bind to
127.0.0.1, no CORS, client chat templates refused).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from colibri.engine import DEFAULT_QUANT, QUANT_PRESETS


class Settings(BaseSettings):
    """Everything `colibri serve` can be told."""

    model_config = SettingsConfigDict(
        env_prefix="COLIBRI_", env_file=".env", env_file_encoding="utf-8", extra="ignore"
    )

    # -- model ------------------------------------------------------------------------
    model: str | None = Field(None, description="model folder; None = the bundled demo model")
    served_model_name: str | None = Field(None, description="name clients use; default: folder")
    accept_any_model: bool = Field(
        False, description="answer requests whatever `model` they name (one model is served)")
    quant: str = Field(DEFAULT_QUANT, description="precision when converting a HF folder")
    threads: int | None = Field(None, ge=1, description="compute threads; None = all cores")
    n_ctx: int | None = Field(None, ge=16, description="context length; None = model default")

    # -- batching and KV cache --------------------------------------------------------
    max_num_seqs: int = Field(16, ge=1, le=256, description="sequences in one batch")
    max_num_batched_tokens: int = Field(256, ge=16, description="tokens in one step")
    prefill_tokens_while_decoding: int = Field(
        128, ge=1, description="prompt tokens in one step while other requests decode (each "
        "such step delays their next token)")
    kv_cache_mb: float | None = Field(None, gt=0, description="KV pool; None = from memory")
    kv_cache_type: Literal["auto", "f32", "f16", "q8"] = Field(
        "auto", description="KV element type (auto: f32 for an f32 model, else f16)")
    prefix_cache: bool = Field(True, description="reuse KV blocks of shared prompt prefixes")

    # -- expert cache -----------------------------------------------------------------
    expert_cache_mb: float | None = Field(None, gt=0, description="memory for routed experts; "
                                          "None = all when the model fits, else what is free")
    expert_cache_size: int | None = Field(None, ge=1, description="experts resident per layer")
    prefetch_window: int = Field(16, ge=1, description="tokens of routing history for heat")
    expert_load: Literal["auto", "direct", "pread", "mmap"] = Field(
        "auto", description="how missing experts are read")
    expert_prefetch: bool = Field(True, description="read the next layer's experts ahead")
    expert_pin: bool = Field(True, description="pin the experts earlier runs used most")
    expert_huge_pages: bool = Field(True, description="2 MiB pages on the expert slots")

    # -- network ----------------------------------------------------------------------
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_key: SecretStr | None = None
    cors_origins: list[str] = Field(default_factory=list)
    log_level: str = "info"
    docs: bool = Field(True, description="serve /docs and /openapi.json (behind the API key "
                       "when one is set)")

    # -- limits -----------------------------------------------------------------------
    max_queue: int = Field(16, ge=0, description="requests that may wait for the engine")
    retry_after_s: int = Field(1, ge=1, description="Retry-After sent with 503 when full")
    max_body_bytes: int = Field(1 << 20, ge=1024)
    max_header_bytes: int = Field(16 << 10, ge=1024)
    max_n: int = Field(8, ge=1, description="largest `n` a request may ask for")
    max_stop: int = Field(4, ge=1, description="most stop strings per request")
    max_stop_chars: int = Field(256, ge=1, description="longest stop string")
    max_logprobs: int = Field(20, ge=0, description="largest top_logprobs / logprobs")
    send_timeout_s: float = Field(30.0, gt=0, description="give up on a client that stalls")
    drain_timeout_s: float = Field(30.0, ge=0, description="SIGTERM: wait this long for work")
    header_timeout_s: float = Field(10.0, gt=0, description="request line + headers deadline")
    body_timeout_s: float = Field(30.0, gt=0, description="request body deadline")
    max_connections: int = Field(256, ge=1, description="open client connections at most")

    # -- chat templates ---------------------------------------------------------------
    allow_client_chat_template: bool = False
    max_chat_template_chars: int = Field(32 << 10, ge=64)
    client_template_timeout_s: float = Field(2.0, gt=0, description="render time of a client "
                                             "chat template (separate process)")
    model_template_timeout_s: float = Field(2.0, gt=0, description="render time of the "
                                            "model's chat template (separate process)")

    @field_validator("quant")
    @classmethod
    def _known_quant(cls, v: str) -> str:
        if v not in QUANT_PRESETS:
            raise ValueError(f"quant must be one of {', '.join(QUANT_PRESETS)}")
        return v

    def model_names(self, loaded_name: str) -> list[str]:
        """Names a request's `model` may use: the served name first."""
        names = [self.served_model_name] if self.served_model_name else []
        if loaded_name not in names:
            names.append(loaded_name)
        return names

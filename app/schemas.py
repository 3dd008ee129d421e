"""Response models: what the server really answers, published in /openapi.json.

The routes build plain dicts (no validation cost per response); these models only describe
them, so clients and fuzzers can check every answer against the schema. `install_schema`
replaces FastAPI's invented 422 with the errors the server does send, in OpenAI's shape (in
Anthropic's on the Messages API).
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field

from colibri.app.errors import anthropic_path
from colibri.app.middleware import host_names
from colibri.app.settings import Settings


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every 4xx/5xx body: `{"error": {...}}`."""

    error: ErrorDetail


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Every 4xx/5xx body of the Messages API: `{"type": "error", "error": {...}}`."""

    type: Literal["error"]
    error: AnthropicErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"]
    content: str | None
    refusal: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length"]


class ChatCompletion(BaseModel):
    """The non-streamed answer of POST /v1/chat/completions (`stream: true` sends
    `text/event-stream` of chat.completion.chunk objects, then `data: [DONE]`)."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: Usage


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"]


class Completion(BaseModel):
    """The non-streamed answer of POST /v1/completions (`stream: true`: text/event-stream)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage


class ResponseObject(BaseModel):
    """The non-streamed answer of POST /v1/responses (OpenAI's Responses API object; its
    output items are described by OpenAI's reference)."""

    model_config = ConfigDict(extra="allow")

    id: str
    object: Literal["response"]
    created_at: int
    model: str
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    output: list[dict[str, Any]]


class MessageUsage(BaseModel):
    input_tokens: int = Field(description="prompt tokens not read from the prefix cache")
    output_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int = Field(description="prompt tokens read from the prefix "
                                         "cache")


class MessageObject(BaseModel):
    """The non-streamed answer of POST /v1/messages (Anthropic's Message object)."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]] = Field(description="text and tool_use blocks")
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: str | None
    usage: MessageUsage


class TokenCount(BaseModel):
    """The answer of POST /v1/messages/count_tokens."""

    input_tokens: int


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    tokenizer_class: str
    eos_token: str | None
    bos_token: str | None
    pad_token: str | None
    unk_token: str | None
    eos_token_id: int | None
    eos_token_ids: list[int]
    bos_token_id: int | None
    pad_token_id: int | None
    add_bos_token: bool | None
    add_eos_token: bool | None
    chat_template: str | None
    vocab_size: int
    model_max_length: int
    max_model_len: int


class HealthStatus(BaseModel):
    status: Literal["ok", "error"]


class ReadyStatus(BaseModel):
    status: Literal["ready", "loading", "draining", "failed"]
    model_loaded: bool
    model: str | None = None


class LoadStatus(BaseModel):
    """GET /get_load: the scheduler's sequences now (what routers balance on)."""

    load: int = Field(description="running + waiting")
    running: int = Field(description="sequences in the running batch")
    waiting: int = Field(description="sequences waiting to be scheduled")
    kv_cache_usage: float = Field(description="share of KV cache blocks in use (0-1)")


class FlushCacheStatus(BaseModel):
    status: Literal["flushed"]
    blocks: int = Field(description="cached KV blocks forgotten")


class ModelSummary(BaseModel):
    """GET /get_model_info (sglang's fields, and the context length)."""

    model_path: str = Field(description="the repo id or folder name the model was loaded as")
    tokenizer_path: str
    served_model_name: str
    is_generation: bool
    max_model_len: int
    max_request_tokens: int
    vocab_size: int


class ServerSummary(BaseModel):
    """GET /get_server_info: version, model and the limits a router may plan with."""

    version: str
    served_model_name: str
    model_path: str
    context_length: int
    max_num_seqs: int
    max_queue: int
    max_num_batched_tokens: int
    prefix_cache: bool


class ExpertCachePoint(BaseModel):
    """One second of the recent history."""

    t: float = Field(description="Unix time")
    tok_s: float = Field(description="tokens computed per second (prompts and replies)")
    batch: float = Field(description="mean sequences per engine step")
    hit_rate: float | None = Field(description="share of expert uses found resident; "
                                   "null when no expert was used that second")


class ExpertCacheInfo(BaseModel):
    """GET /v1/expert_cache: where the routed experts are and how the cache does. With
    `enabled` false every expert stays resident (the cache is off) and only the history is
    kept; with it true, `state`, `heat` and `layers` come too."""

    enabled: bool
    n_layer: int = Field(description="the model's layers (rows of state and heat)")
    n_moe_layers: int = Field(description="the layers with routed experts")
    dense_layers: list[int] = Field(description="the layers without experts (rows of zeros)")
    shared_expert_bytes: int = Field(description="the shared experts of every layer: always "
                                     "resident, not routed, not counted in the budget")
    n_expert: int
    slots_per_layer: int
    expert_bytes: int
    budget_bytes: int
    reason: str = Field(description="why the cache has this size")
    totals: dict[str, float] = Field(description="hits, misses, hit_rate, resident_bytes, "
                                     "budget_bytes, bytes_read, stall_ns, loads, evictions, "
                                     "prefetch_* summed over the layers (empty when off)")
    history: list[ExpertCachePoint] = Field(description="one point per second of engine "
                                            "work over the last 5 minutes, oldest first")
    state: list[list[int]] | None = Field(None, description="[layer][expert]: 0 absent, "
                                          "1 loading, 2 resident, 3 pinned")
    heat: list[list[float]] | None = Field(None, description="[layer][expert]: recent "
                                           "selections")
    layers: list[dict[str, int]] | None = Field(None, description="counters of each layer")
    gpu_tier: dict[str, Any] | None = Field(None, description="with routed experts on a GPU "
                                            "beside the CPU: experts_on_device and "
                                            "device_expert_bytes (on the GPU now), its "
                                            "counters since start (named in counter_names: "
                                            "hits and misses, selections computed on the GPU "
                                            "/ the CPU; uploads, upload_bytes, evictions, "
                                            "steps; step_uploads, step_upload_bytes and "
                                            "step_upload_rows, CPU experts copied to the GPU "
                                            "for one step where the cost model says their "
                                            "rows repay it), upload_buffer_bytes (the GPU "
                                            "buffers they go through), layers (those with "
                                            "experts on the GPU), and [layer][expert] "
                                            "on_device (1 GPU, 0 CPU) and heat")


_MESSAGES = {
    400: "The request is malformed or a field is out of range (`param` names it).",
    401: "Missing or wrong API key.",
    404: "Unknown model (or URL).",
    408: "The client sent the request body too slowly.",
    413: "The request body is too large.",
    421: "The Host header names a host this server does not answer to.",
    431: "The request line or headers are too large.",
    500: "The server failed this request (details are in the server log).",
    503: "Loading, draining, queue full or the model is unhealthy; retry after Retry-After.",
}


def error_responses(*codes: int, anthropic: bool = False) -> dict[int | str, dict[str, Any]]:
    """`responses=` for a route: each code answers an ErrorResponse (anthropic: an
    AnthropicErrorResponse)."""
    model = AnthropicErrorResponse if anthropic else ErrorResponse
    return {c: {"model": model, "description": _MESSAGES[c]} for c in codes}


def sse_200(model: type[BaseModel], what: str) -> dict[int | str, dict[str, Any]]:
    """A 200 that is JSON (model) or, with `stream: true`, an event stream."""
    # one server-sent event (`data:` a JSON chunk or `[DONE]`, `event:` where the API names it)
    event = {"type": "object", "required": ["data"], "properties": {
        "data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"}}}
    return {200: {"model": model, "description": what, "content": {
        "text/event-stream": {"schema": event}}}}


def _error_ref(path: str) -> dict[str, Any]:
    name = "AnthropicErrorResponse" if anthropic_path(path) else "ErrorResponse"
    return {"content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}}


def install_schema(app: FastAPI, settings: Settings, protected: tuple[str, ...]) -> None:
    """Publish the real responses: drop FastAPI's 422, add what the guard middleware answers
    on any route (431, 421 where Host names are checked, and 413/408 on bodies; 401 where a
    key is required)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        comps = schema.setdefault("components", {}).setdefault("schemas", {})
        comps.pop("HTTPValidationError", None)
        comps.pop("ValidationError", None)
        for path, item in schema.get("paths", {}).items():
            for method, op in item.items():
                responses = op.setdefault("responses", {})
                responses.pop("422", None)
                extra = [431] + ([421] if host_names(settings) is not None else [])
                if method in ("post", "put", "patch"):
                    extra += [400, 408, 413]
                if settings.api_key is not None and path.startswith(protected):
                    extra.append(401)
                for code in extra:
                    responses.setdefault(str(code), {"description": _MESSAGES[code],
                                                     **_error_ref(path)})
        for model in (ErrorResponse, AnthropicErrorResponse):
            if model.__name__ not in comps:
                full = model.model_json_schema(ref_template="#/components/schemas/{model}")
                comps.update(full.get("$defs", {}))
                comps[model.__name__] = {k: v for k, v in full.items() if k != "$defs"}
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]



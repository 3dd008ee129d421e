"""Request models of the OpenAI API (fields in the order of OpenAI's reference).

Each generation request turns itself into the engine's SamplingParams. Shapes and ranges
are checked here (pydantic errors become 400 with `param`); limits that depend on settings
or on the loaded model (n cap, stop strings, vocabulary) are checked by `check()` methods
that raise APIError. Unknown fields are ignored, as OpenAI does.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from colibri.app.errors import APIError
from colibri.app.protocol_tools import (
    ResponseFormat,
    Tool,
    ToolCallIn,
    ToolChoice,
    check_hosted_fields,
    check_tools,
)
from colibri.app.settings import Settings
from colibri.engine import MIN_REPETITION_PENALTY, SamplingParams, TokenIdError, join_text_parts
from colibri.engine import check_token_ids as engine_check_token_ids

SEED_MOD = 1 << 63  # seeds reach the engine as non-negative 63-bit integers


def _valid_unicode(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text contains invalid Unicode (a lone surrogate)") from None
    return value


Text = Annotated[str, AfterValidator(_valid_unicode)]
Finite = Annotated[float, Field(allow_inf_nan=False)]
NON_EMPTY = {"minItems": 1}  # in /openapi.json: a list the server refuses when empty


class _Model(BaseModel):
    # strict: OpenAI's schema types booleans, integers and token ids strictly, and a client
    # sending `"stream": "yes"` or `true` as a token id has a bug it should hear about
    model_config = ConfigDict(extra="ignore", protected_namespaces=(), strict=True)


class StreamOptions(_Model):
    include_usage: bool = False


class TextPart(_Model):
    type: Literal["text"]
    text: Text


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # declared before content, which is checked against them
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    content: Text | list[TextPart] | None = Field(None, validate_default=True)
    name: str | None = None
    # an assistant's earlier reasoning, which thinking models' templates render or drop
    reasoning_content: Text | None = None

    @field_validator("content")
    @classmethod
    def _content_needed(cls, value: Any, info: ValidationInfo) -> Any:
        role = info.data.get("role")
        if value is None and not (role == "assistant" and info.data.get("tool_calls")):
            raise ValueError("content is required (only assistant messages with tool_calls "
                             "may leave it out)")
        return value

    @model_validator(mode="after")
    def _tool_call_id_needed(self) -> ChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("tool messages need the tool_call_id they answer")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return join_text_parts(p.text for p in self.content)

    def to_template(self) -> dict[str, Any]:
        """The message as the chat template wants it: developer -> system, text parts joined
        into one string (so parts tokenize exactly like the same text sent as a string)."""
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":
            out["name"] = self.name
        if self.reasoning_content is not None and self.role == "assistant":
            out["reasoning_content"] = self.reasoning_content
        return out


# OpenAI's SDK and front ends send `"temperature": null` for "not set": these fields take
# null as their default, and the published schema says so
NULL_MEANS_DEFAULT = ("temperature", "top_p", "n", "frequency_penalty", "presence_penalty",
                      "stream", "top_k", "min_p", "repetition_penalty", "ignore_eos",
                      "parallel_tool_calls")


def _null_allowed(schema: dict[str, Any]) -> None:
    """json_schema_extra: document null as accepted for the NULL_MEANS_DEFAULT fields."""
    props = schema.get("properties", {})
    for key in NULL_MEANS_DEFAULT:
        prop = props.get(key)
        if prop is None or "anyOf" in prop:
            continue
        outer = {k: prop.pop(k) for k in ("default", "title", "description") if k in prop}
        props[key] = {"anyOf": [prop, {"type": "null"}], **outer}


class _Sampling(_Model):
    """Sampling fields shared by chat and text completions (and the extras vLLM accepts)."""

    model_config = ConfigDict(json_schema_extra=_null_allowed)

    frequency_penalty: Finite = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, Finite] | None = None
    max_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1)
    presence_penalty: Finite = Field(0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 64)
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Finite = Field(1.0, ge=0.0, le=2.0)
    top_p: Finite = Field(1.0, gt=0.0, le=1.0)
    user: str | None = None
    # extras beyond OpenAI's API
    top_k: int = Field(-1, ge=-1)
    min_p: Finite = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: Finite = Field(1.0, ge=MIN_REPETITION_PENALTY, le=10.0)
    ignore_eos: bool = False

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key in NULL_MEANS_DEFAULT:
                if key in data and data[key] is None:
                    del data[key]
        return data

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def check_common(self, settings: Settings, vocab_size: int) -> None:
        """Limits that depend on the settings or the model; raises APIError (400)."""
        if self.n > settings.max_n:
            raise APIError(400, f"n must be at most {settings.max_n}", "n")
        stops = self.stop_list()
        if len(stops) > settings.max_stop:
            raise APIError(400, f"at most {settings.max_stop} stop strings are allowed", "stop")
        for s in stops:
            if not s:
                raise APIError(400, "stop strings must not be empty", "stop")
            if len(s) > settings.max_stop_chars:
                raise APIError(
                    400, f"stop strings are limited to {settings.max_stop_chars} characters",
                    "stop")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream: true",
                           "stream_options")
        self.bias_map(vocab_size)

    def bias_map(self, vocab_size: int) -> dict[int, float]:
        """logit_bias with integer keys, each checked against the vocabulary."""
        out: dict[int, float] = {}
        for key, value in (self.logit_bias or {}).items():
            # ASCII digits only: int() would also take " 5 ", "+5", "5_0" and "\u0665"
            if not (key.isascii() and key.isdigit()):
                raise APIError(400, f"logit_bias key {key!r} is not a token id",
                               "logit_bias")
            tok = int(key)
            check_token_ids([tok], vocab_size, "logit_bias")
            if not -100.0 <= value <= 100.0:
                raise APIError(400, "logit_bias values must be in [-100, 100]", "logit_bias")
            out[tok] = float(value)
        return out

    def sampling_params(
        self, max_tokens: int | None, choice: int, vocab_size: int, logprobs: int | None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """The engine's parameters for choice number `choice` (seeds differ per choice)."""
        seed = None if self.seed is None else (self.seed + choice) % SEED_MOD
        assert math.isfinite(self.temperature)
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            stop=self.stop_list(),
            stop_token_ids=[],
            ignore_eos=self.ignore_eos,
            seed=seed,
            logit_bias=self.bias_map(vocab_size),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(json_schema_extra=NON_EMPTY)
    model: Text | None = None
    logprobs: bool = False
    max_completion_tokens: int | None = Field(None, ge=1)
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    tool_choice: ToolChoice | None = None
    tools: list[Tool] | None = None
    top_logprobs: int | None = Field(None, ge=0)
    # thinking models: "none" switches thinking off; the others reach the template
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    # refused when set (check_hosted_fields); the hosted-only fields are simply ignored
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    functions: Any = None
    function_call: Any = None
    # extras
    chat_template: str | None = None
    add_generation_prompt: bool = True
    # variables for the chat template, e.g. {"enable_thinking": false}
    chat_template_kwargs: dict[str, Any] | None = None

    def check(self, settings: Settings, vocab_size: int) -> None:
        """Everything pydantic cannot know; raises APIError (400)."""
        if not self.messages:
            raise APIError(400, "messages must not be empty", "messages")
        self.check_common(settings, vocab_size)
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise APIError(400, "top_logprobs requires logprobs: true", "top_logprobs")
            if self.top_logprobs > settings.max_logprobs:
                raise APIError(400, f"top_logprobs must be at most {settings.max_logprobs}",
                               "top_logprobs")
        check_hosted_fields(self.model_dump(include=_REFUSED))
        check_tools(self.tools, self.tool_choice)
        if self.chat_template is not None:
            if not settings.allow_client_chat_template:
                raise APIError(400, "chat templates sent by clients are disabled on this "
                               "server (COLIBRI_ALLOW_CLIENT_CHAT_TEMPLATE)", "chat_template")
            if len(self.chat_template) > settings.max_chat_template_chars:
                raise APIError(400, "chat_template is too long", "chat_template")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens else self.max_tokens

    def engine_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.to_template() for m in self.messages]


_REFUSED = {"audio", "modalities", "prediction", "web_search_options", "functions",
            "function_call"}

# what the server takes (prompt_list and check refuse the rest), as /openapi.json shows it
_PROMPT_SCHEMA = {"anyOf": [
    {"type": "string", "minLength": 1},
    {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
    {"type": "array", "minItems": 1, "items": {"type": "integer"}},
    {"type": "array", "minItems": 1,
     "items": {"type": "array", "minItems": 1, "items": {"type": "integer"}}},
]}
Prompt = Annotated[Text | list[Text] | list[int] | list[list[int]],
                   WithJsonSchema(_PROMPT_SCHEMA)]


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    model: Text | None = None
    prompt: Prompt
    best_of: int | None = Field(None, ge=1)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0)
    # omitted: OpenAI's default of 16; an explicit null: what is left of the context;
    # 0 (with echo) scores the prompt without generating
    max_tokens: int | None = Field(16, ge=0)
    suffix: str | None = None
    response_format: ResponseFormat | None = None

    def check(self, settings: Settings, vocab_size: int) -> None:
        """Everything pydantic cannot know; raises APIError (400)."""
        self.check_common(settings, vocab_size)
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of other than n is not supported", "best_of")
        if self.suffix:
            raise APIError(400, "suffix is not supported", "suffix")
        if self.logprobs is not None and self.logprobs > settings.max_logprobs:
            raise APIError(400, f"logprobs must be at most {settings.max_logprobs}", "logprobs")
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens 0 is only allowed with echo: true", "max_tokens")
        prompts = self.prompt_list()
        if not prompts:
            raise APIError(400, "prompt must not be empty", "prompt")
        if len(prompts) * self.n > settings.max_n * 4:
            raise APIError(400, "too many prompts in one request", "prompt")
        for p in prompts:
            if isinstance(p, str):
                if not p:
                    raise APIError(400, "prompt must not be empty", "prompt")
            else:
                check_token_ids(p, vocab_size, "prompt")

    def prompt_list(self) -> list[str | list[int]]:
        """The prompts as a list: each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            return []
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    """Refuse empty lists and ids outside the vocabulary (before anything reaches C): the
    engine's check, answered as a 400."""
    try:
        engine_check_token_ids(ids, vocab_size, param)
    except TokenIdError as exc:
        raise APIError(400, str(exc), exc.param) from None


class TokenizeRequest(_Model):
    """POST /tokenize: either `prompt` or `messages`."""

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(None, json_schema_extra=NON_EMPTY)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        return self


class DetokenizeRequest(_Model):
    """POST /detokenize."""

    model: Text | None = None
    tokens: list[int] = Field(json_schema_extra=NON_EMPTY)

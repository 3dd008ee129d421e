"""Request models for tools, structured output and the fields of hosted features.

`ResponseFormat` and the `tools` / `tool_choice` shapes follow OpenAI's chat reference; a
request also passes through `check_hosted_fields`, which accepts and ignores what only a hosted
service does with (store, metadata, service_tier, ...) and refuses what would change the answer
and is not supported here (audio, non-text modalities, predicted outputs, legacy functions).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from colibri.app.errors import APIError
from colibri.engine import ConstraintSpec

FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]


class _Model(BaseModel):
    # strict, as the request models that hold these (app/protocol.py): `"strict": 0.0` is a
    # client bug to report, not a false
    model_config = ConfigDict(extra="ignore", protected_namespaces=(), strict=True)


class JSONSchemaFormat(_Model):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    def spec(self, param: str = "response_format") -> ConstraintSpec | None:
        """The constraint this format asks for (None for plain text)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return ConstraintSpec("json_object", None, param)
        if self.json_schema is None:
            raise APIError(400, "response_format json_schema needs a json_schema object",
                           f"{param}.json_schema")
        schema = self.json_schema.schema_
        if schema is None:
            schema = {}
        return ConstraintSpec("json_schema", schema, f"{param}.json_schema.schema")


class FunctionDef(_Model):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Model):
    type: Literal["function"]
    function: FunctionDef

    @model_validator(mode="before")
    @classmethod
    def _function_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") != "function":
            raise ValueError(f"only function tools are supported (got {data.get('type')!r})")
        return data

    def template_dict(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.function.name}
        if self.function.description is not None:
            fn["description"] = self.function.description
        fn["parameters"] = self.function.parameters or {"type": "object", "properties": {}}
        return {"type": "function", "function": fn}


class NamedFunction(_Model):
    name: FunctionName


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolCallFunction(_Model):
    name: str
    arguments: str = ""


class ToolCallIn(_Model):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


def named_choice(choice: ToolChoice | None) -> str | None:
    return choice.function.name if isinstance(choice, NamedToolChoice) else None


def check_tools(tools: list[Tool] | None, choice: ToolChoice | None,
                param: str = "tool_choice") -> None:
    """tool_choice must agree with tools (400 otherwise)."""
    name = named_choice(choice)
    if choice in ("required",) or name is not None:
        if not tools:
            raise APIError(400, "tool_choice needs tools", param)
    if name is not None and tools and name not in {t.function.name for t in tools}:
        raise APIError(400, f"tool_choice names {name!r}, which is not among the tools", param)
    if tools:
        names = [t.function.name for t in tools]
        if len(set(names)) != len(names):
            raise APIError(400, "tool names must be unique", "tools")


# accepted and ignored: they only mean something on a hosted service
IGNORED_FIELDS = ("store", "metadata", "service_tier", "prompt_cache_key",
                  "safety_identifier", "user")


def check_hosted_fields(extra: dict[str, Any]) -> None:
    """Refuse fields that would change the answer and are not supported (400)."""
    if extra.get("audio") is not None:
        raise APIError(400, "audio output is not supported by this server", "audio")
    mods = extra.get("modalities")
    if mods is not None and (not isinstance(mods, list) or any(m != "text" for m in mods)):
        raise APIError(400, "only the text modality is supported", "modalities")
    if extra.get("prediction") is not None:
        raise APIError(400, "predicted outputs (prediction) are not supported", "prediction")
    if extra.get("web_search_options") is not None:
        raise APIError(400, "web search is not available on this server", "web_search_options")
    for legacy in ("functions", "function_call"):
        if extra.get(legacy) is not None:
            raise APIError(400, f"{legacy} is the deprecated form of tools: send tools and "
                           "tool_choice instead", legacy)

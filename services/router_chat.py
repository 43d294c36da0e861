"""The chat request's messages and tools (OpenAI's `tools`, `tool_choice`, and the `tool_calls`
of earlier assistant turns), and which tool call parser the router uses.

Tool calling: the tools go to the model's chat template (the tokenizer renders them). What
comes back depends on `tool_choice`, as in vLLM:

* `"auto"` (the default with tools): the model decides; its output is split into content and
  calls by the tool call parser of its format (`services/tool_parsers.py`; the router's
  `--tool-call-parser`, else the format its chat template teaches). `finish_reason` is
  `"tool_calls"` when it called any.
* `"required"`: the output is constrained (structured outputs) to a JSON list of one or more
  `{"name": <a tool's name>, "parameters": <its schema>}` (one if `parallel_tool_calls` is
  false), which becomes the calls.
* `{"type": "function", "function": {"name": N}}`: the output is constrained to N's parameter
  schema and is the arguments of one call to N (`finish_reason` stays `"stop"`, as OpenAI's).
* `"none"`: the tools are still rendered; the output is plain content.

Streamed, content arrives as it is generated. A call opens with its id and name as soon as
its header (`{"name": ..., "arguments": {`) is generated, and its arguments follow piece by piece
(`services/tool_call_objects.py`), for `auto` and `required` alike; a named call's arguments
stream from the first token. Cut off by max_tokens inside its arguments, a call keeps what came
(finish_reason `"length"`), as OpenAI's does.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import Field, field_validator

from services.router_fields import ApiError, _Strict
from services.router_tools import ToolMode
from services.tool_parsers import canonical, infer_parser
from shared.messages import ChatMessage

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


class FunctionDef(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _check_name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError("must be 1 to 64 letters, digits, '_', '.' or '-'")
        return v


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class FunctionCallIn(_Strict):
    name: str
    arguments: str  # a JSON text, as OpenAI returns it


class ToolCallIn(_Strict):
    """A call an assistant message made earlier in the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ContentPart(_Strict):
    type: str
    text: str | None = None


class ChatMessageIn(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    def flat(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ApiError(
                400, "only assistant messages carry tool_calls", "messages", "invalid_value"
            )
        calls = [c.model_dump() for c in self.tool_calls] if self.tool_calls else None
        return ChatMessage(self.role, self._text(), self.name, calls, self.tool_call_id)

    def _text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        texts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ApiError(
                    400,
                    f"content part type {part.type!r} is not supported",
                    "messages",
                    "unsupported",
                )
            texts.append(part.text)
        return "".join(texts)


class ToolFields(_Strict):
    """The chat request's tool fields."""

    tools: list[ToolDef] | None = Field(None, min_length=1, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def tool_params(self, params: dict[str, Any]) -> ToolMode | None:
        """The tool mode of the request, adding its grammar to the sampling dict `params`."""
        choice = self.tool_choice
        if not self.tools:
            if choice not in (None, "none"):
                raise ApiError(400, "tool_choice needs tools", "tool_choice", "invalid_value")
            return None
        if choice == "none":
            return None
        if choice is None or choice == "auto":
            return ToolMode("auto")
        if any(k in params for k in ("json_schema", "regex", "ebnf")):
            raise ApiError(
                400,
                "tool_choice required or a named function cannot be combined with another "
                "structured output option",
                "tool_choice",
                "invalid_value",
            )
        if choice == "required":
            params["json_schema"] = json.dumps(self._calls_schema())
            return ToolMode("required")
        by_name = {t.function.name: t.function for t in self.tools}
        fn = by_name.get(choice.function.name)
        if fn is None:
            raise ApiError(
                400,
                f"tool_choice names {choice.function.name!r}, which is not among the tools",
                "tool_choice",
                "invalid_value",
            )
        params["json_schema"] = json.dumps(fn.parameters or {"type": "object"})
        return ToolMode("named", name=fn.name)

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        return tool_dicts(self.tools)

    def _calls_schema(self) -> dict[str, Any]:
        items = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [t.function.name]},
                    "parameters": t.function.parameters or {"type": "object"},
                },
                "required": ["name", "parameters"],
            }
            for t in self.tools or []
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if self.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return schema


def tool_dicts(tools: list[ToolDef] | None) -> list[dict[str, Any]] | None:
    """The tools as the chat template gets them."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


class ParserChoice:
    """The tool call parser: the configured one, else the one the model's chat template
    implies (looked up in the model folders the router can read, once found)."""

    def __init__(self, configured: str | None) -> None:
        self.parser = canonical(configured) if configured else None
        self._tried: set[str] = set()

    def resolve(self, model_dirs: Iterable[str | None]) -> str:
        for folder in model_dirs:
            if self.parser is not None:
                break
            if folder and folder not in self._tried:
                self._tried.add(folder)
                self.parser = infer_parser(chat_template_of(folder))
        if self.parser is None:
            raise ApiError(
                400,
                "tool_choice auto needs a tool call parser: start the router with "
                "--tool-call-parser (hermes, llama3 or mistral); this model's chat template "
                "implies none",
                "tools",
                "unsupported",
            )
        return self.parser


def chat_template_of(folder: str) -> str | None:
    """The chat template a Hugging Face folder holds (the tool-use one if it has several)."""
    path = os.path.join(folder, "chat_template.jinja")
    try:
        if os.path.isfile(path):
            with open(path) as f:
                return f.read()
        with open(os.path.join(folder, "tokenizer_config.json")) as f:
            template = json.load(f).get("chat_template")
    except (OSError, ValueError):
        return None
    if isinstance(template, list):  # [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("tool_use") or named.get("default")
    return template if isinstance(template, str) else None

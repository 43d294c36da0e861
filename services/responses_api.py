"""OpenAI's Responses API (`POST /v1/responses`), stateless, as a chat request.

A Responses request is turned into the chat completion request it means, and runs as one
(the same template, tool call parsing, reasoning split and structured outputs); its output
is then reshaped into a `response` object, or into the API's stream of events
(services/responses_stream.py).

* `input`: a string (one user message) or a list of items: messages (`role` user,
  assistant, system or developer; `content` a string or `input_text` / `output_text`
  parts), earlier `function_call`s (they become the assistant's tool calls) and their
  `function_call_output`s (tool messages); `reasoning` items are dropped, as chat templates
  drop earlier reasoning. `instructions` goes first, as a system message.
* `tools` are function tools (`{"type": "function", "name", "description", "parameters"}`);
  `tool_choice` is "auto", "none", "required" or `{"type": "function", "name"}`.
* `text.format` is `text`, `json_object` or `json_schema` (`name`, `schema`, `strict`).
* `reasoning.effort` goes to the chat template as `reasoning_effort` (as the chat API's
  field of that name does; gpt-oss's template reads it); `reasoning` is echoed.
* `max_output_tokens`, `temperature`, `top_p`, `parallel_tool_calls`, `metadata` (echoed),
  and the sampling extras of the chat body (`top_k`, `seed`, `stop`, ...) pass through.
* `include: ["message.output_text.logprobs"]` asks for the output's logprobs (the chat's
  `logprobs`), with `top_logprobs` (0-20) alternatives at each token, as in OpenAI's API and
  vLLM; without it `top_logprobs` is only echoed. The other `include` values name outputs
  this server has no tools or encrypted reasoning for, and add nothing.

`store` (default true) keeps the response for `previous_response_id` and
`GET /v1/responses/{id}` (services/responses_store.py); `background` generates it behind
the client's back, to be polled, streamed again or cancelled (services/responses_background.py);
`conversation` and `prompt` are refused with a 400 naming the field.

`truncation: "auto"`: a conversation longer than the context loses its earliest turns (a
turn: a user message and what follows it up to the next user message; system messages and
`instructions` stay) until it fits with `max_output_tokens`, as OpenAI's API drops items
from the beginning of the conversation; the tokenizer does it (services/tokenize_request.py).
If the last turn alone does not fit, the request fails as with "disabled" (400).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import ConfigDict, Field, PrivateAttr, ValidationError

from services.router_fields import ApiError, _Strict
from services.router_protocol import ChatCompletionRequest

_CHAT_PARAMS = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "tool_choice.function": "tool_choice",
    "reasoning_effort": "reasoning.effort",
}
_PASSED = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "presence_penalty",
           "frequency_penalty", "repetition_penalty", "logit_bias", "ignore_eos",
           "skip_special_tokens", "min_tokens", "rid", "priority", "chat_template_kwargs",
           "separate_reasoning", "parallel_tool_calls", "cache_salt", "extra_key")  # fmt: skip
_STATEFUL = ("conversation", "prompt")
LOGPROBS = "message.output_text.logprobs"
INCLUDABLE = (LOGPROBS, "reasoning.encrypted_content", "file_search_call.results",
              "web_search_call.results", "web_search_call.action.sources",
              "message.input_image.image_url", "computer_call_output.output.image_url",
              "code_interpreter_call.outputs")  # fmt: skip


def _invalid(message: str, param: str) -> ApiError:
    return ApiError(400, message, param, "invalid_value")


class ResponsesRequest(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")  # the chat body's extras, kept

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    stream: bool | None = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None  # `effort` becomes the chat's reasoning_effort
    previous_response_id: str | None = None
    store: bool | None = None  # None: the API's default, true
    conversation: Any = None
    background: bool | None = None
    prompt: Any = None
    truncation: Literal["auto", "disabled"] | None = None  # None: the API's default, disabled
    _extras: dict[str, Any] = PrivateAttr(default_factory=dict)

    @classmethod
    def parse(cls, raw: bytes) -> ResponsesRequest:
        """The request, with the chat body's sampling fields it carries kept aside."""
        from services.router_protocol import parse_body

        body = parse_body(cls, raw)
        given = body.model_extra or {}
        body._extras = {k: given[k] for k in _PASSED if given.get(k) is not None}
        for name in _STATEFUL:
            if getattr(body, name) not in (None, False):
                raise ApiError(400, f"{name} is not supported", name, "unsupported")
        for i, name in enumerate(body.include or []):
            if name not in INCLUDABLE:
                raise _invalid(f"include[{i}]: unknown value {name!r}; known: "
                               f"{', '.join(INCLUDABLE)}", f"include.{i}")  # fmt: skip
        return body

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS in (self.include or [])

    def to_chat(
        self, history: list[dict[str, Any]] | None = None, stream: bool | None = None
    ) -> ChatCompletionRequest:
        """The chat completion request this one means (400s name this API's fields), after
        the stored items of the conversation it continues (`history`); streamed if `stream`
        (default: as this request is)."""
        stream = bool(self.stream) if stream is None else stream
        messages = _messages(self.input, self.instructions)
        if history:
            at = 1 if self.instructions else 0
            messages[at:at] = _messages(history, None)
        chat: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_completion_tokens": self.max_output_tokens,
            "stream": stream,
            "stream_options": {"include_usage": True} if stream else None,
            **self._extras,
        }
        if self.tools is not None:
            chat["tools"] = [_chat_tool(t, i) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            chat["tool_choice"] = _chat_tool_choice(self.tool_choice)
        if self.wants_logprobs:
            chat["logprobs"], chat["top_logprobs"] = True, self.top_logprobs or 0
        if (self.reasoning or {}).get("effort") is not None:
            chat["reasoning_effort"] = self.reasoning["effort"]  # type: ignore[index]
        fmt = (self.text or {}).get("format")
        if fmt is not None:
            chat["response_format"] = _chat_format(fmt)
        try:
            request = ChatCompletionRequest.model_validate(chat)
        except ValidationError as exc:
            err = exc.errors(include_url=False)[0]
            loc = ".".join(str(p) for p in err["loc"] if isinstance(p, (str, int)))
            for chat_name, name in _CHAT_PARAMS.items():
                if loc.startswith(chat_name):
                    loc = name + loc[len(chat_name):]
            msg = err["msg"].removeprefix("Value error, ")
            raise _invalid(f"{loc}: {msg}", loc) from None
        request._drop_turns = self.truncation == "auto"
        return request


def _messages(items: str | list[dict[str, Any]], instructions: str | None) -> list[dict]:
    out: list[dict[str, Any]] = []
    if instructions:
        out.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        return [*out, {"role": "user", "content": items}]
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            out.append({"role": item.get("role"), "content": _text(item.get("content"), i)})
        elif kind == "function_call":
            function = {"name": item.get("name"), "arguments": item.get("arguments")}
            call = {"id": item.get("call_id"), "type": "function", "function": function}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else json.dumps(output)
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": content})
        elif kind != "reasoning":
            raise ApiError(400, f"input[{i}]: item type {kind!r} is not supported",
                           f"input.{i}.type", "unsupported")  # fmt: skip
    return out


def _text(content: Any, i: int) -> Any:
    """A message item's content as the chat body's (its text parts joined)."""
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        text = part.get("text") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(text, str):
            raise ApiError(400, f"input[{i}]: content part type {kind!r} is not supported",
                           f"input.{i}.content", "unsupported")  # fmt: skip
        texts.append(text)
    return "".join(texts)


def _chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise ApiError(400, f"tools[{i}]: only function tools are supported, got "
                       f"{tool.get('type')!r}", f"tools.{i}.type", "unsupported")  # fmt: skip
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": fn}


def _chat_tool_choice(choice: str | dict[str, Any]) -> Any:
    if isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or "name" not in choice:
        raise _invalid('tool_choice must be "auto", "none", "required" or '
                       '{"type": "function", "name": ...}', "tool_choice")  # fmt: skip
    return {"type": "function", "function": {"name": choice["name"]}}


def _chat_format(fmt: dict[str, Any]) -> dict[str, Any]:
    if fmt.get("type") != "json_schema":
        return {"type": fmt.get("type")}
    spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}

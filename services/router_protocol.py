"""HTTP request bodies (OpenAI and SGLang), their validation, and their translation into
the sub-requests the router sends through the tokenizers.

Validation here covers what the router can know without a tokenizer: JSON syntax, field
types (strict: no "0.5" for a float, no 1.0 for an int), value ranges of the sampling
parameters, and options sluice does not implement. Prompt and context lengths are checked by
the tokenizer service, which answers with an `ErrorMsg` the router turns into a 400.
Every failure raises `ApiError`, which renders as OpenAI's error JSON. The sampling fields
the bodies share (and structured outputs) are in services/router_fields.py, SGLang's
`/generate` body in services/router_generate.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, Field, PrivateAttr, ValidationError, field_validator

from services.router_chat import ChatMessageIn, ToolFields
from services.router_fields import (
    _INT64,
    MAX_LOGPROBS,
    MAX_N,
    ApiError,
    SamplingFields,
    _stop_list,
)
from services.router_tools import ToolMode
from shared.messages import ChatMessage

__all__ = ["MAX_LOGPROBS", "MAX_N", "ApiError", "SubRequest", "parse_body", "fan_out"]

@dataclass
class SubRequest:
    """One generation: a prompt (exactly one of text, messages, input_ids) and its params.

    `index` is the choice index in the response (prompt_index * n + j).
    """

    index: int
    prompt_index: int
    sampling_params: dict[str, Any]
    text: str | None = None
    messages: list[ChatMessage] | None = None
    input_ids: list[int] | None = None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    stop: list[str] = field(default_factory=list)
    logprob_start_len: int = -1  # with return_logprob: the prompt's logprobs from there
    rid: str | None = None  # the client's id of the request (SGLang's `rid`), if it gave one
    priority: int | None = None  # for the worker's priority scheduling
    lora_name: str | None = None  # the LoRA adapter to run with (None: the base model)
    # vLLM's prompt_logprobs: every prompt token's logprob and rank, and this many candidates
    # (asked of the engine besides what return_logprob / top_logprobs_num show of the output)
    prompt_logprobs: int | None = None
    # n > 1: the sub-request of the same prompt whose prompt logprobs this one shows (they
    # are computed once per prompt; the others may then use the prefix cache)
    prompt_scored_by: int | None = None
    # /v1/completions: the prompt goes before the output (and logprobs); chat: the last
    # message's content does, if it is the assistant's (vLLM's)
    echo: bool = False
    tools: list[dict[str, Any]] | None = None  # chat: for the template
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True  # chat: open the assistant's turn after the messages
    continue_final_message: bool = False  # chat: or continue the last message
    return_token_ids: bool = False  # vLLM's: the prompt's and the output's ids in the response
    return_tokens_as_token_ids: bool = False  # vLLM's: logprob tokens spelled token_id:N
    embed: bool = False  # /v1/embeddings: pooled by an embedding worker (no output tokens)
    text_pair: str | None = None  # with text: a cross-encoder's pair (/v1/score, /v1/rerank)
    # vLLM's cache_salt (SGLang's extra_key): cached prefixes are shared only within a salt
    cache_salt: str | None = None
    return_text_in_logprobs: bool = False  # /generate (SGLang's): token texts in logprobs


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]  # OpenAI's


class CompletionRequest(SamplingFields):
    model: str
    prompt: Any
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, v: Any) -> list[str] | list[list[int]]:
        if isinstance(v, str):
            return [v]
        if isinstance(v, list) and v and all(_is_int(t) for t in v):
            return [v]
        if isinstance(v, list) and v and all(isinstance(p, str) for p in v):
            return v
        if isinstance(v, list) and v and all(_is_id_list(p) for p in v):
            return v
        raise ValueError(
            "must be a string, a list of strings, a non-empty list of token ids, or a list of those"
        )

    def to_subrequests(self) -> list[SubRequest]:
        for name, bad in (
            ("suffix", self.suffix),
            ("best_of", self.best_of not in (None, 1, self.n)),
            ("echo with truncate_prompt_tokens", self.echo and self.truncate_prompt_tokens),
        ):
            if bad:
                raise ApiError(400, f"{name} is not supported", name, "unsupported")
        params = self.sampling_params(self.max_tokens)
        top = self.logprobs or 0
        logprob = self.logprobs is not None
        prompts = [{"text": p} if isinstance(p, str) else {"input_ids": p} for p in self.prompt]
        # echo with logprobs scores the whole prompt too (vLLM's and OpenAI's legacy shape)
        start = 0 if self.echo and logprob else -1
        subs = fan_out(prompts, params, self.n, logprob, top, start)
        for sub in subs:
            sub.echo = bool(self.echo)
        return self.finish_subrequests(subs)


class ChatCompletionRequest(SamplingFields, ToolFields):
    model: str
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's; as vLLM and SGLang do, the chat template gets it (gpt-oss's reads it), unless
    # chat_template_kwargs names it
    reasoning_effort: ReasoningEffort | None = None
    separate_reasoning: bool | None = True  # SGLang's: false keeps think blocks in content
    # vLLM's: the template opens the assistant's turn (default), or leaves the last message
    # open for the output to continue it (a prefill); `echo` puts that message's text
    # before the output's
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    echo: bool | None = False
    _tool_mode: ToolMode | None = PrivateAttr(None)
    # the Responses API's `truncation: "auto"`: the tokenizer drops the earliest turns that
    # do not fit the context (services/tokenize_request.py)
    _drop_turns: bool = PrivateAttr(False)

    @property
    def tool_mode(self) -> ToolMode | None:
        """How the output becomes tool calls (set by `to_subrequests`); None: plain text."""
        return self._tool_mode

    def to_subrequests(self) -> list[SubRequest]:
        if self.top_logprobs and not self.logprobs:
            raise ApiError(
                400, "top_logprobs requires logprobs=true", "top_logprobs", "invalid_value"
            )
        if self.continue_final_message and self.add_generation_prompt is not False:
            raise ApiError(
                400,
                "continue_final_message needs add_generation_prompt=false (they are exclusive)",
                "continue_final_message",
                "invalid_value",
            )
        limit = self.max_completion_tokens
        params = self.sampling_params(self.max_tokens if limit is None else limit)
        self._tool_mode = self.tool_params(params)
        if self._drop_turns:
            params["truncate_turns"] = True
        prompt = {
            "messages": [m.flat() for m in self.messages],
            "tools": self.tool_dicts(),
            "chat_template_kwargs": self._template_kwargs(),
            "add_generation_prompt": self.add_generation_prompt is not False,
            "continue_final_message": bool(self.continue_final_message),
            "echo": bool(self.echo),
        }
        subs = fan_out([prompt], params, self.n, bool(self.logprobs), self.top_logprobs or 0)
        return self.finish_subrequests(subs)

    def _template_kwargs(self) -> dict[str, Any] | None:
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {"reasoning_effort": self.reasoning_effort, **(self.chat_template_kwargs or {})}


def fan_out(
    prompts: list[dict[str, Any]],
    params: dict[str, Any],
    n: int,
    logprob: bool,
    top: int,
    logprob_start_len: int = -1,
) -> list[SubRequest]:
    """n sub-requests per prompt; with a seed, sample j gets seed + j (distinct samples)."""
    subs = []
    seed = params.get("sampling_seed")
    stop = _stop_list(params.get("stop")) or []
    for i, prompt in enumerate(prompts):
        for j in range(n):
            p = dict(params)
            if seed is not None and j:
                p["sampling_seed"] = (seed + j + _INT64) % (2 * _INT64) - _INT64
            sub = SubRequest(i * n + j, i, p, return_logprob=logprob, top_logprobs_num=top,
                             stop=stop, logprob_start_len=logprob_start_len, **prompt)
            subs.append(sub)
    return subs


def check_max_tokens(subs: list[SubRequest], context_len: int | None, param: str) -> None:
    """max_new_tokens beyond the context can never fit: refuse before sending anything."""
    for sub in subs:
        want = sub.sampling_params.get("max_new_tokens")
        if context_len and want is not None and want >= context_len:
            raise ApiError(
                400,
                f"{param} is {want}, but the model's context length is {context_len} tokens",
                param,
                "context_length_exceeded",
            )


def parse_body(model: type[BaseModel], raw: bytes) -> Any:
    """Validate a JSON body against `model`; raise ApiError naming the first bad field. An
    integer anywhere in it (a field without bounds, a free-form dict) must fit in 64 bits:
    the messages carrying it could not encode it."""
    try:
        body = model.model_validate_json(raw or b"")
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        if err["type"] == "json_invalid":
            raise ApiError(400, f"invalid JSON body: {err['msg']}", None, "invalid_json") from None
        loc = [str(p) for p in err["loc"] if not _is_type_name(p)]
        param = ".".join(loc) or None
        msg = err["msg"].removeprefix("Value error, ")
        code = "missing_required_parameter" if err["type"] == "missing" else "invalid_value"
        raise ApiError(400, f"{param or 'body'}: {msg}", param, code) from None
    bad = _int_out_of_range(body, "")
    if bad is not None:
        param = bad or None
        raise ApiError(400, f"{bad or 'body'}: integer out of the 64-bit range", param,
                       "invalid_value")  # fmt: skip
    return body


def _int_out_of_range(v: Any, path: str) -> str | None:
    """The path of the first integer in `v` outside [-2**63, 2**63), or None."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return None if -_INT64 <= v < _INT64 else path
    if isinstance(v, BaseModel):
        fields = {**v.__dict__, **(v.model_extra or {})}
        return _int_out_of_range(fields, path)
    if isinstance(v, dict):
        items: Any = v.items()
    elif isinstance(v, (list, tuple)):
        try:  # a list of numbers (token ids): checked at C speed
            if not v or (-_INT64 <= min(v) and max(v) < _INT64):
                return None
        except TypeError:
            pass
        items = enumerate(v)
    else:
        return None
    for key, x in items:
        bad = _int_out_of_range(x, f"{path}.{key}" if path else str(key))
        if bad is not None:
            return bad
    return None


def _is_type_name(part: Any) -> bool:
    return isinstance(part, str) and (
        part[:1].isupper() or "[" in part or part in _TYPES or part.startswith("constrained-")
    )


_TYPES = {"str", "int", "float", "bool", "list", "dict", "function-after", "function-before"}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_id_list(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(_is_int(t) and t >= 0 for t in v)

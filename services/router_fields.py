"""The shared pieces of the HTTP request bodies: `ApiError`, the sampling fields of the OpenAI
and SGLang APIs (vLLM's extras included) and their translation into SGLang's sampling dict.

Structured outputs: the engine takes SGLang's sampling parameters `json_schema` (a JSON
string; "$$ANY$$" for any JSON), `regex` and `ebnf` (engine/sampling/grammar.py). The OpenAI
endpoints accept them as (json_object: a JSON object, the schema {"type": "object"}, as
OpenAI's JSON mode, SGLang and vLLM)

    response_format  {"type": "text"} | {"type": "json_object"}
                     | {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    regex, ebnf      SGLang's extra fields
    structured_outputs  {"json" | "regex" | "choice" | "grammar" | "json_object": ...}  vLLM's
    guided_json, guided_regex, guided_choice, guided_grammar   vLLM's before v0.12

at most one of them per request. A choice (a list of strings) becomes an EBNF grammar whose
alternatives are those strings. What the router cannot check without the tokenizer
(whether a regex or grammar compiles) comes back from the worker as a 400.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from engine.sampling.grammar_spec import ANY_JSON, JSON_OBJECT, structural_tag_json
from engine.sampling.sampling_params import logit_bias_error

MAX_N = 128
MAX_LOGPROBS = 20
MAX_BAD_WORDS = 1024
_INT64 = 1 << 63
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    503: "service_unavailable",
    504: "timeout",
}


class ApiError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        kind = _ERROR_TYPES.get(self.status, "server_error" if self.status >= 500 else "error")
        err = {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        return {"error": err}


def _stop_list(v: Any) -> list[str] | None:
    if v is None:
        return None
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ValueError("must be a string or a list of strings")
    if not all(stops):
        raise ValueError("must not contain empty strings")
    return stops


def _check_top_k(v: int | None) -> int | None:
    if v is not None and v != -1 and v < 1:
        raise ValueError("must be -1 (disabled) or >= 1")
    return v


def _check_logit_bias(v: dict[str, float]) -> dict[str, float]:
    why = logit_bias_error(v)
    if why is not None:
        raise ValueError(why)
    return v or None  # type: ignore[return-value]


StopStrings = Annotated[Any, AfterValidator(_stop_list)]
LogitBias = Annotated[dict[str, float], AfterValidator(_check_logit_bias)]
TopK = Annotated[int | None, AfterValidator(_check_top_k)]
TokenIds = list[Annotated[int, Field(ge=0)]]
MAX_REQUEST_ID_LEN = 256
RequestId = Annotated[str, Field(min_length=1, max_length=MAX_REQUEST_ID_LEN)]
CacheSalt = Annotated[str, Field(min_length=1, max_length=4096)]


def joined_salt(*parts: str | None) -> str | None:
    """The salt of a request that gives vLLM's `cache_salt` and / or SGLang's `extra_key`:
    joined as SGLang joins them (None: neither)."""
    given = [p for p in parts if p is not None]
    return "".join(given) if given else None


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's: with include_usage, in every chunk


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` (StructuredOutputsParams): one constraint, and options."""

    model_config = ConfigDict(strict=True, extra="forbid")
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    whitespace_pattern: str | None = None
    disable_fallback: bool | None = None  # one backend: there is nothing to fall back to
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None

    def constraints(self) -> dict[str, Any]:
        """{"structured_outputs.<kind>": value} of the constraints set."""
        for name in ("whitespace_pattern", "disable_any_whitespace",
                     "disable_additional_properties"):  # fmt: skip
            if getattr(self, name):
                param = f"structured_outputs.{name}"
                raise ApiError(400, f"{param} is not supported", param, "unsupported")
        values = {"json": self.json_, "regex": self.regex, "choice": self.choice,
                  "grammar": self.grammar, "json_object": self.json_object or None,
                  "structural_tag": self.structural_tag}  # fmt: skip
        out = {f"structured_outputs.{k}": v for k, v in values.items() if v is not None}
        if not out:
            msg = "structured_outputs needs one of json, regex, choice, grammar, json_object, "
            msg += "structural_tag"
            raise _invalid(msg, "structured_outputs")
        return out


class _SamplingCore(_Strict):
    """Sampling fields with the same name in the OpenAI and the SGLang APIs."""

    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: TopK = None
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=2)
    stop: StopStrings = None
    stop_token_ids: TokenIds | None = None
    no_stop_trim: bool | None = None  # SGLang's: the text keeps the stop string it ends with
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    logit_bias: LogitBias | None = None
    regex: str | None = None  # structured output (`grammar_params`)
    ebnf: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)


class SamplingFields(_SamplingCore):
    """Sampling options of the OpenAI endpoints, SGLang's extras included."""

    seed: int | None = Field(None, ge=-_INT64, lt=_INT64)
    min_tokens: int | None = Field(None, ge=0)  # vLLM's (SGLang's min_new_tokens)
    include_stop_str_in_output: bool | None = None  # vLLM's no_stop_trim
    # vLLM's: keep the prompt's last k tokens (-1: as many as fit with the output)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    allowed_token_ids: TokenIds | None = Field(None, min_length=1)  # vLLM's: sample only these
    bad_words: list[str] | None = Field(None, max_length=MAX_BAD_WORDS)  # vLLM's: never these
    return_token_ids: bool | None = None  # vLLM's: the prompt's and the output's token ids
    # vLLM's: the logprobs' tokens spelled "token_id:N", not decoded (a token that is not
    # text on its own, such as part of a UTF-8 character, stays unambiguous)
    return_tokens_as_token_ids: bool | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # structured output besides regex and ebnf: OpenAI's and vLLM's forms
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's: each prompt token's logprob and rank, with this many best candidates (not when
    # streaming, as in vLLM)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    rid: RequestId | None = None  # SGLang's: the response's id, for /abort_request
    # vLLM's: the response's id after its prefix (`chatcmpl-`, `cmpl-`), echoed in the
    # X-Request-Id header; an X-Request-Id request header wins over it
    request_id: RequestId | None = None
    priority: int | None = Field(None, ge=-_INT64, lt=_INT64)  # SGLang's and vLLM's
    lora_path: str | None = None  # SGLang's: the LoRA adapter, when `model` names the base
    # vLLM's and SGLang's: cached prefixes are reused only by requests of the same salt, so
    # one tenant cannot tell from a fast first token that another sent the same prompt
    cache_salt: CacheSalt | None = None
    extra_key: CacheSalt | None = None  # SGLang's other name (with both: joined)

    def finish_subrequests(self, subs: list[Any]) -> list[Any]:
        """`subs` with the request's id, priority and cache salt, asking for vLLM's prompt
        logprobs if it does."""
        salt = joined_salt(self.cache_salt, self.extra_key)
        for sub in subs:
            sub.rid, sub.priority, sub.cache_salt = self.rid, self.priority, salt
            sub.return_token_ids = bool(self.return_token_ids)
            sub.return_tokens_as_token_ids = bool(self.return_tokens_as_token_ids)
        if self.truncate_prompt_tokens == 0:
            raise _invalid("truncate_prompt_tokens must be -1 or >= 1", "truncate_prompt_tokens")
        if self.prompt_logprobs is None:
            return subs
        if self.stream:
            raise _invalid("prompt_logprobs is not available when streaming", "prompt_logprobs")
        scorer: dict[int, int] = {}  # prompt -> its first sub-request, which scores it
        for sub in subs:
            sub.prompt_logprobs = self.prompt_logprobs
            first = scorer.setdefault(sub.prompt_index, sub.index)
            sub.prompt_scored_by = None if first == sub.index else first
        return subs

    def sampling_params(self, max_new_tokens: int | None) -> dict[str, Any]:
        """SGLang-style sampling dict (unset fields left to the engine's defaults)."""
        core_fields = set(_SamplingCore.model_fields) - {"n", "regex", "ebnf"}
        core = self.model_dump(include=core_fields, exclude_none=True)
        extra = {
            "max_new_tokens": max_new_tokens,
            "sampling_seed": self.seed,
            "min_new_tokens": self.min_tokens,
            "no_stop_trim": self.include_stop_str_in_output or None,
            "truncate_prompt_tokens": self.truncate_prompt_tokens,
            "allowed_token_ids": self.allowed_token_ids,
            "bad_words": self.bad_words or None,
        }
        return core | {k: v for k, v in extra.items() if v is not None} | grammar_params(self)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


STRUCTURED_FIELDS = ("response_format", "regex", "ebnf", "guided_json", "guided_regex",
                     "guided_choice", "guided_grammar")  # fmt: skip


def _invalid(message: str, param: str) -> ApiError:
    return ApiError(400, message, param, "invalid_value")


def grammar_params(request: Any) -> dict[str, str]:
    """The one grammar parameter `request`'s structured output fields ask for ({} if none)."""
    values = {name: getattr(request, name) for name in STRUCTURED_FIELDS}
    if getattr(request, "structured_outputs", None) is not None:
        values |= request.structured_outputs.constraints()
    given = {name: value for name, value in values.items() if value is not None}
    fmt = given.get("response_format")
    if fmt is not None and fmt.get("type", "text") == "text":
        del given["response_format"]  # plain text: no constraint
    if len(given) > 1:
        names = ", ".join(given)
        raise _invalid(
            f"only one structured output option may be set, got {names}", list(given)[1]
        )
    if not given:
        return {}
    (name, value), = given.items()
    kind = name.rsplit(".", 1)[-1].removeprefix("guided_")
    if kind == "structural_tag" or (kind == "response_format"
                                    and value.get("type") == "structural_tag"):
        return {"structural_tag": _structural_tag(value, name)}
    if kind == "response_format":
        return {"json_schema": _response_format_schema(value)}
    if kind == "regex":
        return {"regex": value}
    if kind in ("ebnf", "grammar"):
        return {"ebnf": value}
    if kind == "json":
        return {"json_schema": value if isinstance(value, str) else json.dumps(value)}
    if kind == "json_object":
        return {"json_schema": JSON_OBJECT}
    return {"ebnf": _choice_grammar(value, name)}


def _response_format_schema(fmt: dict[str, Any]) -> str:
    kind = fmt.get("type")
    if kind == "json_object":
        return JSON_OBJECT
    if kind != "json_schema":
        raise _invalid(
            "response_format type must be text, json_object, json_schema or structural_tag, "
            f"got {kind!r}",
            "response_format",
        )
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise _invalid(
            "response_format json_schema must be an object with a schema", "response_format"
        )
    schema = spec.get("schema", spec.get("schema_"))  # (pydantic's alias in some clients)
    if schema is None:
        return ANY_JSON
    if not isinstance(schema, (dict, bool)):
        raise _invalid(
            "response_format json_schema.schema must be a JSON schema object", "response_format"
        )
    return json.dumps(schema)


def _structural_tag(tag: dict[str, Any] | str, param: str) -> str:
    try:
        return structural_tag_json(tag)
    except ValueError as exc:
        raise _invalid(f"{param} {exc}", param) from None


def _choice_grammar(choices: list[str], param: str) -> str:
    if not choices or not all(choices):
        raise _invalid(f"{param} must be a non-empty list of non-empty strings", param)
    # EBNF string literals take JSON's escapes
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)

"""Messages bound for a router (its plain stream `{p}:router:{r}:out`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from shared.messages.base import Message
from shared.messages.common import Columnar, FinishReason, PromptLogprobs, check_optional_lengths
from shared.messages.schema import MessageError


class DetokRow(NamedTuple):
    """The text of output tokens [start, end) of one request (a row of `DetokOutputMsg`).

    `text` is the delta those tokens add; it may be empty while an incomplete character is
    held back, and the held-back text then arrives with a later range. Ranges of one
    request may arrive out of order or twice: order by `start`, ignore ranges already seen.
    The final row (finish reason set) carries the usage figures the API reports, the first
    (start 0) the prompt logprobs and the prompt's ids when requested.
    """

    rid: str
    start: int
    end: int
    text: str
    output_ids: list[int]
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    token_logprobs: list[float] | None = None
    top_logprobs_ids: list[list[int]] | None = None
    top_logprobs_vals: list[list[float]] | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_ids: list[int] | None = None
    embedding: bytes | None = None  # an embedding request's (float32, little-endian)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class DetokOutputMsg(Columnar, Message):
    """detokenizer → router `router_id`: the rows of one step that belong to this router.

    Columnar like `StepOutputMsg`; see `DetokRow`. `worker_id` and `step` identify the step
    message the rows came from.
    """

    TAG = "detok_output"
    VERSION = 5  # 3: prompt logprobs carry ranks; 4: prompt_ids; 5: embeddings
    ROW = DetokRow
    COLUMNS = (
        "rids", "starts", "ends", "texts", "output_ids", "finish_reasons", "prompt_tokens",
        "completion_tokens", "cached_tokens", "token_logprobs", "top_logprobs_ids",
        "top_logprobs_vals", "prompt_logprobs", "prompt_ids", "embeddings",
    )  # fmt: skip

    router_id: str
    worker_id: str
    step: int
    rids: list[str]
    starts: list[int]
    ends: list[int]
    texts: list[str]
    output_ids: list[list[int]]
    finish_reasons: list[FinishReason | None]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    token_logprobs: list[list[float] | None]
    top_logprobs_ids: list[list[list[int]] | None]
    top_logprobs_vals: list[list[list[float]] | None]
    prompt_logprobs: list[PromptLogprobs | None]
    prompt_ids: list[list[int] | None]
    embeddings: list[bytes | None]

    def _check(self) -> None:
        self._check_columns()
        for i, (start, end, ids) in enumerate(
            zip(self.starts, self.ends, self.output_ids, strict=True)
        ):
            if start < 0 or end - start != len(ids):
                raise MessageError(
                    f"DetokOutputMsg.rows[{i}]: range [{start}, {end}) with {len(ids)} token(s)"
                )
        lengths = [len(ids) for ids in self.output_ids]
        for name in ("token_logprobs", "top_logprobs_ids", "top_logprobs_vals"):
            check_optional_lengths("DetokOutputMsg", name, getattr(self, name), lengths)


@dataclass(frozen=True, slots=True)
class ErrorMsg(Message):
    """any service → router `router_id`: request `rid` failed and will produce no output.

    `code` is a short machine-readable name (`prompt_too_long`, `invalid_request`,
    `internal`); `status` the HTTP status the router should answer with; `source` the
    service that failed it (for example `tokenizer:host-1234`).
    """

    TAG = "error"
    VERSION = 1

    rid: str
    router_id: str
    code: str
    message: str
    status: int = 400
    source: str = ""


@dataclass(frozen=True, slots=True)
class FlushCacheRespMsg(Message):
    """worker → router `router_id`: the answer to a `FlushCacheReqMsg`."""

    TAG = "flush_cache_resp"
    VERSION = 1

    request_id: str
    router_id: str
    worker_id: str
    success: bool
    message: str = ""


@dataclass(frozen=True, slots=True)
class ProfileRespMsg(Message):
    """worker → router `router_id`: the answer to a `ProfileReqMsg`; `paths`: the trace
    files a stop wrote."""

    TAG = "profile_resp"
    VERSION = 1

    request_id: str
    router_id: str
    worker_id: str
    success: bool
    message: str = ""
    paths: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class LoraRespMsg(Message):
    """worker → router `router_id`: the answer to a `LoraReqMsg`. `lora_enabled`: whether
    the worker serves LoRA at all (a worker without it refuses every load); `adapters`: the
    adapters it serves after the call, name -> folder."""

    TAG = "lora_resp"
    VERSION = 1

    request_id: str
    router_id: str
    worker_id: str
    success: bool
    message: str = ""
    lora_enabled: bool = False
    adapters: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class UpdateWeightsRespMsg(Message):
    """worker → router `router_id`: the answer to an `UpdateWeightsReqMsg`;
    `num_paused_requests`: the requests held back while it waited and updated;
    `weights_path`: the checkpoint its weights are from after the call."""

    TAG = "update_weights_resp"
    VERSION = 1

    request_id: str
    router_id: str
    worker_id: str
    success: bool
    message: str = ""
    num_paused_requests: int = 0
    weights_path: str = ""


@dataclass(frozen=True, slots=True)
class TokenizeRespMsg(Message):
    """tokenizer → router `router_id`: the answer to a `TokenizeReqMsg` whose `reply` is
    "tokenize" (`input_ids`, and `token_strs` if asked for) or "detokenize" (`text` of the
    ids, which `input_ids` repeats)."""

    TAG = "tokenize_resp"
    VERSION = 1

    rid: str
    router_id: str
    input_ids: list[int]
    text: str | None = None
    token_strs: list[str] | None = None


@dataclass(frozen=True, slots=True)
class AbortNamedMsg(Message):
    """router → router: end your requests named `rid` (None: all of them), as /abort_request
    asked of router `router_id`, which waits for an `AbortNamedRespMsg` on its stream."""

    TAG = "abort_named"
    VERSION = 1

    request_id: str
    router_id: str
    rid: str | None
    reason: str


@dataclass(frozen=True, slots=True)
class AbortNamedRespMsg(Message):
    """router → router: the answer to an `AbortNamedMsg`; `router_id` is the router that
    answers, `num_aborted` how many of its requests it ended."""

    TAG = "abort_named_resp"
    VERSION = 1

    request_id: str
    router_id: str
    num_aborted: int


@dataclass(frozen=True, slots=True)
class PauseRespMsg(Message):
    """worker → router `router_id`: the answer to a `PauseReqMsg`; `num_requests`: the
    requests the call acted on (a pause's aborted, retracted or kept ones; the waiting ones
    a resume let run)."""

    TAG = "pause_resp"
    VERSION = 1

    request_id: str
    router_id: str
    worker_id: str
    success: bool
    message: str = ""
    num_requests: int = 0


@dataclass(frozen=True, slots=True)
class MemoryRespMsg(Message):
    """worker → router `router_id`: the answer to a `MemoryReqMsg`; `released`: the tags
    released after it, `num_bytes` the bytes it gave back or took."""

    TAG = "memory_resp"
    VERSION = 1

    request_id: str
    router_id: str
    worker_id: str
    success: bool
    message: str = ""
    released: list[str] = field(default_factory=list)
    num_bytes: int = 0


@dataclass(frozen=True, slots=True)
class WeightsReadRespMsg(Message):
    """worker → router `router_id`: the answer to a `WeightsReadReqMsg`: the values read, or
    why not (`success` false)."""

    TAG = "weights_read_resp"
    VERSION = 1

    request_id: str
    router_id: str
    worker_id: str
    success: bool
    message: str = ""
    values: list[float] = field(default_factory=list)

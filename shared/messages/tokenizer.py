"""Messages bound for the tokenizers (stream `{p}:tokenize`, group `tokenizers`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shared.messages.base import Message, Record
from shared.messages.schema import MessageError


@dataclass(frozen=True, slots=True)
class ChatMessage(Record):
    """One turn of an OpenAI-style chat: role ("system", "user", "assistant", ...) and text."""

    role: str
    content: str


@dataclass(frozen=True, slots=True)
class TokenizeReqMsg(Message):
    """router → tokenizers: a request to tokenize and forward to worker `worker_id`.

    Exactly one of `text`, `messages` (rendered with the model's chat template, generation
    prompt added) or `input_ids` (forwarded as is) is set. `sampling_params` is the
    request's SGLang-style sampling dict (`max_new_tokens`, `temperature`, `stop`,
    `skip_special_tokens`, ...), plain data; the tokenizer lifts the detokenizer flags and
    stop strings out of it into `GenerateReqMsg`. `created` is the router's `time.time()`
    when the request arrived.
    """

    TAG = "tokenize_req"
    VERSION = 2

    rid: str
    router_id: str
    worker_id: str
    text: str | None = None
    messages: list[ChatMessage] | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1  # with return_logprob: prompt logprobs from there (-1: none)
    created: float = 0.0

    def _check(self) -> None:
        given = [self.text is not None, self.messages is not None, self.input_ids is not None]
        if sum(given) != 1:
            raise MessageError(
                f"TokenizeReqMsg {self.rid}: exactly one of text, messages, input_ids must be set"
            )
        if self.top_logprobs_num < 0:
            raise MessageError(f"TokenizeReqMsg {self.rid}: top_logprobs_num must be >= 0")
        if self.logprob_start_len < -1:
            raise MessageError(f"TokenizeReqMsg {self.rid}: logprob_start_len must be >= -1")

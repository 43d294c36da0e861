"""Messages bound for the tokenizers (stream `{p}:tokenize`, group `tokenizers`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shared.messages.base import Message, Record
from shared.messages.schema import MessageError


@dataclass(frozen=True, slots=True)
class ChatMessage(Record):
    """One turn of an OpenAI-style chat: role ("system", "user", "assistant", "tool") and text.

    An assistant turn may carry the tool calls it made (`tool_calls`: OpenAI's
    `[{"id", "type": "function", "function": {"name", "arguments"}}]`, arguments as a JSON
    text); a tool turn names the call it answers (`tool_call_id`) and maybe the tool (`name`).
    """

    role: str
    content: str
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


@dataclass(frozen=True, slots=True)
class TokenizeReqMsg(Message):
    """router → tokenizers: a request to tokenize and forward to worker `worker_id`.

    Exactly one of `text`, `messages` (rendered with the model's chat template, generation
    prompt added) or `input_ids` (forwarded as is) is set. `sampling_params` is the
    request's SGLang-style sampling dict (`max_new_tokens`, `temperature`, `stop`,
    `skip_special_tokens`, ...), plain data; the tokenizer lifts the detokenizer flags and
    stop strings out of it into `GenerateReqMsg`. `created` is the router's `time.time()`
    when the request arrived. With `messages`, `tools` (OpenAI's tool definitions) and
    `chat_template_kwargs` (extra template variables) go to the chat template;
    `add_generation_prompt` opens the assistant's turn after them (the default), and
    `continue_final_message` leaves the last message open for the output to continue it
    (HF's and vLLM's options; at most one of the two).

    `embed` makes it an embedding request: the prompt is pooled into one vector by a worker
    serving an embedding model or a classifier (`sampling_params` then asks for no new
    tokens). `text_pair` (with `text`): the prompt is the pair as the tokenizer joins two
    texts (a cross-encoder's query and document).

    `reply` "tokenize" or "detokenize" makes it a query, answered to the router with a
    `TokenizeRespMsg` instead of forwarded (`worker_id` is then unused): the ids of `text` or
    `messages` (`add_special_tokens`: None for the default, true for text, false for messages
    whose template writes them; `return_token_strs` adds the tokens' strings), or the text of
    `input_ids` (special tokens skipped if `sampling_params` says `skip_special_tokens`).
    """

    TAG = "tokenize_req"
    # 7: priority; 8: return_prompt_ids; 9: lora_name; 10: embed; 11: text_pair; 12: cache_salt
    VERSION = 12

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
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    reply: str = ""  # "" (generate), "tokenize" or "detokenize"
    return_prompt_ranks: bool = False  # the prompt logprobs' ranks too (vLLM's)
    add_special_tokens: bool | None = None
    return_token_strs: bool = False
    priority: int | None = None  # with the worker's priority scheduling (SGLang's)
    return_prompt_ids: bool = False  # the prompt's ids come back with the first output row
    lora_name: str | None = None  # the worker's LoRA adapter to run with (None: base model)
    embed: bool = False  # an embedding request (`/v1/embeddings`), for an embedding worker
    text_pair: str | None = None  # the second text of a pair (`/v1/score`, `/v1/rerank`)
    # shares cached prefixes only with requests of the same salt (vLLM's cache_salt)
    cache_salt: str | None = None

    def _check(self) -> None:
        given = [self.text is not None, self.messages is not None, self.input_ids is not None]
        if sum(given) != 1:
            raise MessageError(
                f"TokenizeReqMsg {self.rid}: exactly one of text, messages, input_ids must be set"
            )
        if self.text_pair is not None and self.text is None:
            raise MessageError(f"TokenizeReqMsg {self.rid}: text_pair needs text")
        if self.cache_salt == "":
            raise MessageError(f"TokenizeReqMsg {self.rid}: cache_salt is empty")
        if self.top_logprobs_num < 0:
            raise MessageError(f"TokenizeReqMsg {self.rid}: top_logprobs_num must be >= 0")
        if self.logprob_start_len < -1:
            raise MessageError(f"TokenizeReqMsg {self.rid}: logprob_start_len must be >= -1")
        if self.reply not in ("", "tokenize", "detokenize"):
            raise MessageError(f"TokenizeReqMsg {self.rid}: unknown reply {self.reply!r}")
        if self.reply == "detokenize" and self.input_ids is None:
            raise MessageError(f"TokenizeReqMsg {self.rid}: detokenize needs input_ids")

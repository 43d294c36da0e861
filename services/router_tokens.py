"""`POST /tokenize` and `POST /detokenize` (vLLM's and SGLang's, also at `/v1/...`),
answered by the tokenizer services.

The router sends a `TokenizeReqMsg` whose `reply` is "tokenize" or "detokenize" to the
tokenizers' stream, so the text is rendered and encoded by the same tokenizer, loaded the
same way, as a generation request's; the answer (`TokenizeRespMsg`, or an `ErrorMsg` for a
bad request) comes back on the router's own stream and `deliver()` hands it over.

    POST /tokenize    {"model", "prompt", "add_special_tokens": true, "return_token_strs"}
                   or {"model", "messages", "add_generation_prompt", "continue_final_message",
                       "add_special_tokens": false, "tools", "chat_template_kwargs", ...}
                   →  {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize  {"model", "tokens": [ids], "skip_special_tokens": false}
                   →  {"prompt": text, "text": text}

The two projects differ in places; both shapes are served: a list of prompts (SGLang's batch)
gives lists of `tokens` and `count`, a list of id lists gives a list of texts, and the text
comes as vLLM's `prompt` and SGLang's `text`. Special tokens are kept in the text unless
`skip_special_tokens` (vLLM keeps them; SGLang's default skips them).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

import redis
from pydantic import Field, model_validator

from services.router_chat import ChatMessageIn, ToolDef, tool_dicts
from services.router_fields import ApiError, _Strict
from shared.async_bus import AsyncBus
from shared.keys import tokenize_stream
from shared.messages import ErrorMsg, TokenizeReqMsg, TokenizeRespMsg

QUERY_TIMEOUT_S = 30.0


class TokenizeBody(_Strict):
    """vLLM's tokenize request: a completion's `prompt`, or a chat's `messages`."""

    model: str | None = None
    prompt: str | list[str] | None = None
    messages: list[ChatMessageIn] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    tools: list[ToolDef] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeBody:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("pass exactly one of prompt and messages")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt: the list is empty")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt=false")
        return self

    def queries(self, new_rid: Callable[[], str], router_id: str) -> list[TokenizeReqMsg]:
        """One query per prompt (a batch is SGLang's)."""
        if not isinstance(self.prompt, list):
            return [self.query(new_rid(), router_id)]
        return [self.model_copy(update={"prompt": p}).query(new_rid(), router_id)
                for p in self.prompt]  # fmt: skip

    def query(self, rid: str, router_id: str) -> TokenizeReqMsg:
        chat = {}
        if self.messages is not None:
            chat = {"messages": [m.flat() for m in self.messages], "tools": tool_dicts(self.tools),
                    "chat_template_kwargs": self.chat_template_kwargs,
                    "add_generation_prompt": bool(self.add_generation_prompt),
                    "continue_final_message": bool(self.continue_final_message)}  # fmt: skip
        return TokenizeReqMsg(rid, router_id, "", text=self.prompt, reply="tokenize",
                              add_special_tokens=self.add_special_tokens,
                              return_token_strs=bool(self.return_token_strs), **chat)  # fmt: skip


class DetokenizeBody(_Strict):
    model: str | None = None
    tokens: list[int] | list[list[int]] = Field(max_length=1 << 20)
    skip_special_tokens: bool | None = False

    def queries(self, new_rid: Callable[[], str], router_id: str) -> list[TokenizeReqMsg]:
        batch = self.tokens if self.is_batch else [self.tokens]
        params = {"skip_special_tokens": bool(self.skip_special_tokens)}
        return [TokenizeReqMsg(new_rid(), router_id, "", input_ids=ids, reply="detokenize",
                               sampling_params=params) for ids in batch]  # fmt: skip

    @property
    def is_batch(self) -> bool:
        return bool(self.tokens) and isinstance(self.tokens[0], list)


class TokenQueries:
    """Queries in flight to the tokenizers, by request id."""

    def __init__(self, bus: AsyncBus, router_id: str) -> None:
        self.bus, self.router_id = bus, router_id
        self._pending: dict[str, asyncio.Future] = {}

    def new_rid(self) -> str:
        return f"tok-{uuid.uuid4().hex}"

    async def ask(self, msg: TokenizeReqMsg, timeout_s: float = QUERY_TIMEOUT_S) -> Any:
        """The tokenizers' answer to `msg`; ApiError for theirs, or if none comes in time."""
        future = self._pending[msg.rid] = asyncio.get_running_loop().create_future()
        try:
            await self.bus.publish(tokenize_stream(self.bus.prefix), msg)
            answer = await asyncio.wait_for(future, timeout_s)
        except redis.RedisError as exc:
            raise ApiError(503, f"message bus unavailable: {exc}", None, "bus_unavailable") from exc
        except asyncio.TimeoutError:
            raise ApiError(504, f"no tokenizer answered in {timeout_s:g} s", None,
                           "timeout") from None  # fmt: skip
        finally:
            self._pending.pop(msg.rid, None)
        if isinstance(answer, ErrorMsg):
            raise ApiError(answer.status, answer.message, None, answer.code)
        return answer

    def deliver(self, msg: TokenizeRespMsg | ErrorMsg) -> bool:
        """Hand an answer to its query; False if it is not one (or came too late)."""
        future = self._pending.get(msg.rid)
        if future is None or future.done():
            return False
        future.set_result(msg)
        return True


async def tokenize(queries: TokenQueries, body: TokenizeBody, max_len: int | None) -> dict:
    msgs = body.queries(queries.new_rid, queries.router_id)
    answers = await asyncio.gather(*(queries.ask(m) for m in msgs))
    if not isinstance(body.prompt, list):
        (a,) = answers
        return {"count": len(a.input_ids), "max_model_len": max_len, "tokens": a.input_ids,
                "token_strs": a.token_strs}  # fmt: skip
    return {"count": [len(a.input_ids) for a in answers], "max_model_len": max_len,
            "tokens": [a.input_ids for a in answers],
            "token_strs": [a.token_strs for a in answers] if body.return_token_strs else None}


async def detokenize(queries: TokenQueries, body: DetokenizeBody) -> dict:
    msgs = body.queries(queries.new_rid, queries.router_id)
    answers = await asyncio.gather(*(queries.ask(m) for m in msgs))
    text: str | list[str] = [a.text for a in answers] if body.is_batch else answers[0].text
    return {"prompt": text, "text": text}

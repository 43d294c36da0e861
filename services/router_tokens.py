"""vLLM's `POST /tokenize` and `POST /detokenize`, answered by the tokenizer services.

The router sends a `TokenizeReqMsg` whose `reply` is "tokenize" or "detokenize" to the
tokenizers' stream, so the text is rendered and encoded by the same tokenizer, loaded the
same way, as a generation request's; the answer (`TokenizeRespMsg`, or an `ErrorMsg` for a
bad request) comes back on the router's own stream and `deliver()` hands it over.

    POST /tokenize    {"model", "prompt", "add_special_tokens": true, "return_token_strs"}
                   or {"model", "messages", "add_generation_prompt", "continue_final_message",
                       "add_special_tokens": false, "tools", "chat_template_kwargs", ...}
                   →  {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize  {"model", "tokens": [ids]}  →  {"prompt": text}
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import redis
from pydantic import Field, model_validator

from services.router_chat import ChatMessageIn, ToolDef
from services.router_fields import ApiError, _Strict
from shared.async_bus import AsyncBus
from shared.keys import tokenize_stream
from shared.messages import ErrorMsg, TokenizeReqMsg, TokenizeRespMsg

QUERY_TIMEOUT_S = 30.0


class TokenizeBody(_Strict):
    """vLLM's tokenize request: a completion's `prompt`, or a chat's `messages`."""

    model: str | None = None
    prompt: str | None = None
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
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt=false")
        return self

    def query(self, rid: str, router_id: str) -> TokenizeReqMsg:
        chat = {}
        if self.messages is not None:
            tools = [t.model_dump(exclude_none=True) for t in self.tools or []]
            chat = {"messages": [m.flat() for m in self.messages], "tools": tools or None,
                    "chat_template_kwargs": self.chat_template_kwargs,
                    "add_generation_prompt": bool(self.add_generation_prompt),
                    "continue_final_message": bool(self.continue_final_message)}  # fmt: skip
        return TokenizeReqMsg(rid, router_id, "", text=self.prompt, reply="tokenize",
                              add_special_tokens=self.add_special_tokens,
                              return_token_strs=bool(self.return_token_strs), **chat)  # fmt: skip


class DetokenizeBody(_Strict):
    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)


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
    answer = await queries.ask(body.query(queries.new_rid(), queries.router_id))
    return {"count": len(answer.input_ids), "max_model_len": max_len,
            "tokens": answer.input_ids, "token_strs": answer.token_strs}  # fmt: skip


async def detokenize(queries: TokenQueries, body: DetokenizeBody) -> dict:
    msg = TokenizeReqMsg(queries.new_rid(), queries.router_id, "", input_ids=body.tokens,
                         reply="detokenize")  # fmt: skip
    answer = await queries.ask(msg)
    return {"prompt": answer.text}

"""A Responses API request's output (services/responses_api.py), from its chat completion.

Whole: the chat completion's message becomes output items: a `reasoning` item (the reasoning
parser's text, as `reasoning_text` content), a `message` item with one `output_text` part
(always, unless the model only called tools), and a `function_call` item per tool call.
finish_reason `length` makes the response `incomplete` (`max_output_tokens`), `abort`
makes it `cancelled`.

Streamed: the chat chunks become the API's events, each with its `sequence_number`:
`response.created` and `response.in_progress`; per item `response.output_item.added`, its
deltas (`response.reasoning_text.delta`, `response.content_part.added` then
`response.output_text.delta`, `response.function_call_arguments.delta`), their `.done`
events and `response.output_item.done`; and `response.completed` (or `.incomplete`) with the
whole response and its usage. An error after the stream started is an `error` event
followed by `response.failed` (the failed response is stored, as a finished one is). Usage
has no reasoning token count (`reasoning_tokens` is 0).

Logprobs (`include: ["message.output_text.logprobs"]`): the `output_text` part carries those
of every output token, reasoning and calls included (as vLLM's does; the chat's logprobs are
per token, the reasoning split per text). Streamed, each `response.output_text.delta` has the
tokens generated since the last one, and the finished part has them all.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from services.responses_api import ResponsesRequest
from services.responses_items import (
    call_item,
    chat_logprobs,
    message_item,
    new_id,
    reasoning_item,
    sse_event,
    text_part,
)
from services.router_responses import Formatter

_STATUS = {"length": ("incomplete", {"reason": "max_output_tokens"}), "abort": ("cancelled", None)}


def _status(finish: str | None) -> tuple[str, dict | None]:
    return _STATUS.get(finish or "", ("completed", None))


def _usage(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if chat_usage is None:
        return None
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"],
    }


async def _after(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    yield first
    async for chunk in rest:
        yield chunk


class ResponseShaper:
    def __init__(
        self, body: ResponsesRequest, fmt: Formatter, save: Callable[..., Awaitable] | None = None
    ) -> None:
        self.body, self.fmt = body, fmt
        self.save = save  # stores the final response (services/responses_store.py)
        self.id, self.created = body._extras.get("rid") or new_id("resp"), int(time.time())
        self._seq = 0
        self._items: list[dict[str, Any]] = []  # output items, the last one maybe open
        self._open: str | int | None = None  # "reasoning", "message" or a call's index
        self._pieces: list[str] = []  # the open message's text
        self._logprobs: list[dict[str, Any]] = []  # every output token's so far
        self._unsent = 0  # how many of them no output_text delta has carried yet

    def envelope(self, status: str, output: list, usage: dict | None = None,
                 incomplete: dict | None = None) -> dict[str, Any]:  # fmt: skip
        b, extras = self.body, self.body._extras
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "error": None, "incomplete_details": incomplete, "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens, "model": b.model, "output": output,
            "parallel_tool_calls": extras.get("parallel_tool_calls", True),
            "previous_response_id": b.previous_response_id,
            "reasoning": {"effort": (b.reasoning or {}).get("effort"), "summary": None},
            "store": self.save is not None,
            "temperature": extras.get("temperature"), "top_p": extras.get("top_p"),
            "text": b.text or {"format": {"type": "text"}}, "tool_choice": b.tool_choice or "auto",
            "tools": b.tools or [], "top_logprobs": b.top_logprobs,
            "truncation": b.truncation or "disabled", "usage": usage,
            "metadata": b.metadata or {}, "background": bool(b.background),
        }  # fmt: skip

    # -- whole ----------------------------------------------------------------------------------
    async def response(self) -> dict[str, Any]:
        chat = await self.fmt.response()
        choice = chat["choices"][0]
        msg = choice["message"]
        output = []
        if msg.get("reasoning_content"):
            output.append(reasoning_item(msg["reasoning_content"]))
        calls = msg.get("tool_calls") or []
        if msg.get("content") or not calls:
            output.append(message_item(msg.get("content") or "", logprobs=chat_logprobs(choice)))
        for c in calls:
            output.append(call_item(c["id"], c["function"]["name"], c["function"]["arguments"]))
        status, incomplete = _status(choice["finish_reason"])
        final = self.envelope(status, output, _usage(chat.get("usage")), incomplete)
        if self.save is not None:
            await self.save(final)
        return final

    # -- streamed -------------------------------------------------------------------------------
    async def events(self) -> AsyncIterator[bytes]:
        chunks = self.fmt.chunks()
        try:
            first = await chunks.__anext__()  # an error before any output stays an HTTP error
            yield self.event("response.created", response=self.envelope("in_progress", []))
            yield self.event("response.in_progress", response=self.envelope("in_progress", []))
            usage = finish = None
            async for raw in _after(first, chunks):
                data = raw.removeprefix(b"data: ").strip()
                if data == b"[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    failed, events = self._fail(obj["error"])
                    if self.save is not None:
                        await self.save(failed)
                    for ev in events:
                        yield ev
                    return
                if not obj["choices"]:
                    usage = obj.get("usage")
                else:
                    choice = obj["choices"][0]
                    new = chat_logprobs(choice)
                    self._logprobs += new
                    self._unsent += len(new)
                    for ev in self._delta(choice["delta"]):
                        yield ev
                    finish = choice.get("finish_reason") or finish
            for ev in self._close():
                yield ev
            for item in self._items:  # tokens after the text closed too, as in a whole one
                if item["type"] == "message":
                    item["content"][0]["logprobs"] = list(self._logprobs)
            status, incomplete = _status(finish)
            kind = "response.completed" if status == "completed" else f"response.{status}"
            final = self.envelope(status, self._items, _usage(usage), incomplete)
            if self.save is not None:  # stored before the client hears it is done
                await self.save(final)
            yield self.event(kind, response=final)
        finally:
            await chunks.aclose()

    def event(self, kind: str, **fields: Any) -> bytes:
        self._seq += 1
        return sse_event(kind, self._seq - 1, **fields)

    def _delta(self, delta: dict[str, Any]) -> list[bytes]:
        """The events of one chat delta. Its content and call pieces are in the order they
        were generated: a call being streamed ends before content that follows it, and
        content ends before a call that it precedes."""
        out: list[bytes] = []
        if delta.get("reasoning_content"):
            out += self._text("reasoning", delta["reasoning_content"])
        calls = delta.get("tool_calls") or []
        content = delta.get("content")
        if calls and isinstance(self._open, int) and calls[0]["index"] == self._open:
            out += self._arguments(calls[0])  # the rest of the call being streamed
            calls = calls[1:]
        if content:
            out += self._text("message", content)
        for call in calls:
            out += self._arguments(call)
        return out

    def _open_item(self, kind: str | int, item: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self._items.append(item)
        self._open, self._pieces = kind, []
        index = len(self._items) - 1
        out.append(self.event("response.output_item.added", output_index=index, item=item))
        if kind == "message":
            ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
            out.append(self.event("response.content_part.added", **ids, part=text_part("")))
        return out

    def _text(self, kind: str, text: str) -> list[bytes]:
        out = []
        if self._open != kind:
            item = reasoning_item("") if kind == "reasoning" else message_item("", "in_progress")
            out = self._open_item(kind, item)
        item, index = self._items[-1], len(self._items) - 1
        if kind == "reasoning":
            item["content"][0]["text"] += text
            name = "response.reasoning_text.delta"
        else:
            self._pieces.append(text)
            name = "response.output_text.delta"
        extra = {}
        if kind == "message":
            extra["logprobs"] = self._logprobs[len(self._logprobs) - self._unsent :]
            self._unsent = 0
        out.append(self.event(name, item_id=item["id"], output_index=index, content_index=0,
                              delta=text, **extra))  # fmt: skip
        return out

    def _arguments(self, call: dict[str, Any]) -> list[bytes]:
        fn = call.get("function") or {}
        out = []
        if self._open != call["index"]:
            item = call_item(call["id"], fn["name"], "", "in_progress")
            out = self._open_item(call["index"], item)
        piece = fn.get("arguments") or ""
        if piece:
            item = self._items[-1]
            item["arguments"] += piece
            out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                  output_index=len(self._items) - 1, delta=piece))  # fmt: skip
        return out

    def _close(self) -> list[bytes]:
        """The `.done` events of the open item, if any."""
        if self._open is None:
            return []
        item, index = self._items[-1], len(self._items) - 1
        ids = {"item_id": item["id"], "output_index": index}
        out = []
        if self._open == "reasoning":
            text = item["content"][0]["text"]
            out.append(self.event("response.reasoning_text.done", **ids, content_index=0,
                                  text=text))  # fmt: skip
        elif self._open == "message":
            part = text_part("".join(self._pieces), list(self._logprobs))
            item["content"], item["status"] = [part], "completed"
            out.append(self.event("response.output_text.done", **ids, content_index=0,
                                  text=part["text"], logprobs=part["logprobs"]))  # fmt: skip
            out.append(self.event("response.content_part.done", **ids, content_index=0,
                                  part=part))  # fmt: skip
        else:
            item["status"] = "completed"
            out.append(self.event("response.function_call_arguments.done", **ids,
                                  arguments=item["arguments"]))  # fmt: skip
        out.append(self.event("response.output_item.done", output_index=index, item=item))
        self._open = None
        return out

    def output_so_far(self) -> list[dict[str, Any]]:
        """The output items so far, an open one `incomplete` with what it has (the output of
        a response that fails)."""
        items = [dict(item) for item in self._items]
        if self._open is not None:
            last = items[-1]
            if self._open == "message":
                last["content"] = [text_part("".join(self._pieces), list(self._logprobs))]
            if "status" in last:
                last["status"] = "incomplete"
        return items

    def _fail(self, error: dict[str, Any]) -> tuple[dict[str, Any], list[bytes]]:
        """The failed response, and its events."""
        out = [self.event("error", code=error.get("code"), message=error.get("message"),
                          param=error.get("param"))]  # fmt: skip
        failed = self.envelope("failed", self.output_so_far())
        failed["error"] = {"code": error.get("code"), "message": error.get("message")}
        out.append(self.event("response.failed", response=failed))
        return failed, out

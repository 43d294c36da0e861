"""The items and events of a Responses API response (services/responses_stream.py builds
them from a chat completion): output items, one event's bytes, and the output that a
response's stored events add up to (services/responses_background.py)."""

from __future__ import annotations

import json
import uuid
from typing import Any


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def text_part(text: str, logprobs: list | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def chat_logprobs(choice: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat choice's (or chunk's) token logprobs, in the Responses API's shape (the same)."""
    return list((choice.get("logprobs") or {}).get("content") or [])


def message_item(
    text: str, status: str = "completed", logprobs: list | None = None
) -> dict[str, Any]:
    content = [text_part(text, logprobs)] if status == "completed" else []
    return {"type": "message", "id": new_id("msg"), "status": status, "role": "assistant",
            "content": content}  # fmt: skip


def reasoning_item(text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": new_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}  # fmt: skip


def call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": new_id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}  # fmt: skip


def sse_event(kind: str, sequence_number: int, **fields: Any) -> bytes:
    """One event of a streamed response, as it goes to the client."""
    obj = {"type": kind, "sequence_number": sequence_number, **fields}
    data = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n".encode()


def output_from_events(events: list[bytes]) -> list[dict[str, Any]]:
    """The output items that a response's events (`sse_event`s, in order) add up to, those not
    done `incomplete` with what they have: the output of a response whose router died while
    it generated (services/responses_background.py), as `ResponseShaper.output_so_far`."""
    items: list[dict[str, Any]] = []
    texts: dict[int, list[str]] = {}  # the output_text deltas of an open message
    logprobs: dict[int, list[dict]] = {}  # and their logprobs
    done: set[int] = set()
    for event in events:
        obj = json.loads(event[event.index(b"data: ") + 6:])
        kind, index = obj["type"], obj.get("output_index")
        if kind == "response.output_item.added":
            items.append(obj["item"])
            texts[index], logprobs[index] = [], []
        elif kind == "response.output_item.done":
            items[index] = obj["item"]
            done.add(index)
        elif kind == "response.output_text.delta":
            texts[index].append(obj["delta"])
            logprobs[index] += obj.get("logprobs") or []
        elif kind == "response.reasoning_text.delta":
            items[index]["content"][0]["text"] += obj["delta"]
        elif kind == "response.function_call_arguments.delta":
            items[index]["arguments"] += obj["delta"]
    for index, item in enumerate(items):
        if index in done:
            continue
        if item["type"] == "message":
            item["content"] = [text_part("".join(texts[index]), logprobs[index])]
        if "status" in item:
            item["status"] = "incomplete"
    return items

"""The Responses API's events from chat chunks (services/responses_stream.py), without a
router: the order of items when one chat delta carries the end of a call and the content
after it, or content and the call that follows it; an error mid-stream."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from services.responses_api import ResponsesRequest
from services.responses_items import output_from_events
from services.responses_stream import ResponseShaper


class FakeFormatter:
    def __init__(self, chunks: list[dict | str]) -> None:
        self._chunks = chunks

    async def chunks(self) -> AsyncIterator[bytes]:
        for c in self._chunks:
            yield b"data: " + (c if isinstance(c, str) else json.dumps(c)).encode() + b"\n\n"


def delta(**d: object) -> dict:
    return {"choices": [{"index": 0, "delta": d, "finish_reason": None}]}


def call(index: int, args: str, name: str | None = None) -> dict:
    piece: dict = {"index": index, "function": {"arguments": args}}
    if name is not None:
        piece |= {"id": f"call_{index}", "type": "function"}
        piece["function"]["name"] = name
    return piece


def run(
    chunks: list[dict | str],
    saved: list[dict] | None = None,
    raw: list[bytes] | None = None,
    **request: object,
) -> list[dict]:
    """The events; what the shaper stores goes to `saved`, the events' bytes to `raw`."""
    fields = {"model": "m", "input": "x", "stream": True, **request}
    body = ResponsesRequest.parse(json.dumps(fields).encode())

    async def save(response: dict) -> None:
        assert saved is not None
        saved.append(response)

    shaper = ResponseShaper(body, FakeFormatter(chunks), save if saved is not None else None)  # type: ignore[arg-type]

    async def collect() -> list[dict]:
        out = []
        async for event_bytes in shaper.events():
            if raw is not None:
                raw.append(event_bytes)
            head, data = event_bytes.decode().split("\n", 1)
            event = json.loads(data.removeprefix("data: "))
            assert head == "event: " + event["type"]
            out.append(event)
        return out

    return asyncio.run(collect())


def summary(events: list[dict]) -> list[tuple]:
    """(type, the delta or the item's type) of each event after the first two."""
    out = []
    for e in events[2:]:
        detail = e.get("delta", e.get("item", {}).get("type", ""))
        out.append((e["type"].removeprefix("response."), detail))
    return out


USAGE = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}}


def test_a_call_ends_before_the_content_that_follows_it_in_one_delta() -> None:
    events = run([
        delta(role="assistant", content="", tool_calls=[call(0, '{"a"', "f")]),
        delta(content=" done", tool_calls=[call(0, ": 1}")]),
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
        USAGE, "[DONE]",
    ])  # fmt: skip
    assert summary(events) == [
        ("output_item.added", "function_call"),
        ("function_call_arguments.delta", '{"a"'),
        ("function_call_arguments.delta", ": 1}"),
        ("function_call_arguments.done", ""),
        ("output_item.done", "function_call"),
        ("output_item.added", "message"),
        ("content_part.added", ""),
        ("output_text.delta", " done"),
        ("output_text.done", ""),
        ("content_part.done", ""),
        ("output_item.done", "message"),
        ("completed", ""),
    ]
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["function_call", "message"]
    assert final["output"][0]["arguments"] == '{"a": 1}'
    assert final["output"][0]["call_id"] == "call_0"
    assert final["usage"]["output_tokens"] == 5
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_content_ends_before_the_call_it_precedes() -> None:
    events = run([
        delta(role="assistant", content="let me see"),
        delta(content=" now", tool_calls=[call(0, "{}", "g")]),
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
        USAGE, "[DONE]",
    ])  # fmt: skip
    kinds = [k for k, _ in summary(events) if k.startswith("output_item")]
    assert kinds == ["output_item.added", "output_item.done"] * 2
    final = events[-1]
    assert final["type"] == "response.incomplete"
    assert final["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    text = final["response"]["output"][0]["content"][0]["text"]
    assert text == "let me see now"


def test_an_error_mid_stream_is_an_error_event_and_a_failed_response() -> None:
    error = {"error": {"message": "worker gone", "type": "x", "param": None,
                       "code": "worker_unavailable"}}  # fmt: skip
    saved: list[dict] = []
    events = run([delta(role="assistant", content="par"), error, "[DONE]"], saved)
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["code"] == "worker_unavailable"
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["message"] == "worker gone"
    assert saved == [failed]  # stored, as a finished response is
    [item] = failed["output"]  # with what was generated: the open message, incomplete
    assert item["status"] == "incomplete" and item["content"][0]["text"] == "par"


def test_the_output_rebuilt_from_any_prefix_of_the_events_is_the_shapers() -> None:
    """A router killed mid-response leaves its events: what they add up to, wherever they
    stop, is the output the shaper would have failed with (the done items whole, the open one
    incomplete with its deltas so far), and all of it at the end."""
    chunks = [
        delta(role="assistant", reasoning_content="think"),
        delta(reasoning_content=" more", content="an"),
        delta(content="swer", tool_calls=[call(0, '{"q"', "f")]),
        delta(tool_calls=[call(0, ": 2}")]),
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
        USAGE, "[DONE]",
    ]  # fmt: skip
    raw: list[bytes] = []
    events = run(chunks, raw=raw)
    final = events[-1]["response"]
    assert output_from_events(raw) == final["output"]
    assert [i["type"] for i in final["output"]] == ["reasoning", "message", "function_call"]
    kinds = [e["type"] for e in events]

    def cut_after(kind: str, nth: int = 1) -> list[dict]:
        at = [i for i, k in enumerate(kinds) if k == kind][nth - 1]
        return output_from_events(raw[: at + 1])

    reasoning = cut_after("response.reasoning_text.delta", 2)
    assert reasoning[0]["content"][0]["text"] == "think more" and len(reasoning) == 1
    message = cut_after("response.output_text.delta")
    assert message[0] == final["output"][0]  # done
    assert (message[1]["status"], message[1]["content"][0]["text"]) == ("incomplete", "an")
    args = cut_after("response.function_call_arguments.delta")
    assert args[1] == final["output"][1]
    assert (args[2]["status"], args[2]["arguments"]) == ("incomplete", '{"q"')
    assert output_from_events(raw[:2]) == []  # created, in_progress


def test_the_output_rebuilt_from_the_events_is_what_a_failed_stream_stored() -> None:
    error = {"error": {"message": "gone", "type": "x", "param": None, "code": "c"}}
    saved: list[dict] = []
    raw: list[bytes] = []
    events = run([delta(role="assistant", reasoning_content="hm"), delta(content="pa"),
                  delta(content="rt"), error, "[DONE]"], saved, raw)  # fmt: skip
    assert events[-2]["type"] == "error"
    assert output_from_events(raw[:-2]) == saved[0]["output"]


def lp(*tokens: str) -> dict:
    return {"content": [{"token": t, "logprob": -1.0, "bytes": list(t.encode()),
                         "top_logprobs": []} for t in tokens]}  # fmt: skip


def test_logprobs_of_reasoning_tokens_go_with_the_first_text_delta_and_the_part_has_all() -> None:
    with_lp = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "reasoning_content": "hm"},
                      "logprobs": lp("<think>", "hm"), "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"content": "an"}, "logprobs": lp("</think>", "an"),
                      "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"content": "swer"}, "logprobs": lp("swer"),
                      "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {}, "logprobs": lp("<|im_end|>"),
                      "finish_reason": "stop"}]},
        USAGE, "[DONE]",
    ]  # fmt: skip
    raw: list[bytes] = []
    events = run(with_lp, raw=raw, include=["message.output_text.logprobs"])
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [[t["token"] for t in e["logprobs"]] for e in deltas] == [
        ["<think>", "hm", "</think>", "an"], ["swer"]]  # fmt: skip
    final = events[-1]["response"]
    part = final["output"][1]["content"][0]
    assert [t["token"] for t in part["logprobs"]] == ["<think>", "hm", "</think>", "an", "swer",
                                                      "<|im_end|>"]  # fmt: skip
    rebuilt = output_from_events(raw[: kinds_index(events, "response.output_text.delta", 2)])
    assert [t["token"] for t in rebuilt[1]["content"][0]["logprobs"]] == [
        "<think>", "hm", "</think>", "an", "swer"]  # fmt: skip


def kinds_index(events: list[dict], kind: str, nth: int) -> int:
    """The length of the prefix of events that ends with the nth event of `kind`."""
    return [i for i, e in enumerate(events) if e["type"] == kind][nth - 1] + 1

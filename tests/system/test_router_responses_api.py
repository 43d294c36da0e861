"""OpenAI's Responses API (`POST /v1/responses`) on a real router process, with the fake back
end (its output is the last message reversed): the response object, its event stream, the
conversion of input items to chat messages, and the refusals."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx2 as httpx
import pytest

from tests.system.router_fakes import FakeWorker, start_router
from tests.system.test_router_api import running

pytest_plugins = ["tests.redis_fixtures"]
PREFIX = "rt-resp"


@pytest.fixture(scope="module")
def base(redis_url: str) -> Iterator[str]:
    with start_router(redis_url, PREFIX) as url:
        yield url


@pytest.fixture(scope="module")
def fake(redis_url: str, base: str) -> Iterator[FakeWorker]:
    with running(FakeWorker(redis_url, PREFIX, "w-resp", shuffle=True, duplicate=True), base) as w:
        yield w


def post(base: str, **body: object) -> httpx.Response:
    return httpx.post(base + "/v1/responses", json={"model": "fake-model", **body}, timeout=30)


def events(base: str, **body: object) -> list[dict]:
    out = []
    payload = {"model": "fake-model", "stream": True, **body}
    with httpx.stream("POST", base + "/v1/responses", json=payload, timeout=30) as resp:
        assert resp.status_code == 200, resp.read()
        kind = None
        for line in resp.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                obj = json.loads(line[6:])
                assert obj["type"] == kind
                out.append(obj)
    return out


def test_a_whole_response_and_its_usage(fake: FakeWorker, base: str) -> None:
    resp = post(base, input="hello", instructions="be nice", metadata={"k": "v"})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "response" and body["id"].startswith("resp_")
    assert (body["status"], body["incomplete_details"], body["store"]) == ("completed", None, True)
    assert body["metadata"] == {"k": "v"} and body["instructions"] == "be nice"
    (item,) = body["output"]
    assert item["type"] == "message" and item["role"] == "assistant"
    assert item["content"] == [
        {"type": "output_text", "text": "olleh", "annotations": [], "logprobs": []}
    ]
    usage = body["usage"]
    assert usage["input_tokens"] > 0 and usage["output_tokens"] == 5
    assert usage["total_tokens"] == usage["input_tokens"] + 5
    msgs = fake.received[-1].messages
    assert [(m.role, m.content) for m in msgs] == [("system", "be nice"), ("user", "hello")]


def test_max_output_tokens_makes_it_incomplete_and_rid_names_it(
    fake: FakeWorker, base: str
) -> None:
    body = post(base, input="abcdef", max_output_tokens=3, rid="my-resp").json()
    assert body["id"] == "my-resp"
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["content"][0]["text"] == "fed"
    assert fake.received[-1].sampling_params["max_new_tokens"] == 3


def test_a_stored_responses_rid_is_not_taken_again_until_it_is_deleted(
    fake: FakeWorker, base: str
) -> None:
    """vLLM overwrites the stored response (and the conversation others continue from it)."""
    first = post(base, input="one", rid="taken-rid").json()
    assert first["id"] == "taken-rid"
    for body in ({}, {"stream": True}, {"background": True}):
        resp = post(base, input="two", rid="taken-rid", **body)
        assert resp.status_code == 400, (body, resp.text)
        error = resp.json()["error"]
        assert (error["code"], error["param"]) == ("duplicate_rid", "rid")
    assert httpx.get(f"{base}/v1/responses/taken-rid", timeout=10).json() == first
    unstored = post(base, input="three", rid="taken-rid", store=False)  # (nothing overwritten)
    assert unstored.status_code == 200 and unstored.json()["store"] is False
    assert httpx.delete(f"{base}/v1/responses/taken-rid", timeout=10).status_code == 200
    assert post(base, input="four", rid="taken-rid").json()["output"][0]["content"][0][
        "text"] == "ruof"  # fmt: skip
    resp = post(base, input="x", rid="r" * 257)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "rid"


def test_reasoning_effort_reaches_the_chat_template_and_is_echoed(
    fake: FakeWorker, base: str
) -> None:
    body = post(base, input="hi", reasoning={"effort": "low", "summary": "auto"}).json()
    assert body["reasoning"] == {"effort": "low", "summary": None}  # (no summaries made)
    assert fake.received[-1].chat_template_kwargs == {"reasoning_effort": "low"}
    assert post(base, input="hi").json()["reasoning"] == {"effort": None, "summary": None}
    resp = httpx.post(base + "/v1/chat/completions", json={
        "model": "fake-model", "messages": [{"role": "user", "content": "x"}],
        "reasoning_effort": "high"}, timeout=30)  # fmt: skip
    assert resp.status_code == 200, resp.text
    assert fake.received[-1].chat_template_kwargs == {"reasoning_effort": "high"}


def test_the_event_stream_adds_up_to_the_response(fake: FakeWorker, base: str) -> None:
    text = "streaming responses, piece by piece"
    evs = events(base, input=text, max_output_tokens=64)
    kinds = [e["type"] for e in evs]
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]  # fmt: skip
    deltas = [e for e in evs if e["type"] == "response.output_text.delta"]
    assert len(deltas) > 3
    assert "".join(e["delta"] for e in deltas) == text[::-1]
    item_id = evs[2]["item"]["id"]
    assert {e["item_id"] for e in deltas} == {item_id}
    final = evs[-1]["response"]
    assert final["status"] == "completed" and final["usage"]["output_tokens"] == len(text)
    assert final["output"][0]["id"] == item_id
    assert final["output"][0]["content"][0]["text"] == text[::-1]
    assert evs[0]["response"]["id"] == final["id"]


def test_include_logprobs_gives_the_chats_logprobs_whole_and_streamed(
    fake: FakeWorker, base: str
) -> None:
    text = "logprobs, please"
    include = ["message.output_text.logprobs"]
    chat = httpx.post(base + "/v1/chat/completions", timeout=30, json={
        "model": "fake-model", "messages": [{"role": "user", "content": text}],
        "logprobs": True, "top_logprobs": 2}).json()  # fmt: skip
    want = chat["choices"][0]["logprobs"]["content"]
    assert len(want) == len(text) and all(len(t["top_logprobs"]) == 2 for t in want)
    body = post(base, input=text, include=include, top_logprobs=2).json()
    assert body["top_logprobs"] == 2
    part = body["output"][0]["content"][0]
    assert part["text"] == text[::-1] and part["logprobs"] == want
    assert fake.received[-1].return_logprob and fake.received[-1].top_logprobs_num == 2
    evs = events(base, input=text, include=include, top_logprobs=2)
    deltas = [e for e in evs if e["type"] == "response.output_text.delta"]
    assert [t for e in deltas for t in e["logprobs"]] == want
    assert all(len(e["logprobs"]) >= 1 for e in deltas)
    (done,) = [e for e in evs if e["type"] == "response.output_text.done"]
    assert done["logprobs"] == want
    assert evs[-1]["response"]["output"][0]["content"][0]["logprobs"] == want
    # no include: no logprobs asked of the worker, top_logprobs only echoed
    body = post(base, input=text, top_logprobs=3).json()
    assert body["output"][0]["content"][0]["logprobs"] == [] and body["top_logprobs"] == 3
    assert not fake.received[-1].return_logprob
    zero = post(base, input=text, include=include).json()["output"][0]["content"][0]
    assert [t["logprob"] for t in zero["logprobs"]] == [t["logprob"] for t in want]
    assert all(t["top_logprobs"] == [] for t in zero["logprobs"])


def test_input_items_become_the_chat_conversation(fake: FakeWorker, base: str) -> None:
    items = [
        {"role": "developer", "content": "use tools"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather"},
                                                         {"type": "input_text", "text": "?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": "noon"},
    ]  # fmt: skip
    tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
    resp = post(base, input=items, tools=[tool], tool_choice="none")
    assert resp.status_code == 200, resp.text
    assert resp.json()["output"][0]["content"][0]["text"] == "noon"[::-1]
    msg = fake.received[-1]
    assert [(m.role, m.content) for m in msg.messages] == [
        ("developer", "use tools"), ("user", "weather?"), ("assistant", ""),
        ("tool", "sunny"), ("tool", "noon"),
    ]  # fmt: skip
    calls = msg.messages[2].tool_calls
    assert [(c["id"], c["function"]["name"]) for c in calls] == [
        ("call_1", "get_weather"), ("call_2", "get_time")
    ]  # fmt: skip
    assert [m.tool_call_id for m in msg.messages[3:]] == ["call_1", "call_2"]
    assert msg.tools == [{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object"}}}]  # fmt: skip


def test_what_it_cannot_do_is_a_400_naming_the_field(fake: FakeWorker, base: str) -> None:
    cases = [
        ({"input": "x", "previous_response_id": "resp_never"}, "previous_response_id"),
        ({"input": "x", "conversation": "conv_1"}, "conversation"),
        ({"input": [{"type": "file_search_call", "id": "f"}]}, "input.0.type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input.0.content"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"input": [{"role": "wizard", "content": "x"}]}, "input.0.role"),
        ({"input": 5}, "input"),
        ({"input": "x", "top_logprobs": 21}, "top_logprobs"),
        ({"input": "x", "include": ["message.output_text.logprobs", "bogus"]}, "include.1"),
        ({"input": "x", "truncation": "sometimes"}, "truncation"),
    ]
    for body, param in cases:
        resp = post(base, **body)
        assert resp.status_code == 400, (body, resp.text)
        assert resp.json()["error"]["param"] == param, (body, resp.json())
    resp = post(base, input="x", model="gpt-9")
    assert resp.status_code == 404


def test_a_stored_response_is_retrieved_listed_and_deleted(fake: FakeWorker, base: str) -> None:
    body = post(base, input="hello", metadata={"k": "v"}).json()
    assert body["store"] is True and body["previous_response_id"] is None
    got = httpx.get(f"{base}/v1/responses/{body['id']}", timeout=10)
    assert got.status_code == 200 and got.json() == body
    items = httpx.get(f"{base}/v1/responses/{body['id']}/input_items", timeout=10).json()
    assert items["object"] == "list" and not items["has_more"]
    (item,) = items["data"]
    assert item["role"] == "user" and item["content"] == [{"type": "input_text", "text": "hello"}]
    assert item["id"].startswith("msg_") and items["first_id"] == items["last_id"] == item["id"]
    gone = httpx.delete(f"{base}/v1/responses/{body['id']}", timeout=10)
    assert gone.json() == {"id": body["id"], "object": "response", "deleted": True}
    for method in ("GET", "DELETE"):
        resp = httpx.request(method, f"{base}/v1/responses/{body['id']}", timeout=10)
        assert resp.status_code == 404 and resp.json()["error"]["param"] == "response_id"
    unstored = post(base, input="hello", store=False).json()
    assert unstored["store"] is False
    assert httpx.get(f"{base}/v1/responses/{unstored['id']}", timeout=10).status_code == 404
    resp = post(base, input="again", previous_response_id=unstored["id"])
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "previous_response_id"


@pytest.mark.parametrize("stream", [False, True])
def test_previous_response_id_continues_the_conversation(
    fake: FakeWorker, base: str, stream: bool
) -> None:
    """Each turn's messages: the stored turns (input, then output), then the new input; the
    earlier turn's instructions are not carried over (OpenAI's rule)."""
    def turn(**body: object) -> dict:
        if not stream:
            return post(base, **body).json()
        final = events(base, **body)[-1]
        assert final["type"] == "response.completed"
        return final["response"]

    first = turn(input="hello", instructions="be nice")
    second = turn(input=[{"role": "user", "content": "more"}], previous_response_id=first["id"])
    assert second["previous_response_id"] == first["id"]
    assert [(m.role, m.content) for m in fake.received[-1].messages] == [
        ("user", "hello"), ("assistant", "olleh"), ("user", "more")]  # fmt: skip
    third = turn(input="last", instructions="be brief", previous_response_id=second["id"])
    assert [(m.role, m.content) for m in fake.received[-1].messages] == [
        ("system", "be brief"), ("user", "hello"), ("assistant", "olleh"), ("user", "more"),
        ("assistant", "erom"), ("user", "last")]  # fmt: skip
    assert third["output"][0]["content"][0]["text"] == "tsal"
    stored = httpx.get(f"{base}/v1/responses/{third['id']}", timeout=10).json()
    assert stored == third
    page = httpx.get(f"{base}/v1/responses/{third['id']}/input_items",
                     params={"order": "asc", "limit": 3}, timeout=10).json()  # fmt: skip
    assert [i.get("role") for i in page["data"]] == ["user", "assistant", "user"]
    assert page["has_more"] is True
    after = {"order": "asc", "after": page["last_id"]}
    rest = httpx.get(f"{base}/v1/responses/{third['id']}/input_items", params=after,
                     timeout=10).json()  # fmt: skip
    assert [i.get("role") for i in rest["data"]] == ["assistant", "user"] and not rest["has_more"]
    newest = httpx.get(f"{base}/v1/responses/{third['id']}/input_items", timeout=10).json()
    assert newest["data"] == (page["data"] + rest["data"])[::-1]


@pytest.fixture(scope="module")
def parsing_stack(redis_url: str) -> Iterator[tuple[str, FakeWorker]]:
    """A router with a reasoning parser and the hermes tool call parser, and its fake."""
    prefix = PREFIX + "-parse"
    extra = ("--reasoning-parser", "deepseek-r1", "--tool-call-parser", "hermes")
    with start_router(redis_url, prefix, *extra) as url:
        with running(FakeWorker(redis_url, prefix, "w-parse", shuffle=True), url) as fake:
            yield url, fake


def test_reasoning_text_and_calls_become_their_items(
    parsing_stack: tuple[str, FakeWorker],
) -> None:
    parsing, fake = parsing_stack
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    said = f"hmm</think>ok<tool_call>\n{call}\n</tool_call>"
    tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
    ask = {"input": said[::-1], "tools": [tool], "max_output_tokens": 200}
    whole = post(parsing, **ask).json()
    kinds = [item["type"] for item in whole["output"]]
    assert kinds == ["reasoning", "message", "function_call"], whole["output"]
    reasoning, message, fc = whole["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "hmm"}]
    assert message["content"][0]["text"] == "ok"
    assert (fc["name"], json.loads(fc["arguments"])) == ("get_weather", {"city": "Paris"})
    evs = events(parsing, **ask)
    done = [e["item"] for e in evs if e["type"] == "response.output_item.done"]
    assert [i["type"] for i in done] == kinds
    text = {k: "".join(e["delta"] for e in evs if e["type"] == k) for k in (
        "response.reasoning_text.delta", "response.output_text.delta",
        "response.function_call_arguments.delta")}  # fmt: skip
    assert list(text.values()) == ["hmm", "ok", fc["arguments"]]
    added = [e for e in evs if e["type"] == "response.output_item.added"]
    assert [e["output_index"] for e in added] == [0, 1, 2]
    assert added[2]["item"]["name"] == "get_weather" and added[2]["item"]["arguments"] == ""
    final = evs[-1]["response"]
    assert final["status"] == "completed"
    assert [i["type"] for i in final["output"]] == kinds
    assert final["output"][2]["arguments"] == fc["arguments"]
    # the call's output continues the stored conversation (the reasoning item is dropped)
    result = {"type": "function_call_output", "call_id": fc["call_id"], "output": "sunny"}
    resp = post(parsing, input=[result], previous_response_id=whole["id"], tools=[tool])
    assert resp.status_code == 200, resp.text
    user, assistant, output = fake.received[-1].messages
    assert (user.role, user.content) == ("user", said[::-1])
    assert (assistant.role, assistant.content) == ("assistant", "ok")
    assert [(c["id"], c["function"]["name"]) for c in assistant.tool_calls] == [
        (fc["call_id"], "get_weather")]  # fmt: skip
    assert (output.role, output.tool_call_id, output.content) == ("tool", fc["call_id"], "sunny")


def test_truncation_auto_asks_the_tokenizer_to_drop_early_turns(
    fake: FakeWorker, base: str
) -> None:
    """`truncation: "auto"` reaches the tokenizer as `truncate_turns` (which drops the
    earliest turns that do not fit: tests/unit/test_tokenize_turns.py) and is echoed;
    "disabled", the default, asks for nothing."""
    for truncation in ("auto", "disabled", None):
        extra = {} if truncation is None else {"truncation": truncation}
        body = post(base, input="abc", **extra).json()
        assert body["truncation"] == (truncation or "disabled")
        sp = fake.received[-1].sampling_params
        assert sp.get("truncate_turns") is (True if truncation == "auto" else None)
    streamed = events(base, input="abc", truncation="auto")
    assert streamed[0]["response"]["truncation"] == "auto"

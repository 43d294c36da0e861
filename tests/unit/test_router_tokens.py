"""The router's tokenize queries: request bodies, and answers matched to their queries."""

from __future__ import annotations

import asyncio

import pytest

from services.router_fields import ApiError
from services.router_protocol import parse_body
from services.router_tokens import DetokenizeBody, TokenizeBody, TokenQueries
from shared.messages import ErrorMsg, TokenizeRespMsg


class FakeBus:
    prefix = "t"

    def __init__(self) -> None:
        self.sent: list = []

    async def publish(self, stream: str, msg: object) -> None:
        self.sent.append((stream, msg))


def test_bodies_become_queries_and_bad_ones_are_400s() -> None:
    body = parse_body(TokenizeBody, b'{"prompt": "hi", "return_token_strs": true}')
    msg = body.query("q1", "router-a")
    assert (msg.text, msg.messages, msg.reply, msg.add_special_tokens) == ("hi", None,
                                                                           "tokenize", None)
    assert msg.return_token_strs
    chat = parse_body(TokenizeBody, b'{"messages": [{"role": "user", "content": "x"}],'
                      b' "add_generation_prompt": false, "continue_final_message": true}')
    msg = chat.query("q2", "router-a")
    assert [m.content for m in msg.messages] == ["x"] and msg.continue_final_message
    assert not msg.add_generation_prompt and msg.text is None
    for raw, why in [
        (b"{}", "exactly one of prompt and messages"),
        (b'{"prompt": "x", "messages": [{"role": "user", "content": "x"}]}', "exactly one"),
        (b'{"prompt": "x", "continue_final_message": true}', "add_generation_prompt=false"),
        (b'{"prompt": 5}', "prompt"),
        (b'{"prompt": []}', "the list is empty"),
    ]:
        with pytest.raises(ApiError) as err:
            parse_body(TokenizeBody, raw)
        assert err.value.status == 400 and why in err.value.message


def test_answers_reach_their_query_errors_raise_and_silence_times_out() -> None:
    async def main() -> None:
        bus = FakeBus()
        queries = TokenQueries(bus, "router-a")  # type: ignore[arg-type]
        body = parse_body(TokenizeBody, b'{"prompt": "hi"}')

        async def answer_with(make) -> object:
            task = asyncio.ensure_future(queries.ask(body.query(queries.new_rid(), "router-a")))
            while not bus.sent:
                await asyncio.sleep(0)
            stream, msg = bus.sent.pop()
            assert stream == "t:tokenize" and msg.reply == "tokenize"
            assert not queries.deliver(make("someone-else"))  # not a query of ours
            assert queries.deliver(make(msg.rid))
            return await task

        got = await answer_with(lambda rid: TokenizeRespMsg(rid, "router-a", [1, 2]))
        assert got.input_ids == [1, 2]
        with pytest.raises(ApiError) as err:
            await answer_with(lambda rid: ErrorMsg(rid, "router-a", "invalid_request", "bad"))
        assert (err.value.status, err.value.message) == (400, "bad")
        with pytest.raises(ApiError) as err:
            await queries.ask(body.query("q-late", "router-a"), timeout_s=0.05)
        assert err.value.status == 504
        assert not queries.deliver(TokenizeRespMsg("q-late", "router-a", []))  # too late

    asyncio.run(main())


def test_batches_become_one_query_each() -> None:
    rids = iter(f"q{i}" for i in range(10))
    body = parse_body(TokenizeBody, b'{"prompt": ["a", "b"], "add_special_tokens": false}')
    msgs = body.queries(lambda: next(rids), "router-a")
    assert [(m.rid, m.text, m.add_special_tokens) for m in msgs] == [("q0", "a", False),
                                                                   ("q1", "b", False)]
    detok = parse_body(DetokenizeBody, b'{"tokens": [[1, 2], [3]], "skip_special_tokens": true}')
    msgs = detok.queries(lambda: next(rids), "router-a")
    assert detok.is_batch and [m.input_ids for m in msgs] == [[1, 2], [3]]
    assert all(m.reply == "detokenize" and m.sampling_params["skip_special_tokens"] for m in msgs)
    single = parse_body(DetokenizeBody, b'{"tokens": [4, 5]}')
    (msg,) = single.queries(lambda: next(rids), "router-a")
    assert not single.is_batch and msg.input_ids == [4, 5]
    assert msg.sampling_params == {"skip_special_tokens": False}

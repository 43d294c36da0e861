"""The worker's request table and its message ⇄ engine translation (no Redis, no model)."""

from __future__ import annotations

import pytest

from engine.sampling.sampling_params import SamplingParams
from engine.scheduler.output_processor import StepEvent
from engine.scheduler.req import FinishReason as EngineFinish
from engine.scheduler.req import Req
from services.worker_requests import (
    RequestTable,
    aborted_row,
    sampling_params,
    step_message,
    step_row,
)
from shared.messages import DETOK_WINDOW_LEN, GenerateReqMsg, StepOutputMsg


def gen(rid: str = "r1", **kw) -> GenerateReqMsg:
    return GenerateReqMsg(rid, "router-a", [3, 4, 5], **kw)


def test_duplicates_and_aborts_that_overtake_their_request() -> None:
    table = RequestTable()
    assert table.admit(gen("a")) == "new"
    table.start(gen("a"))
    assert table.admit(gen("a")) == "duplicate"
    assert table.abort("a") is True  # running: abort it in the scheduler
    table.end("a")
    assert table.admit(gen("a")) == "duplicate"  # a late redelivery of a finished request
    assert table.abort("b") is False  # not here yet: remembered
    assert table.admit(gen("b")) == "aborted"
    assert table.admit(gen("b")) == "duplicate"  # answered once


def test_remembered_ids_are_bounded() -> None:
    table = RequestTable(max_remembered=3)
    for i in range(10):
        table.abort(f"x{i}")
    assert table.admit(gen("x0")) == "new"  # forgotten
    assert table.admit(gen("x9")) == "aborted"


def test_sampling_params_take_the_lifted_fields_and_check_ranges() -> None:
    msg = gen(
        sampling_params={"max_new_tokens": 9, "temperature": 0.0},
        stop=["\n\n"],
        skip_special_tokens=False,
        return_logprob=True,
        top_logprobs_num=2,
    )
    p = sampling_params(msg, vocab_size=100)
    assert (p.max_new_tokens, p.stop, p.skip_special_tokens) == (9, ["\n\n"], False)
    assert p.return_logprob and p.top_logprobs_num == 2 and p.is_greedy
    for bad in ({"top_p": 0.0}, {"n": 2}, {"bogus": 1}, {"stop_token_ids": [100]}):
        with pytest.raises(ValueError):
            sampling_params(gen(sampling_params=bad), vocab_size=100)
    with pytest.raises(ValueError, match="input_ids"):
        sampling_params(GenerateReqMsg("r", "a", [1, 100]), vocab_size=100)


def test_step_rows_carry_window_range_usage_and_logprobs() -> None:
    params = SamplingParams(max_new_tokens=20, return_logprob=True, top_logprobs_num=1)
    req = Req("r1", [1, 2, 3, 4], params)
    req.output_ids = list(range(10, 20))
    req.logprobs = [-float(i) for i in range(10)]
    req.top_logprobs = [([i], [-0.5]) for i in range(10)]
    req.cached_tokens = 2
    finish = EngineFinish("length", 20)
    table = RequestTable()
    table.start(gen("r1", skip_special_tokens=False))
    row = step_row(StepEvent(req, [18, 19], 8, finish), table.active["r1"])
    assert (row.start, row.new_ids, row.window_ids) == (8, [18, 19], list(range(12, 18)))
    assert len(row.window_ids) == DETOK_WINDOW_LEN
    assert row.finish_reason.type == "length" and row.finish_reason.matched is None
    assert (row.prompt_tokens, row.completion_tokens, row.cached_tokens) == (4, 10, 2)
    assert row.token_logprobs == [-8.0, -9.0] and row.top_logprobs_ids == [[8], [9]]
    assert row.router_id == "router-a" and row.skip_special_tokens is False
    first = step_row(StepEvent(req, [10], 0, None), table.active["r1"])
    assert first.window_ids == [] and first.finish_reason is None
    StepOutputMsg.from_rows([row, first, aborted_row(gen("r2"))], worker_id="0", step=1).validate()


def test_step_message_built_a_step_late_equals_one_built_at_the_event() -> None:
    """The worker hands (event, info, cached tokens) to its sender thread, which builds the
    rows while the next step runs: the request has more tokens and logprobs by then, and a
    re-admission (after retraction) may have changed its cached-token count."""
    params = SamplingParams(max_new_tokens=30, return_logprob=True, top_logprobs_num=1)
    req = Req("r1", [1, 2, 3], params)
    req.output_ids = list(range(10, 19))
    req.logprobs = [-float(i) for i in range(9)]
    req.top_logprobs = [([i], [-0.5]) for i in range(9)]
    req.cached_tokens = 2
    table = RequestTable()
    table.start(gen("r1"))
    event = StepEvent(req, [17, 18], 7, None)
    now = StepOutputMsg.from_rows([step_row(event, table.active["r1"])], worker_id="0", step=3)
    triple = (event, table.active["r1"], req.cached_tokens)
    req.output_ids += [19, 20]  # the next step, processed before the sender builds
    req.logprobs += [-9.0, -10.0]
    req.top_logprobs += [([9], [-0.5]), ([10], [-0.5])]
    req.cached_tokens = 7
    late = step_message([triple], "0", 3)
    assert late.to_msg() == now.to_msg()

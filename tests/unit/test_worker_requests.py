"""The worker's request table and its message ⇄ engine translation (no Redis, no model)."""

from __future__ import annotations

import random

import msgpack
import pytest

from engine.sampling.sampling_params import SamplingParams
from engine.scheduler.output_processor import StepEvent
from engine.scheduler.req import FinishReason as EngineFinish
from engine.scheduler.req import Req
from services.worker_requests import (
    RequestTable,
    Windows,
    aborted_row,
    check_kind,
    expand_row,
    row_record,
    sampling_params,
    step_message,
    step_records,
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


def test_a_worker_takes_requests_of_its_kind_only() -> None:
    check_kind(gen(embed=True), is_embedding=True)
    check_kind(gen(), is_embedding=False)
    with pytest.raises(ValueError, match="use /v1/embeddings"):
        check_kind(gen(), is_embedding=True)
    with pytest.raises(ValueError, match="not embeddings"):
        check_kind(gen(embed=True), is_embedding=False)


def test_an_embedding_requests_final_row_carries_its_embedding() -> None:
    import torch

    from engine.pooling import PooledState

    req = Req("r1", [1, 2, 3], SamplingParams(max_new_tokens=0))
    req.embedding = PooledState("mean")
    req.embedding.add(torch.tensor([3.0, 0.0]), 2)
    req.embedding.add(torch.tensor([3.0, 8.0]), 1)  # mean [2, 8/3]: normalised [0.6, 0.8]
    info = RequestTable().start(gen("r1", embed=True))
    row = expand_row(_through_the_pipe(row_record(StepEvent(req, [], 0, None))), info)
    assert row.embedding is None  # not before the end
    done = StepEvent(req, [], 0, EngineFinish("length", 0))
    row = expand_row(_through_the_pipe(row_record(done)), info)
    assert torch.frombuffer(bytearray(row.embedding), dtype=torch.float32).tolist() == \
        pytest.approx([0.6, 0.8])  # fmt: skip
    aborted = StepEvent(req, [], 0, EngineFinish("abort", message="gone"))
    assert expand_row(_through_the_pipe(row_record(aborted)), info).embedding is None


def _through_the_pipe(record: tuple) -> list:
    """A row record as the I/O process receives it (msgpack turns tuples into lists)."""
    return msgpack.unpackb(msgpack.packb(record))


def test_step_rows_carry_window_range_usage_and_logprobs() -> None:
    params = SamplingParams(max_new_tokens=20, return_logprob=True, top_logprobs_num=1)
    req = Req("r1", [1, 2, 3, 4], params)
    req.output_ids = list(range(10, 20))
    req.logprobs = [-float(i) for i in range(10)]
    req.top_logprobs = [([i], [-0.5]) for i in range(10)]
    req.cached_tokens = 2
    finish = EngineFinish("length", 20)
    table = RequestTable()
    info = table.start(gen("r1", skip_special_tokens=False))
    assert info == table.active["r1"] and info.prompt_tokens == 3
    info = info._replace(prompt_tokens=4)
    record = _through_the_pipe(row_record(StepEvent(req, [18, 19], 8, finish)))
    row = expand_row(record, info)
    assert (row.start, row.new_ids, row.window_ids) == (8, [18, 19], list(range(12, 18)))
    assert len(row.window_ids) == DETOK_WINDOW_LEN
    assert row.finish_reason.type == "length" and row.finish_reason.matched is None
    assert (row.prompt_tokens, row.completion_tokens, row.cached_tokens) == (4, 10, 2)
    assert row.token_logprobs == [-8.0, -9.0] and row.top_logprobs_ids == [[8], [9]]
    assert row.top_logprobs_vals == [[-0.5], [-0.5]]
    assert row.router_id == "router-a" and row.skip_special_tokens is False
    first = expand_row(_through_the_pipe(row_record(StepEvent(req, [10], 0, None))), info)
    assert first.window_ids == [] and first.finish_reason is None
    msg = StepOutputMsg.from_rows([row, first, aborted_row(gen("r2"))], worker_id="0", step=1)
    msg.validate()


def test_the_first_row_carries_the_prompt_logprobs_once_complete() -> None:
    params = SamplingParams(return_logprob=True, top_logprobs_num=1, logprob_start_len=0)
    req = Req("r1", [1, 2, 3], params)
    info = RequestTable().start(gen("r1"))
    req.output_ids = [9]
    req.prompt_token_logprobs = [-1.0]  # one of the two still to come (an abort): none sent
    row = expand_row(_through_the_pipe(row_record(StepEvent(req, [9], 0, None))), info)
    assert row.prompt_logprobs is None
    req.prompt_token_logprobs = [-1.0, -2.0]
    req.prompt_top_logprobs = [([7], [-0.5]), ([8], [-0.25])]
    req.logprobs, req.top_logprobs = [-0.1], [([9], [-0.1])]
    row = expand_row(_through_the_pipe(row_record(StepEvent(req, [9], 0, None))), info)
    prompt = row.prompt_logprobs
    assert (prompt.start, prompt.ids, prompt.logprobs) == (0, [1, 2, 3], [-1.0, -2.0])
    assert prompt.top_pairs() == [None, [(7, -0.5)], [(8, -0.25)]]
    later = expand_row(_through_the_pipe(row_record(StepEvent(req, [10], 1, None))), info)
    assert later.prompt_logprobs is None
    StepOutputMsg.from_rows([row, later], worker_id="0", step=1).validate()


def test_a_stop_row_names_what_matched_and_plain_rows_carry_no_logprobs() -> None:
    req = Req("r1", [1, 2], SamplingParams(max_new_tokens=20))
    req.output_ids = [5, 6, 7]
    stop = EngineFinish("stop", matched="\n\n")
    info = RequestTable().start(gen("r1"))
    row = expand_row(_through_the_pipe(row_record(StepEvent(req, [7], 2, stop))), info)
    assert row.finish_reason.type == "stop" and row.finish_reason.matched == "\n\n"
    assert row.token_logprobs is row.top_logprobs_ids is row.top_logprobs_vals is None
    assert (row.window_ids, row.completion_tokens) == ([5, 6], 3)


def test_a_row_record_is_taken_at_the_event() -> None:
    """The scheduler writes the record right after its step; later steps append tokens and
    logprobs, and a re-admission (after retraction) changes the cached-token count."""
    params = SamplingParams(max_new_tokens=30, return_logprob=True, top_logprobs_num=1)
    req = Req("r1", [1, 2, 3], params)
    req.output_ids = list(range(10, 19))
    req.logprobs = [-float(i) for i in range(9)]
    req.top_logprobs = [([i], [-0.5]) for i in range(9)]
    req.cached_tokens = 2
    record = row_record(StepEvent(req, [17, 18], 7, None))
    before = msgpack.packb(record)
    req.output_ids += [19, 20]
    req.logprobs += [-9.0, -10.0]
    req.top_logprobs += [([9], [-0.5]), ([10], [-0.5])]
    req.cached_tokens = 7
    assert msgpack.packb(record) == before


def test_a_step_message_forgets_a_request_with_its_final_row_and_skips_strangers() -> None:
    info = RequestTable().start(gen("r1"))
    infos = {"r1": info}
    rows = [
        ("r1", 0, [5], [], None, 0, None, None, None),
        ("ghost", 0, [6], [], None, 0, None, None, None),  # never started: skipped, not fatal
    ]
    msg = step_message(rows, infos, "w0", 1)
    assert [r.rid for r in msg.rows()] == ["r1"] and "r1" in infos
    last = ("r1", 1, [7], [5], ("length", None, None), 0, None, None, None)
    final = step_message([last], infos, "w0", 2)
    assert final.rows()[0].finish_reason.type == "length" and "r1" not in infos
    assert step_message([("ghost", 0, [1], [], None, 0, None, None, None)], infos, "w0", 3) is None
    # plain rows too: a stranger's is skipped, the others kept
    infos["r2"] = info
    plain = [["ghost", "r2", "ghost"], [0, 0, 4], [1, 8, 2], [0, 3, 0]]
    msg = step_message([], infos, "w0", 4, plain, Windows())
    assert [(r.rid, r.new_ids, r.cached_tokens) for r in msg.rows()] == [("r2", [8], 3)]
    assert step_message([], infos, "w0", 5, [["ghost"], [0], [1], [0]], Windows()) is None


def test_plain_rows_expand_to_the_rows_their_row_records_would() -> None:
    """`step_records` sends most rows as columns, whose windows the I/O process keeps
    (`Windows`); every row it expands equals the row of the event's full row record, over
    random steps of plain rows, several tokens (speculative), logprobs, aborts and ends."""
    rng = random.Random(7)
    reqs, infos_a, infos_b, active = {}, {}, {}, {}
    windows = Windows()
    plain_rows = 0
    for step in range(1, 60):
        if len(reqs) < 12 and rng.random() < 0.5:  # a new request
            rid = f"r{step}"
            logprob = rng.random() < 0.2
            params = SamplingParams(max_new_tokens=50, return_logprob=logprob)
            req = reqs[rid] = Req(rid, [1, 2, 3], params)
            info = RequestTable().start(gen(rid, return_prompt_ids=rng.random() < 0.5))
            infos_a[rid] = infos_b[rid] = active[rid] = info
        events = []
        for rid, req in list(reqs.items()):
            start = len(req.output_ids)
            new = [rng.randrange(100) for _ in range(rng.choice([1, 1, 1, 1, 2, 3]))]
            req.output_ids += new
            req.logprobs += [-0.5] * len(new)
            reason = None
            if rng.random() < 0.08:
                reason = EngineFinish(rng.choice(["length", "stop", "abort"]), matched=new[-1])
                if reason.type == "abort":
                    del req.output_ids[start:], req.logprobs[start:]
                    new = []
                del reqs[rid]
            events.append(StepEvent(req, new, start, reason))
        full = step_message([_through_the_pipe(row_record(e)) for e in events], infos_a, "w",
                            step)  # fmt: skip
        rows, plain, ended = step_records(events, active)
        for rid in ended:
            del active[rid]
        plain_rows += len(plain[0])
        got = step_message(_through_the_pipe(rows), infos_b, "w", step,
                           _through_the_pipe(plain), windows)  # fmt: skip
        assert ended == [e.req.rid for e in events if e.finished_reason is not None]
        if full is None:
            assert got is None
            continue
        assert sorted(got.rows()) == sorted(full.rows()), f"step {step}"
    assert plain_rows > 100  # most rows went as columns
    assert len(windows) == len(reqs) and set(infos_b) == set(reqs)  # the ended were dropped

"""The scheduler side of pausing (engine/scheduler/pausing.py), driven between steps as a
paused worker drives it, on a tiny model against transformers' greedy tokens: bringing the
requests to rest mid-run (a batch in flight, a chunked prompt), then resuming, changes no
token; requests aborted at rest end at once, the others go on; retracting everything sends
the running requests back to waiting with their K/V in the prefix cache (a re-prefill of one
token each) and none held; a weights update then goes on with them waiting, and they continue
on the new weights as transformers continues their text on them. Every loop: the plain one,
the overlap loop's forward thread and its device process."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import pytest

from engine.engine import Engine
from engine.scheduler.scheduler import Scheduler
from tests.factories import (
    SCHEDULER_LOOPS,
    assert_engine_clean,
    hf_greedy,
    mixed_prompts,
    tiny_model,
)

NEW = 10
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
A, B = tiny_model("llama"), tiny_model("llama", seed=1)
PROMPTS = mixed_prompts(500, n=4, max_len=60, seed=3)
LONG = mixed_prompts(500, n=1, max_len=120, seed=4)[0] * 2  # chunked by 64-token chunks


def engine(kw: dict) -> Engine:
    return Engine(model_path=A, max_total_tokens=4096, chunked_prefill_size=64, **kw)


class Run:
    """Requests added to `eng`'s scheduler and stepped; their tokens as the events gave them."""

    def __init__(self, eng: Engine, prompts: list[list[int]]) -> None:
        self.eng, self.sched = eng, eng.scheduler
        self.tokens: dict[str, list[int]] = defaultdict(list)
        self.finish: dict[str, str] = {}
        self.params = eng._params(GREEDY, 1, {})[0]
        for i, prompt in enumerate(prompts):
            self.sched.add_request(f"r{i}", prompt, self.params)

    def take(self, events: list) -> None:
        for ev in events:
            assert ev.rid not in self.finish, f"{ev.rid}: an event after its finish"
            assert ev.start == len(self.tokens[ev.rid]), f"{ev.rid}: tokens out of order"
            self.tokens[ev.rid].extend(ev.new_token_ids)
            if ev.finished_reason is not None:
                self.finish[ev.rid] = ev.finished_reason.type

    def step_until(self, done: Callable[[Scheduler], bool]) -> None:
        for _ in range(500):
            if done(self.sched):
                return
            self.take(self.sched.step())
        raise AssertionError("the condition never came")

    def to_end(self) -> None:
        """Every request ended; nothing of them left in memory."""
        self.step_until(lambda s: not s.has_work())
        assert_engine_clean(self.eng)

    def assert_greedy(self, prompts: list[list[int]], skip: set[str] = frozenset()) -> None:
        """Request i's tokens are transformers' greedy ones for `prompts[i]`."""
        for i, prompt in enumerate(prompts):
            if f"r{i}" not in skip:
                assert self.tokens[f"r{i}"] == hf_greedy(A, prompt, NEW), i

    def at_rest(self) -> None:
        self.sched.settle()
        self.take(self.sched.output.take_events())
        assert not getattr(self.sched, "_in_flight", None) and self.sched.last_batch is None


def decoding(s: Scheduler) -> bool:
    """Every request runs, some with tokens (and, in the overlap loop, a batch in flight)."""
    return not s.waiting_queue and s.chunked_req is None and s.stats.generation_tokens >= 8


def three_each(s: Scheduler) -> bool:
    """Every request runs with three tokens or more."""
    reqs = s.running_batch.reqs
    return not s.waiting_queue and bool(reqs) and all(len(r.output_ids) >= 3 for r in reqs)


def chunking(s: Scheduler) -> bool:
    return s.chunked_req is not None and s.stats.generation_tokens > 0


@SCHEDULER_LOOPS
def test_settling_mid_run_changes_no_token(kw: dict) -> None:
    eng = engine(kw)
    try:
        run = Run(eng, [*PROMPTS, LONG])
        run.step_until(chunking)  # (a prompt half prefilled, others decoding)
        run.at_rest()
        assert run.sched.holds_kv() and run.sched.chunked_req is not None
        run.at_rest()  # (idempotent)
        run.to_end()
    finally:
        eng.shutdown()
    run.assert_greedy([*PROMPTS, LONG])
    assert set(run.finish.values()) == {"length"}


@SCHEDULER_LOOPS
def test_aborts_at_rest_end_at_once(kw: dict) -> None:
    eng = engine(kw)
    try:
        run = Run(eng, [*PROMPTS, LONG])
        run.step_until(chunking)
        run.at_rest()
        running = [r.rid for r in run.sched.running_batch.reqs]
        chunked = run.sched.chunked_req.rid
        aborted = {running[-1], chunked}
        for rid in aborted:
            run.sched.abort_request(rid, "paused and aborted")
        assert run.sched.end_aborted() == 2
        run.take(run.sched.output.take_events())
        assert run.finish == dict.fromkeys(aborted, "abort")
        assert run.sched.chunked_req is None
        assert running[-1] not in [r.rid for r in run.sched.running_batch.reqs]
        assert run.sched.end_aborted() == 0
        run.to_end()
    finally:
        eng.shutdown()
    run.assert_greedy([*PROMPTS, LONG], skip=aborted)
    assert len(run.tokens[running[-1]]) < NEW and len(run.tokens[chunked]) == 0


@SCHEDULER_LOOPS
def test_retracting_all_keeps_the_computed_kv_in_the_cache(kw: dict) -> None:
    eng = engine(kw)
    try:
        run = Run(eng, PROMPTS)
        run.step_until(three_each)
        run.sched.add_request("r4", LONG, run.params)
        run.step_until(chunking)
        run.at_rest()
        sched = run.sched
        holding = [r.rid for r in sched.running_batch.reqs] + [sched.chunked_req.rid]
        n = sched.retract_all()
        assert n == len(holding) >= 2 and not sched.holds_kv()
        assert [r.rid for r in sched.waiting_queue][:n] == holding
        assert all(r.is_retracted and r.req_pool_idx is None for r in sched.waiting_queue[:n])
        assert sched.has_work() and not sched.flush_cache()  # (waiting: refused unless paused)
        partial = {r.rid: len(r.output_ids) for r in sched.waiting_queue}
        run.take(sched.step())  # their re-prefill: a cache hit of all but the last token
        batch = sched.last_batch
        assert batch is not None and batch.forward_mode.is_extend()
        decoded = [r for r in batch.reqs if partial[r.rid] >= 3]
        assert len(decoded) == len(PROMPTS) and all(r.extend_input_len == 1 for r in decoded)
        run.to_end()
    finally:
        eng.shutdown()
    run.assert_greedy([*PROMPTS, LONG])


@SCHEDULER_LOOPS
def test_a_weights_update_goes_on_with_retracted_requests_waiting(kw: dict) -> None:
    eng = engine(kw)
    try:
        run = Run(eng, PROMPTS)
        run.step_until(decoding)
        sched = run.sched
        with pytest.raises(ValueError, match="requests are running"):
            eng.update_weights_from_disk(B)
        assert sched.retract_all() == len(PROMPTS)
        run.take(sched.output.take_events())
        old = {rid: list(tokens) for rid, tokens in run.tokens.items()}
        assert all(0 < len(t) < NEW for t in old.values())
        eng.update_weights_from_disk(B)
        assert sched.tree_cache.evictable_size() == 0  # (the old weights' K/V are gone)
        assert sched.flush_cache(keep_waiting=True)
        run.to_end()
    finally:
        eng.shutdown()
    for i, prompt in enumerate(PROMPTS):
        done = old[f"r{i}"]
        assert done == hf_greedy(A, prompt, NEW)[: len(done)], i
        rest = hf_greedy(B, prompt + done, NEW - len(done))
        assert run.tokens[f"r{i}"] == done + rest, i

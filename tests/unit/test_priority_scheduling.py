"""Priority scheduling (SGLang's --enable-priority-scheduling) over the checksum runner: the
waiting queue's order, preemption of running requests for a better one (by the request
slots or by KV memory), the threshold, and exact outputs for preempted requests."""

from __future__ import annotations

import pytest

from engine.scheduler.scheduler import Scheduler
from tests.fake_runner import create_scheduler, expected_output
from tests.unit.test_scheduler import assert_no_leaks, params


def finish_order(s: Scheduler, max_steps: int = 5000) -> list[str]:
    order: list[str] = []
    for _ in range(max_steps):
        if not s.has_work():
            return order
        order += [ev.rid for ev in s.step() if ev.finished_reason is not None]
    raise AssertionError("scheduler did not drain")


def prompt(i: int, n: int = 12) -> list[int]:
    return [3 + (i * 37 + k * 11) % 900 for k in range(n)]


@pytest.mark.parametrize("low_first", [False, True])
def test_waiting_requests_go_by_priority_then_arrival(low_first: bool) -> None:
    s = create_scheduler(
        max_running_requests=1,
        enable_priority_scheduling=True,
        schedule_low_priority_values_first=low_first,
    )
    for i, prio in enumerate([0, 5, 5, -1, None]):
        s.add_request(f"r{i}", prompt(i), params(max_new_tokens=3), priority=prio)
    order = finish_order(s)
    if low_first:
        assert order == ["r3", "r0", "r4", "r1", "r2"]
    else:
        assert order == ["r1", "r2", "r0", "r4", "r3"]  # no priority is priority 0
    assert s.stats.num_retractions == 0  # the gaps (<= 6) are within the threshold (10)
    assert_no_leaks(s)


def test_a_better_request_preempts_the_latest_worse_one_for_a_slot() -> None:
    s = create_scheduler(max_running_requests=2, enable_priority_scheduling=True)
    s.add_request("low-a", prompt(0), params(max_new_tokens=30))
    s.add_request("low-b", prompt(1), params(max_new_tokens=30))
    for _ in range(5):
        s.step()
    s.add_request("high", prompt(2), params(max_new_tokens=4), priority=11)
    s.step()
    assert [r.rid for r in s.last_batch.reqs] == ["high"]  # its prefill ran
    # low-b arrived last: it loses least
    assert [r.rid for r in s.running_batch.reqs] == ["low-a"]
    assert [r.rid for r in s.waiting_queue] == ["low-b"]
    done: dict[str, object] = {}
    order = []
    while s.has_work():
        for ev in s.step():
            if ev.finished_reason is not None:
                order.append(ev.rid)
                done[ev.rid] = ev.req
    assert order == ["high", "low-a", "low-b"]
    assert s.stats.num_retractions == 1
    for rid, i, n in [("low-a", 0, 30), ("low-b", 1, 30), ("high", 2, 4)]:
        assert done[rid].output_ids == expected_output(prompt(i), n), rid  # kept across it
    assert_no_leaks(s)


def test_a_gap_within_the_threshold_waits_instead() -> None:
    s = create_scheduler(
        max_running_requests=1,
        enable_priority_scheduling=True,
        priority_scheduling_preemption_threshold=3,
    )
    s.add_request("low", prompt(0), params(max_new_tokens=10))
    s.step()
    s.add_request("higher", prompt(1), params(max_new_tokens=2), priority=3)
    assert finish_order(s) == ["low", "higher"]
    s.add_request("low", prompt(0), params(max_new_tokens=10), priority=-1)
    s.step()
    s.add_request("much-higher", prompt(1), params(max_new_tokens=2), priority=3)
    assert finish_order(s) == ["much-higher", "low"]  # 3 - (-1) > 3


def test_preemption_frees_kv_memory_for_a_long_prompt() -> None:
    s = create_scheduler(
        max_total_tokens=160,
        chunked_prefill_size=-1,
        enable_priority_scheduling=True,
        priority_scheduling_preemption_threshold=0,
        init_new_token_ratio=1.0,
    )
    for i in range(3):
        s.add_request(f"low{i}", prompt(i, 20), params(max_new_tokens=20))
    s.step()
    s.step()
    assert len(s.running_batch.reqs) == 3
    s.add_request("urgent", prompt(9, 60), params(max_new_tokens=8), priority=1)
    s.step()
    assert s.last_batch.forward_mode.is_extend()
    assert [r.rid for r in s.last_batch.reqs] == ["urgent"]
    assert s.stats.num_retractions >= 1
    outputs = {}
    while s.has_work():
        for ev in s.step():
            if ev.finished_reason is not None:
                outputs[ev.rid] = ev.req.output_ids
    assert outputs["urgent"] == expected_output(prompt(9, 60), 8)
    for i in range(3):
        assert outputs[f"low{i}"] == expected_output(prompt(i, 20), 20)
    assert_no_leaks(s)


def test_equal_or_worse_requests_never_preempt() -> None:
    s = create_scheduler(
        max_running_requests=2,
        enable_priority_scheduling=True,
        priority_scheduling_preemption_threshold=0,
    )
    s.add_request("a", prompt(0), params(max_new_tokens=8), priority=2)
    s.add_request("b", prompt(1), params(max_new_tokens=8), priority=2)
    s.step()
    s.add_request("same", prompt(2), params(max_new_tokens=2), priority=2)
    s.add_request("worse", prompt(3), params(max_new_tokens=2), priority=1)
    assert finish_order(s)[-2:] == ["same", "worse"]
    assert s.stats.num_retractions == 0


def test_a_priority_without_priority_scheduling_is_refused() -> None:
    s = create_scheduler()
    with pytest.raises(ValueError, match="priority scheduling is off"):
        s.add_request("r", prompt(0), params(), priority=3)
    s.add_request("zero", prompt(0), params(max_new_tokens=2), priority=0)  # the default
    assert finish_order(s) == ["zero"]

"""Scheduler behaviour over the checksum runner (no model): admission, chunking, caching,
retraction, finishing, aborts. Outputs are checked against the fake model's exact answer."""

from __future__ import annotations

import random

import pytest

from engine.sampling.sampling_params import SamplingParams
from engine.scheduler.scheduler import Scheduler
from tests.fake_runner import create_scheduler, expected_output


def params(**kw: object) -> SamplingParams:
    kw.setdefault("max_new_tokens", 8)
    kw.setdefault("temperature", 0.0)
    return SamplingParams.from_dict(kw).normalize()


def run_all(s: Scheduler, max_steps: int = 10_000) -> dict[str, object]:
    """Step until idle; returns rid -> Req of every finished request (each exactly once)."""
    done: dict[str, object] = {}
    for _ in range(max_steps):
        if not s.has_work():
            return done
        for ev in s.step():
            if ev.finished_reason is not None:
                assert ev.rid not in done, f"{ev.rid} finished twice"
                done[ev.rid] = ev.req
    raise AssertionError("scheduler did not drain")


def assert_no_leaks(s: Scheduler) -> None:
    s.tree_cache.check_integrity()
    s.tree_cache.reset()
    alloc = s.pools.allocator
    assert alloc.available_size() == alloc.size
    pool = s.pools.req_to_token_pool
    assert pool.available_size() == pool.size


def rand_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 1000) for _ in range(n)]


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("radix", [True, False])
def test_outputs_exact_with_chunking_and_sharing(page_size: int, radix: bool) -> None:
    rng = random.Random(0)
    s = create_scheduler(
        page_size=page_size, chunked_prefill_size=48, disable_radix_cache=not radix
    )
    shared = rand_prompt(rng, 70)
    prompts = [shared + rand_prompt(rng, rng.randint(1, 40)) for _ in range(6)]
    prompts += [rand_prompt(rng, rng.randint(1, 130)) for _ in range(6)]
    for i, p in enumerate(prompts):
        s.add_request(f"r{i}", p, params(max_new_tokens=10))
    done = run_all(s)
    for i, p in enumerate(prompts):
        assert done[f"r{i}"].output_ids == expected_output(p, 10)
    # a second wave of the shared-prefix prompts hits the cache
    for i, p in enumerate(prompts[:6]):
        s.add_request(f"again{i}", p, params(max_new_tokens=3))
    done = run_all(s)
    hits = [done[f"again{i}"].cached_tokens for i in range(6)]
    if radix:
        assert all(h >= 70 // page_size * page_size for h in hits)
    else:
        assert hits == [0] * 6
    assert_no_leaks(s)


def test_chunked_prefill_splits_long_prompt() -> None:
    s = create_scheduler(chunked_prefill_size=32)
    s.add_request("long", list(range(3, 103)), params(max_new_tokens=2))
    done = run_all(s)
    log = s.model_runner.forward_log
    assert [m for m, _, _ in log[:4]] == ["EXTEND"] * 4
    assert [n for _, _, n in log[:4]] == [32, 32, 32, 4]
    assert done["long"].output_ids == expected_output(list(range(3, 103)), 2)


def test_retraction_under_tiny_pool_keeps_outputs_exact() -> None:
    rng = random.Random(1)
    s = create_scheduler(max_total_tokens=256, chunked_prefill_size=64, max_prefill_tokens=128)
    prompts = [rand_prompt(rng, rng.randint(5, 30)) for _ in range(12)]
    for i, p in enumerate(prompts):
        s.add_request(f"r{i}", p, params(max_new_tokens=40))
    done = run_all(s)
    assert s.stats.num_retractions > 0
    for i, p in enumerate(prompts):
        assert done[f"r{i}"].output_ids == expected_output(p, 40), f"r{i}"
    assert_no_leaks(s)


def test_retract_picks_fewest_outputs_then_longest_input() -> None:
    s = create_scheduler(max_total_tokens=4096)
    for i, n in enumerate([10, 30, 20]):
        s.add_request(f"r{i}", list(range(3, 3 + n)), params(max_new_tokens=50))
    s.step()  # one prefill of all three
    s.step()  # first decode
    reqs = {r.rid: r for r in s.running_batch.reqs}
    reqs["r0"].output_ids.extend([5] * 3)  # r0 has produced the most
    batch = s.running_batch
    alloc = s.pools.allocator
    # make memory look short so that all but one are retracted
    taken = alloc.alloc_extend([0], [alloc.available_size()], [-1])
    retracted = batch.retract_decode()
    order = [r.rid for r in retracted]
    assert order == ["r1", "r2"], order  # equal outputs: longest input first
    alloc.free(taken)


def test_in_batch_prefix_deprioritisation_with_lpm() -> None:
    rng = random.Random(2)
    shared = rand_prompt(rng, 64)
    s = create_scheduler(schedule_policy="lpm")
    s.add_request("a", shared + [5], params(max_new_tokens=2))
    s.add_request("b", shared + [6], params(max_new_tokens=2))
    s.add_request("c", rand_prompt(rng, 40), params(max_new_tokens=2))
    s.step()
    first = s.model_runner.forward_log[0]
    assert first[1] == 2, "b shares a long prefix with a: it waits for the next round"
    done = run_all(s)
    assert done["b"].cached_tokens == 64
    assert done["a"].cached_tokens == 0


def test_max_running_requests_is_respected() -> None:
    s = create_scheduler(max_running_requests=3)
    for i in range(8):
        s.add_request(f"r{i}", [3 + i] * 5, params(max_new_tokens=6))
    peak = 0
    while s.has_work():
        s.step()
        peak = max(peak, len([r for r in s.running_batch.reqs if not r.finished]))
    assert peak == 3
    assert max(bs for _, bs, _ in s.model_runner.forward_log) <= 3


def test_finish_reasons() -> None:
    s = create_scheduler()
    p = list(range(3, 20))
    out = expected_output(p, 10)
    s.add_request("len", p, params(max_new_tokens=4))
    s.add_request("stop_id", p, params(max_new_tokens=10, stop_token_ids=[out[2]]))
    done = run_all(s)
    assert done["len"].finished_reason.to_dict() == {"type": "length", "length": 4}
    assert done["stop_id"].finished_reason.to_dict() == {"type": "stop", "matched": out[2]}
    assert done["stop_id"].output_ids == out[:3]


def test_context_length_limit_and_validation() -> None:
    s = create_scheduler(context_length=None)
    ctx = s.context_len
    with pytest.raises(ValueError, match="input_ids"):
        s.add_request("too-long", [3] * ctx, params())
    with pytest.raises(ValueError, match="max_new_tokens"):
        s.add_request("too-many", [3] * 10, params(max_new_tokens=ctx))
    with pytest.raises(ValueError, match="empty"):
        s.add_request("empty", [], params())


def test_abort_waiting_running_and_chunked() -> None:
    s = create_scheduler(chunked_prefill_size=16, max_running_requests=2)
    s.add_request("run", list(range(3, 10)), params(max_new_tokens=50))
    s.add_request("chunk", list(range(3, 100)), params(max_new_tokens=50))
    s.add_request("wait", list(range(3, 10)), params(max_new_tokens=50))
    s.step()
    s.step()
    for rid in ("run", "chunk", "wait"):
        s.abort_request(rid)
    done = run_all(s)
    assert s.stats.num_running == 0 and s.stats.num_waiting == 0
    assert {rid: r.finished_reason.type for rid, r in done.items()} == {
        "run": "abort",
        "chunk": "abort",
        "wait": "abort",
    }
    assert_no_leaks(s)


def test_random_arrivals_and_aborts_every_request_ends_once() -> None:
    rng = random.Random(3)
    s = create_scheduler(
        max_total_tokens=400, chunked_prefill_size=32, page_size=2, max_running_requests=8
    )
    want: dict[str, list[int]] = {}
    aborted: set[str] = set()
    done: dict[str, object] = {}
    n = 0
    for _ in range(400):
        if n < 40 and rng.random() < 0.3:
            p = rand_prompt(rng, rng.randint(1, 60))
            if rng.random() < 0.5 and want:
                p = list(rng.choice(list(want.values())))[:30] + p[:10]
            rid = f"r{n}"
            want[rid] = p
            s.add_request(rid, p, params(max_new_tokens=rng.randint(1, 30)))
            n += 1
        if want and rng.random() < 0.05:
            rid = rng.choice(list(want))
            if rid not in done:
                aborted.add(rid)
                s.abort_request(rid)
        for ev in s.step():
            if ev.finished_reason is not None:
                assert ev.rid not in done
                done[ev.rid] = ev.req
    done.update(run_all(s))
    assert set(done) == set(want)
    for rid, req in done.items():
        if req.finished_reason.type != "abort":
            exp = expected_output(want[rid], req.sampling_params.max_new_tokens)
            assert req.output_ids == exp
        else:
            assert rid in aborted
    assert_no_leaks(s)


def test_prefix_policies_fall_back_to_fcfs_without_a_cache() -> None:
    rng = random.Random(4)
    shared = rand_prompt(rng, 64)
    s = create_scheduler(schedule_policy="lpm", disable_radix_cache=True)
    s.add_request("a", shared + [5], params(max_new_tokens=2))
    s.add_request("b", shared + [6], params(max_new_tokens=2))
    s.step()
    assert s.model_runner.forward_log[0][1] == 2, "nothing to gain by holding b back"

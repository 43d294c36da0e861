"""Mixed chunk (`enable_mixed_chunk`): running requests decode inside prefill batches.

Over the checksum runner, whose every prediction reads the request's whole sequence back
through `req_to_token`: a decode token put in the wrong slot or position of a mixed batch, or a
request counted twice, changes the outputs. Each run is checked against the exact answer."""

from __future__ import annotations

import random

from engine.scheduler.scheduler import Scheduler
from tests.fake_runner import create_scheduler, expected_output
from tests.unit.test_scheduler import assert_no_leaks, params, rand_prompt, run_all


def staggered(s: Scheduler, prompts: list[list[int]], every: int, max_new: int) -> dict:
    """Add one prompt every `every` steps while the earlier ones run; step until idle.
    Returns rid -> finished Req; counts the steps whose batch was mixed and sums the steps
    from each request's arrival to its finish."""
    done: dict[str, object] = {}
    s.mixed_steps = 0  # type: ignore[attr-defined]
    s.latency_steps = 0  # type: ignore[attr-defined]
    step = 0
    while step < every * len(prompts) or s.has_work():
        if step % every == 0 and step // every < len(prompts):
            i = step // every
            s.add_request(f"r{i}", prompts[i], params(max_new_tokens=max_new))
        for ev in s.step():
            if ev.finished_reason is not None:
                assert ev.rid not in done, f"{ev.rid} finished twice"
                done[ev.rid] = ev.req
                s.latency_steps += step + 1 - int(ev.rid[1:]) * every  # type: ignore[attr-defined]
        if s.last_batch is not None and s.last_batch.decoding_reqs:
            s.mixed_steps += 1  # type: ignore[attr-defined]
        step += 1
        assert step < 5000
    return done


def test_staggered_arrivals_are_mixed_and_outputs_exact() -> None:
    rng = random.Random(0)
    shared = rand_prompt(rng, 40)
    prompts = [(shared if i % 2 else []) + rand_prompt(rng, rng.randint(1, 70)) for i in range(12)]
    latency = {}
    for mixed in (False, True):
        s = create_scheduler(page_size=4, chunked_prefill_size=32, enable_mixed_chunk=mixed)
        done = staggered(s, prompts, every=3, max_new=12)
        for i, p in enumerate(prompts):
            assert done[f"r{i}"].output_ids == expected_output(p, 12), (mixed, i)
        latency[mixed] = s.latency_steps
        assert (s.mixed_steps > 0) == mixed
        assert_no_leaks(s)
    # a prefill step that carries the running requests' decode step is not a pause for them
    assert latency[True] < latency[False]


def test_chunk_budget_leaves_room_for_the_decode_tokens() -> None:
    s = create_scheduler(chunked_prefill_size=32, enable_mixed_chunk=True)
    for i in range(5):
        s.add_request(f"short{i}", [3 + i] * 4, params(max_new_tokens=30))
    s.step()  # the five prompts
    s.add_request("long", list(range(3, 103)), params(max_new_tokens=2))
    s.step()  # five decode tokens + 27 prompt tokens of `long`
    mode, bs, tokens = s.model_runner.forward_log[-1]
    assert (mode, bs, tokens) == ("EXTEND", 6, 32)
    batch = s.last_batch
    assert {r.rid for r in batch.decoding_reqs} == {f"short{i}" for i in range(5)}
    assert [r.rid for r in batch.reqs[:5]] == [f"short{i}" for i in range(5)]  # order kept
    assert batch.chunked_req is not None and batch.chunked_req.rid == "long"
    done = run_all(s)
    assert done["long"].output_ids == expected_output(list(range(3, 103)), 2)
    for i in range(5):
        assert done[f"short{i}"].output_ids == expected_output([3 + i] * 4, 30)
    assert_no_leaks(s)


def test_decode_steps_do_not_enter_the_prefix_cache() -> None:
    """Only prompts are inserted by a prefill batch; a decoding request's output is cached
    when it finishes (as without mixing), so a mixed batch adds no cache entries for it."""
    s = create_scheduler(enable_mixed_chunk=True)
    s.add_request("a", list(range(3, 13)), params(max_new_tokens=20))
    s.step()
    s.step()
    cached_before = s.tree_cache.total_size()
    s.add_request("b", list(range(50, 55)), params(max_new_tokens=2))
    s.step()
    assert s.last_batch.decoding_reqs
    assert s.tree_cache.total_size() == cached_before + 5  # b's prompt, nothing of a's
    run_all(s)
    assert_no_leaks(s)


def test_retraction_and_aborts_with_mixing() -> None:
    rng = random.Random(1)
    s = create_scheduler(
        max_total_tokens=256,
        chunked_prefill_size=64,
        max_prefill_tokens=128,
        enable_mixed_chunk=True,
    )
    prompts = [rand_prompt(rng, rng.randint(5, 30)) for _ in range(12)]
    done = staggered(s, prompts, every=2, max_new=40)
    assert s.stats.num_retractions > 0 and s.mixed_steps > 0
    for i, p in enumerate(prompts):
        assert done[f"r{i}"].output_ids == expected_output(p, 40), f"r{i}"
    assert_no_leaks(s)

    s = create_scheduler(enable_mixed_chunk=True)
    s.add_request("a", list(range(3, 13)), params(max_new_tokens=50))
    s.step()
    s.add_request("b", list(range(20, 30)), params(max_new_tokens=50))
    s.step()
    assert s.last_batch.decoding_reqs  # a decodes inside b's prefill
    assert s.stats.num_running == 2  # b counts as running once prefilled
    s.abort_request("a")
    s.abort_request("b")
    done = run_all(s)
    assert {r: d.finished_reason.type for r, d in done.items()} == {"a": "abort", "b": "abort"}
    assert s.stats.num_running == 0
    assert_no_leaks(s)

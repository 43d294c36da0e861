"""Device memory given back while idle and taken again (engine/memory_occupation.py,
engine/scheduler/memory_release.py; SGLang's release / resume_memory_occupation, vLLM's
sleep / wake_up), on a tiny model against transformers' greedy tokens, in every loop (the
plain one, the overlap loop's forward thread and its device process, where the model lives
in another process): released, the weights and K/V buffers hold no bytes and nothing runs;
resumed, the tokens are transformers' again whether the weights were kept in host memory or
discarded (read from the checkpoint again: zeroed weights would give other tokens), and the
prefix cache starts empty. A release is refused while requests hold K/V; after a retraction
it goes on with them waiting, and they end as transformers' after the resume. A weights
update while released fills the weights with the new checkpoint; a refused one leaves them
released."""

from __future__ import annotations

import pytest

from engine.engine import Engine
from tests.factories import SCHEDULER_LOOPS, hf_greedy, mixed_prompts, tiny_model
from tests.integration.test_pause import GREEDY, NEW, Run, decoding

A, B = tiny_model("llama"), tiny_model("llama", seed=1)
PROMPTS = mixed_prompts(500, n=3, max_len=40, seed=5)


def engine(kw: dict) -> Engine:
    return Engine(model_path=A, max_total_tokens=4096, chunked_prefill_size=64, **kw)


def generate(eng: Engine, path: str = A) -> list[dict]:
    outs = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out["output_ids"] == hf_greedy(path, prompt, NEW)
    return outs


def assert_released(eng: Engine, weights: bool, kv: bool) -> None:
    held = eng.scheduler.memory_occupied()
    assert (held["weights"] == 0) == weights and (held["kv_cache"] == 0) == kv, held


@SCHEDULER_LOOPS
@pytest.mark.parametrize("backup", [True, False], ids=["backup", "discard"])
def test_released_then_resumed_gives_the_same_tokens(kw: dict, backup: bool) -> None:
    eng = engine({**kw, "enable_weights_cpu_backup": backup})
    try:
        generate(eng)
        held = eng.scheduler.memory_occupied()
        assert held["weights"] > 0 and held["kv_cache"] > 0
        eng.release_memory_occupation()
        assert_released(eng, weights=True, kv=True)
        assert eng.is_sleeping() and eng.scheduler.asleep
        with pytest.raises(RuntimeError, match="memory is released"):
            eng.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
        assert not eng.scheduler.has_work()  # (the refused request was not queued)
        eng.resume_memory_occupation()
        assert eng.scheduler.memory_occupied() == held and not eng.is_sleeping()
        outs = generate(eng)
        assert [o["meta_info"]["cached_tokens"] for o in outs] == [0] * len(PROMPTS)
    finally:
        eng.shutdown()


def test_vllm_sleep_levels_and_tags() -> None:
    eng = engine({})
    try:
        for level in (1, 2):
            eng.sleep(level)
            assert_released(eng, weights=True, kv=True)
            eng.wake_up(["weights"])  # (vLLM's order: weights first, updated, then the K/V)
            assert_released(eng, weights=False, kv=True)
            assert eng.is_sleeping() and eng.scheduler.asleep
            eng.wake_up()
            assert not eng.is_sleeping()
            generate(eng)
        eng.sleep(2)
        eng.wake_up()  # (discarded: read again at the first forward...)
        eng.sleep(1)  # (...and not before this backup of what is there)
        eng.wake_up()
        generate(eng)
        eng.release_memory_occupation(["kv_cache"])
        assert_released(eng, weights=False, kv=True)
        eng.resume_memory_occupation(["kv_cache", "weights"])  # (one not released: left)
        eng.release_memory_occupation(["cuda_graph"])  # (none on CPU; it runs on)
        assert not eng.scheduler.asleep
        generate(eng)
        with pytest.raises(ValueError, match="unknown memory tag 'gpu'"):
            eng.release_memory_occupation(["gpu"])
        with pytest.raises(ValueError, match="sleep level 3"):
            eng.sleep(3)
        assert eng.scheduler.released_memory == {"cuda_graph"}
    finally:
        eng.shutdown()


@SCHEDULER_LOOPS
def test_refused_while_requests_hold_kv_then_after_a_retraction(kw: dict) -> None:
    eng = engine(kw)
    try:
        run = Run(eng, PROMPTS)
        run.step_until(decoding)
        sched = run.sched
        held = sched.memory_occupied()
        with pytest.raises(ValueError, match="requests are running"):
            sched.release_memory_occupation()
        assert sched.released_memory == frozenset() and sched.memory_occupied() == held
        run.take(sched.output.take_events())  # (settled: the batch in flight's tokens)
        assert sched.retract_all() == len(PROMPTS)
        sched.release_memory_occupation()
        assert_released(eng, weights=True, kv=True)
        assert sched.has_work() and sched.asleep  # (they wait; the worker does not step)
        sched.resume_memory_occupation()
        run.to_end()
    finally:
        eng.shutdown()
    run.assert_greedy(PROMPTS)


@SCHEDULER_LOOPS
def test_a_weights_update_while_released_fills_them(kw: dict) -> None:
    eng = engine(kw)  # (weights discarded at a release: no backup)
    try:
        generate(eng)
        eng.release_memory_occupation()
        with pytest.raises(ValueError, match="does not fit|checkpoint"):
            eng.update_weights_from_disk(tiny_model("gpt2"))
        assert_released(eng, weights=True, kv=True)  # (refused: released as they were)
        eng.update_weights_from_disk(B)
        assert_released(eng, weights=False, kv=True)
        assert eng.scheduler.released_memory == {"kv_cache", "cuda_graph"}
        eng.resume_memory_occupation()
        generate(eng, B)
        eng.sleep(2)  # discarded again: read again from B, the checkpoint served now
        eng.wake_up()
        generate(eng, B)
    finally:
        eng.shutdown()


def test_weights_quantized_as_they_loaded_are_only_released_with_a_backup() -> None:
    eng = engine({"quantization": "fp8", "disable_overlap_schedule": True})
    try:
        before = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        with pytest.raises(ValueError, match="quantized to FP8 as they loaded"):
            eng.sleep(2)
        assert eng.scheduler.released_memory == frozenset()
        assert_released(eng, weights=False, kv=False)
        eng.sleep(1)
        eng.wake_up()
        after = eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    finally:
        eng.shutdown()
    assert [o["output_ids"] for o in after] == [o["output_ids"] for o in before]

"""LoRA adapters loaded into and unloaded from a running engine (SGLang's
`Engine.load_lora_adapter`, vLLM's runtime LoRA updating), against PEFT on the same random
weights: an engine started with none serves adapters loaded later, with and without the
overlap loop (its forward thread and its device process); an adapter replaced in place serves
its new weights with nothing of the old one's K/V reused; one unloaded while its requests run
lets them finish on it, then its weights go and a freed slot is reused; what cannot be loaded
is refused with the reason and the engine goes on serving."""

from __future__ import annotations

import pytest

from engine.engine import Engine
from tests.factories import (
    SCHEDULER_LOOPS,
    assert_engine_clean,
    lora_greedy,
    mixed_prompts,
    model_path,
    tiny_lora,
)

NEW = 12
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
ARCH = "llama"


def adapter(seed: int, rank: int = 8, **kw: object) -> str:
    return tiny_lora(model_path(ARCH), seed, rank, **kw)


def peft(folder: str | None, prompt: list[int]) -> list[int]:
    return lora_greedy(model_path(ARCH), folder, prompt, NEW)


def engine(**kw: object) -> Engine:
    return Engine(model_path=model_path(ARCH), max_total_tokens=4096, **kw)


def run(eng: Engine, prompts: list[list[int]], names: list[str | None]) -> list[list[int]]:
    outs = eng.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=names)
    return [o["output_ids"] for o in outs]


def device_lora(eng: Engine):
    """The device's LoRA manager, where this process can see it (not a device process's)."""
    return eng.scheduler.model_runner.lora


@SCHEDULER_LOOPS
def test_adapters_loaded_at_run_time_match_peft(kw: dict) -> None:
    a, b = adapter(1), adapter(2, rank=4, targets=("q_proj", "v_proj", "down_proj"))
    prompts = mixed_prompts(500, n=6, max_len=40, seed=5)
    eng = engine(enable_lora=True, **kw)
    try:
        assert eng.lora_adapters() == {}
        base = run(eng, prompts[:2], [None, None])
        eng.load_lora_adapter("a", a)
        names = [None, "a", "a", None, "a", None]
        got = run(eng, prompts, names)
        eng.load_lora_adapter("b", b)
        assert eng.lora_adapters() == {"a": a, "b": b}
        names2 = ["b", "a", None, "b", "a", "b"]
        got2 = run(eng, prompts, names2)
        eng.unload_lora_adapter("a")
        with pytest.raises(ValueError, match=r"no LoRA adapter 'a' \(served: \['b'\]\)"):
            run(eng, prompts[:1], ["a"])
        got3 = run(eng, prompts[:2], ["b", None])
        assert_engine_clean(eng)
    finally:
        eng.shutdown()
    folders = {"a": a, "b": b, None: None}
    assert base == [peft(None, p) for p in prompts[:2]]
    for outs, which in ((got, names), (got2, names2), (got3, ["b", None])):
        for prompt, name, out in zip(prompts, which, outs):
            assert out == peft(folders[name], prompt), name


def test_replaced_in_place_serves_the_new_weights_with_nothing_cached() -> None:
    old, new = adapter(1), adapter(3)
    prompt = mixed_prompts(500, n=1, max_len=60, seed=8)[0]
    eng = engine(lora_paths=(f"a={old}",), disable_overlap_schedule=True)
    try:
        first = eng.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="a")
        again = eng.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="a")
        assert again["meta_info"]["cached_tokens"] >= len(prompt) - 1  # (the cache works)
        with pytest.raises(ValueError, match="already loaded"):
            eng.load_lora_adapter("a", new)
        eng.load_lora_adapter("a", new, replace=True)
        after = eng.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="a")
        assert after["meta_info"]["cached_tokens"] == 0  # the old weights' K/V are not reused
        assert eng.lora_adapters() == {"a": new}
        assert sorted(device_lora(eng).specs) == [2]  # the old one's weights are gone
        assert_engine_clean(eng)
    finally:
        eng.shutdown()
    assert first["output_ids"] == again["output_ids"] == peft(old, prompt)
    assert after["output_ids"] == peft(new, prompt) != first["output_ids"]


@pytest.mark.parametrize(
    "kw", [dict(disable_overlap_schedule=True), dict(cpu_overlap_executor="thread")],
    ids=["no-overlap", "thread"],
)  # fmt: skip
def test_unloaded_while_running_finishes_then_frees_its_slot(kw: dict) -> None:
    """Requests of an adapter unloaded mid-decode finish on it; its weights go when they end,
    and a later adapter takes its slot beside the one still in use (two slots)."""
    a, b, c = adapter(1), adapter(2), adapter(4)
    prompts = mixed_prompts(500, n=4, max_len=30, seed=9)
    eng = engine(enable_lora=True, max_loras_per_batch=2, **kw)
    sched = eng.scheduler
    try:
        eng.load_lora_adapter("a", a)
        eng.load_lora_adapter("b", b)
        params = eng._params(GREEDY, 2, {})
        sched.add_request("ra", prompts[0], params[0], lora_name="a")
        sched.add_request("rb", prompts[1], params[1], lora_name="b")
        outs: dict[str, list[int]] = {"ra": [], "rb": []}
        for _ in range(4):
            for ev in sched.step():
                outs[ev.rid] += ev.new_token_ids
        assert device_lora(eng).slot_of == {1: 0, 2: 1}
        eng.unload_lora_adapter("a")
        assert eng.lora_adapters() == {"b": b} and sched.loras.draining == {1}
        assert 1 in device_lora(eng).weights  # still running on it
        with pytest.raises(ValueError, match="no LoRA adapter 'a'"):
            sched.add_request("late", prompts[2], params[0], lora_name="a")
        while sched.has_work():
            for ev in sched.step():
                outs[ev.rid] += ev.new_token_ids
        assert not sched.loras.draining and 1 not in device_lora(eng).weights
        assert dict(device_lora(eng).slot_of) == {2: 1}
        eng.load_lora_adapter("c", c)
        both = run(eng, prompts[2:4], ["c", "b"])
        assert device_lora(eng).slot_of == {2: 1, 3: 0}  # c in a's old slot
        assert_engine_clean(eng)
    finally:
        eng.shutdown()
    assert outs["ra"] == peft(a, prompts[0]) and outs["rb"] == peft(b, prompts[1])
    assert both == [peft(c, prompts[2]), peft(b, prompts[3])]


@pytest.mark.parametrize(
    "kw", [dict(disable_overlap_schedule=True), dict(cpu_overlap_executor="process")],
    ids=["no-overlap", "process"],
)  # fmt: skip
def test_refusals_change_nothing(kw: dict, tmp_path) -> None:
    prompt = mixed_prompts(500, n=1, max_len=20, seed=3)[0]
    off = engine(disable_overlap_schedule=True)
    try:
        with pytest.raises(ValueError, match="not enabled.*--enable-lora"):
            off.load_lora_adapter("a", adapter(1))
    finally:
        off.shutdown()
    eng = engine(enable_lora=True, max_lora_rank=8, **kw)
    try:
        with pytest.raises(ValueError, match="rank 16 > max_lora_rank 8"):
            eng.load_lora_adapter("big", adapter(5, rank=16))
        with pytest.raises(ValueError, match="no adapter_config.json"):
            eng.load_lora_adapter("gone", str(tmp_path))
        other = tiny_lora(model_path("qwen3"), 1, 8)
        with pytest.raises(ValueError, match="'wrong'.*another base model"):
            eng.load_lora_adapter("wrong", other)  # refused by the device's manager
        with pytest.raises(ValueError, match="'x' is not loaded"):
            eng.unload_lora_adapter("x")
        assert eng.lora_adapters() == {}
        eng.load_lora_adapter("a", adapter(1))
        out = eng.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="a")
        assert out["output_ids"] == peft(adapter(1), prompt)
        assert_engine_clean(eng)
    finally:
        eng.shutdown()

"""Multi-LoRA serving end to end, against PEFT on the same random weights: every request gets
its own adapter's greedy tokens (PEFT's `PeftModel` over transformers is the reference) in
batches that mix adapters and the base model, with and without the overlap loop, with fewer
device slots than adapters; the prefix cache never shares K/V across adapters; adapters the
engine cannot serve are refused at start with the reason."""

from __future__ import annotations

import json
import os
import tempfile

import pytest

from engine.engine import Engine
from tests.factories import (
    assert_engine_clean,
    lora_greedy,
    mixed_prompts,
    model_path,
    tiny_lora,
    tiny_model,
)

NEW = 16
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
_ROOT = tempfile.mkdtemp(prefix="sluice-test-loras-")


def adapter(arch: str, seed: int, rank: int = 8, **kw: object) -> str:
    if arch == "llama-small":
        return tiny_lora(tiny_model("llama", preset="small"), seed, rank, **kw)
    return tiny_lora(model_path(arch), seed, rank, **kw)


def peft_greedy(arch: str, adapter_dir: str | None, prompt: list[int]) -> list[int]:
    return lora_greedy(model_path(arch), adapter_dir, prompt, NEW)


def serve(arch: str, adapters: dict[str, str], **kw: object) -> Engine:
    paths = tuple(f"{name}={path}" for name, path in adapters.items())
    return Engine(model_path=model_path(arch), lora_paths=paths, max_total_tokens=4096, **kw)


def check_against_peft(
    arch: str, adapters: dict[str, str], names: list[str | None], **kw: object
) -> Engine:
    prompts = mixed_prompts(500, n=len(names), max_len=60, seed=11)
    engine = serve(arch, adapters, **kw)
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=names)
    for prompt, name, out in zip(prompts, names, outs):
        want = peft_greedy(arch, adapters.get(name) if name else None, prompt)
        assert out["output_ids"] == want, f"adapter {name}"
    return engine


NAMES = [None, "a", "b", "a", None, "c", "b", "c", "a"]


@pytest.mark.parametrize(
    ("arch", "kw"),
    [
        ("llama", dict(disable_overlap_schedule=True)),
        ("qwen2", dict(page_size=4, cpu_overlap_executor="process")),
        ("qwen3", dict(cpu_overlap_executor="thread", chunked_prefill_size=32)),
        ("gemma2", dict(disable_overlap_schedule=True, page_size=2)),
        # PEFT adapters of Phi-3's fused qkv_proj / gate_up_proj modules
        ("phi3", dict(disable_overlap_schedule=True)),
        # GLM-4: q_proj / k_proj adapters over interleaved rope (their B rows reordered as the
        # weights' are), the fused gate_up_proj's split
        ("glm4", dict(disable_overlap_schedule=True)),
    ],
)
def test_each_request_gets_its_adapter(arch: str, kw: dict) -> None:
    qv = ("qkv_proj",) if arch == "phi3" else ("q_proj", "v_proj")
    adapters = {
        "a": adapter(arch, 1),
        "b": adapter(arch, 2, rank=4, targets=(*qv, "down_proj")),
        "c": adapter(arch, 3, rank=16, use_rslora=True),
    }
    engine = check_against_peft(arch, adapters, NAMES, **kw)
    try:
        if engine.scheduler.model_runner.lora is not None:  # (in a device process otherwise)
            assert engine.scheduler.model_runner.lora.max_rank == 16
        assert_engine_clean(engine)
    finally:
        engine.shutdown()


def test_per_module_ranks_and_alphas() -> None:
    """PEFT's `rank_pattern` / `alpha_pattern` (some modules' own r and alpha, the first key
    matching the end of the module's path): q_proj at rank 4, layer 1's down_proj at 16
    (a key with a dot), v_proj with alpha 2 (its own scaling), the rest at rank 8 with the
    adapter's alpha; beside an adapter without patterns. The slots are the largest rank's."""
    ranks = (("q_proj", 4), (r"layers\.1\.mlp\.down_proj", 16))
    patterned = adapter("llama", 5, rank_pattern=ranks, alpha_pattern=(("v_proj", 2.0),))
    with open(os.path.join(patterned, "adapter_config.json")) as f:
        assert json.load(f)["rank_pattern"] == dict(ranks)
    engine = check_against_peft("llama", {"p": patterned, "a": adapter("llama", 1)},
                                ["p", None, "a", "p"], disable_overlap_schedule=True)  # fmt: skip
    try:
        assert engine.scheduler.model_runner.lora.max_rank == 16
        assert_engine_clean(engine)
    finally:
        engine.shutdown()


def test_more_adapters_than_slots() -> None:
    """One slot: requests of different adapters never share a batch, adapters are swapped
    in and out of the slot, and every request still gets its own."""
    adapters = {n: adapter("llama", s) for n, s in (("a", 1), ("b", 2), ("c", 3))}
    engine = check_against_peft(
        "llama", adapters, NAMES, max_loras_per_batch=1, disable_overlap_schedule=True
    )
    try:
        assert_engine_clean(engine)
    finally:
        engine.shutdown()


def test_prefix_cache_is_per_adapter() -> None:
    adapters = {"a": adapter("llama", 1), "b": adapter("llama", 2)}
    engine = serve("llama", adapters, disable_overlap_schedule=True)
    prompt = mixed_prompts(500, n=1, max_len=80, seed=4)[0] + list(range(100, 140))
    try:
        cached = []
        for name in ("a", "b", None, "a", "b", None):
            out = engine.generate(input_ids=prompt, sampling_params=GREEDY, lora_path=name)
            want = peft_greedy("llama", adapters.get(name) if name else None, prompt)
            assert out["output_ids"] == want, name
            cached.append(out["meta_info"]["cached_tokens"])
        assert cached[:3] == [0, 0, 0]  # nothing shared across adapters or with the base
        assert min(cached[3:]) >= len(prompt) - 1  # each one's own run is cached
        assert_engine_clean(engine)
    finally:
        engine.shutdown()


def test_unknown_adapter_is_a_clear_error() -> None:
    engine = serve("llama", {"a": adapter("llama", 1)}, disable_overlap_schedule=True)
    try:
        with pytest.raises(ValueError, match="no LoRA adapter 'nope'.*served: \\['a'\\]"):
            engine.generate(input_ids=[10, 11, 12], sampling_params=GREEDY, lora_path="nope")
    finally:
        engine.shutdown()


def _edit_config(src: str, **changes: object) -> str:
    out = tempfile.mkdtemp(dir=_ROOT)
    for name in os.listdir(src):
        os.symlink(os.path.join(src, name), os.path.join(out, name))
    with open(os.path.join(src, "adapter_config.json")) as f:
        config = json.load(f) | changes
    os.unlink(os.path.join(out, "adapter_config.json"))
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return out


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda: adapter("llama-small", 1), "adapter of another base model"),
        (lambda: adapter("llama", 1, targets=("lm_head",)), "adapts lm_head; only"),
        (lambda: _edit_config(adapter("llama", 1), use_dora=True), "use_dora=True"),
        (lambda: _edit_config(adapter("llama", 1), peft_type="IA3"), "IA3 is not LORA"),
        (lambda: _edit_config(adapter("llama", 1), r=4), "expected rank 4"),
        (lambda: _edit_config(adapter("llama", 1), rank_pattern={"q_proj": 4}),
         "q_proj has A .*; expected rank 4"),
        (lambda: _edit_config(adapter("llama", 1), rank_pattern={"q_proj": 0}),
         "rank_pattern must map module patterns to positive numbers"),
        (lambda: _edit_config(adapter("llama", 1), alpha_pattern={"q_proj[": 2.0}),
         "alpha_pattern key 'q_proj\\[' is not a regular expression"),
        (lambda: tempfile.mkdtemp(dir=_ROOT), "no adapter_config.json"),
    ],
)
def test_unservable_adapters_are_refused_at_start(make, why: str) -> None:
    try:
        path = make()
    except ValueError as e:  # make-tiny-lora itself refuses some
        assert why in str(e)
        return
    with pytest.raises(ValueError, match=why):
        serve("llama", {"x": path}, disable_overlap_schedule=True)


def test_rank_above_max_lora_rank_is_refused() -> None:
    with pytest.raises(ValueError, match="rank 8 > max_lora_rank 4"):
        serve("llama", {"a": adapter("llama", 1)}, max_lora_rank=4, disable_overlap_schedule=True)


def test_lora_on_a_deepseek_model_is_refused_with_the_reason() -> None:
    """MLA's q_proj rows are reordered at load and kv_b_proj is read as a matrix: an adapter
    would be applied wrongly, so LoRA is refused (at start) rather than served."""
    with pytest.raises(ValueError, match="DeepseekV2ForCausalLM: multi-head latent attention"):
        serve("deepseek_v2", {"a": adapter("deepseek_v2", 1)}, disable_overlap_schedule=True)

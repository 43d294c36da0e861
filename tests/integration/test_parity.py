"""Greedy outputs of the engine equal transformers' on the same weights (CPU, float32), for
every architecture, under every scheduler/memory configuration that changes the code path,
with the overlap scheduler (the default) and the plain loop; and the two loops agree exactly.
Mixture-of-experts models differ from their dense siblings only in the feed-forward block, so
they run the configurations that change what a batch holds (MOE_CONFIGS), not all of them.
Phi-3 (the Llama layer with another checkpoint layout, fused q/k/v and gate/up tensors, and a
partial rotary dimension), Granite (the Llama layer with four multipliers), SmolLM3 (a layer
without rope) and OLMo 2 (norms after the blocks) run those too.
So do the sliding-window models (`WINDOWED_MODELS`: every layer, or every other one, sees its
last 32 keys of prompts up to 300 tokens), plus page16: pages and chunks that straddle a
window's edge."""

from __future__ import annotations

import functools

import pytest

from engine.engine import Engine
from tests.factories import (
    DENSE_ARCHS,
    MOE_ARCHS,
    WINDOWED_MODELS,
    assert_engine_clean,
    assert_greedy_match,
    hf_greedy,
    mixed_prompts,
    model_path,
)

MAX_NEW = 24

CONFIGS = {
    "default": {},
    "page16": {"page_size": 16},
    "chunked": {"chunked_prefill_size": 64},
    "radix_off": {"disable_radix_cache": True},
    "retract": {"max_total_tokens": 640, "chunked_prefill_size": 256, "max_prefill_tokens": 512},
    "lpm": {"schedule_policy": "lpm"},
    "dfs_weight": {"schedule_policy": "dfs-weight", "page_size": 4},
}

MOE_CONFIGS = ("default", "chunked", "retract")
LAYOUT_ARCHS = ("phi3", "granite", "smollm3", "olmo2", "glm4", "gpt_oss")
WINDOWED_CONFIGS = ("default", "chunked", "page16", "retract")
LOOPS = {"overlap": {}, "plain": {"disable_overlap_schedule": True}}
CASES = (
    [(arch, config) for arch in DENSE_ARCHS for config in CONFIGS]
    + [(arch, config) for arch in MOE_ARCHS + LAYOUT_ARCHS for config in MOE_CONFIGS]
    + [(name, config) for name in WINDOWED_MODELS for config in WINDOWED_CONFIGS]
)


@functools.cache
def _reference(arch: str) -> tuple[str, list[list[int]], list[list[int]]]:
    """`arch`: an architecture, or a name in WINDOWED_MODELS."""
    path = model_path(arch)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(path).vocab_size
    prompts = mixed_prompts(vocab, n=16)
    want = [hf_greedy(path, p, MAX_NEW) for p in prompts]
    return path, prompts, want


def _run(
    path: str, prompts: list[list[int]], **engine_kwargs
) -> tuple[list[dict], list[dict], dict]:
    params = {"max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True}
    with Engine(model_path=path, **engine_kwargs) as engine:
        # A first wave fills the prefix cache, so the second one hits it.
        first = engine.generate(input_ids=prompts[:4], sampling_params=params)
        second = engine.generate(input_ids=prompts, sampling_params=params)
        stats = engine.get_stats()
        assert_engine_clean(engine)
    return first, second, stats


@functools.cache
def _outputs(arch: str, config: str, loop: str) -> tuple[list[dict], list[dict], dict]:
    path, prompts, _ = _reference(arch)
    return _run(path, prompts, **CONFIGS[config], **LOOPS[loop])


@pytest.mark.parametrize("loop", list(LOOPS))
@pytest.mark.parametrize("arch,config", CASES)
def test_greedy_matches_transformers(arch: str, config: str, loop: str) -> None:
    path, prompts, want = _reference(arch)
    first, second, stats = _outputs(arch, config, loop)
    if loop == "overlap":
        plain_first, plain_second, _ = _outputs(arch, config, "plain")
        got = [o["output_ids"] for o in first + second]
        assert got == [o["output_ids"] for o in plain_first + plain_second], "overlap != plain"
    for i, out in enumerate(first):
        assert_greedy_match(path, prompts[i], out["output_ids"], want[i])
    for i, out in enumerate(second):
        assert out["meta_info"]["completion_tokens"] == MAX_NEW
        assert out["meta_info"]["finish_reason"]["type"] == "length"
        assert_greedy_match(path, prompts[i], out["output_ids"], want[i])
    cached = sum(o["meta_info"]["cached_tokens"] for o in second)
    if config == "radix_off":
        assert cached == 0
    else:
        assert cached > 0, "the second wave should hit the prefix cache"
    if config == "retract":
        assert stats["num_retractions"] > 0, "the tiny KV pool should force retraction"


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_bf16_teacher_forcing_harness_on_the_cpu(arch: str, tmp_path) -> None:
    """The GPU parity test's bf16 case (its model, sequences and scoring) on the CPU with
    torch_native, where both engines run much the same torch ops: every position agrees up to
    a bf16 tie (gemma2's logits, soft-capped at 30, tie often at bf16's 0.125 steps there)."""
    import torch

    from tests.teacher_forcing import (
        bf16_parity_model,
        bf16_sequences,
        hf_logits,
        runner_teacher_forced,
        score_logits,
    )

    path = bf16_parity_model(str(tmp_path), arch)
    seqs, prompt_lens = bf16_sequences(seed=0)
    ours = runner_teacher_forced(path, seqs, prompt_lens, "cpu", "torch_native")
    stats = score_logits(ours, hf_logits(path, seqs, "cpu", torch.bfloat16))
    assert stats["positions"] == sum(len(s) for s in seqs)
    assert stats["agreement_tie_aware"] == 1.0 and stats["agreement"] >= 0.97, stats

"""Prompt logprobs (`logprob_start_len`) equal transformers' on the same weights (CPU, float32)
under the scheduler paths that change which positions a forward computes: chunked prefill
(positions split over chunks), prefix-cache hits (the cache must stop where logprobs start),
mixed chunk, retraction and both loops; `max_new_tokens` 0 scores the prompt only."""

from __future__ import annotations

import functools
import random
import time

import pytest
import torch

from engine.engine import Engine
from tests.factories import _hf_model, assert_engine_clean, mixed_prompts, tiny_model

ATOL = 1e-3  # float32 engine vs float32 transformers; the logprobs are tens of nats
TOP = 3

CONFIGS = {
    "plain": {"disable_overlap_schedule": True},
    "overlap": {},
    "chunked": {"chunked_prefill_size": 48, "disable_overlap_schedule": True},
    "chunked_overlap": {"chunked_prefill_size": 48, "page_size": 4},
    "mixed": {"chunked_prefill_size": 64, "enable_mixed_chunk": True, "page_size": 16},
    "retract": {"max_total_tokens": 640, "chunked_prefill_size": 256, "max_prefill_tokens": 512},
}


@functools.cache
def _case() -> tuple[str, list[list[int]], list[int]]:
    path = tiny_model("llama")
    from transformers import AutoConfig

    prompts = mixed_prompts(AutoConfig.from_pretrained(path).vocab_size, n=16, max_len=200)
    rng = random.Random(1)
    # from the first token, the middle, the last, and past the end (no prompt logprobs)
    starts = [rng.choice([0, 1, len(p) // 2, len(p) - 1, len(p) + 3]) for p in prompts]
    return path, prompts, starts


@torch.inference_mode()
def _hf_logprobs(path: str, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, V]: row i is the distribution of token i + 1."""
    logits = _hf_model(path)(torch.tensor([prompt])).logits[0, :-1]
    return torch.log_softmax(logits.double(), dim=-1)


def _check(path: str, prompt: list[int], start: int, meta: dict) -> None:
    if start >= len(prompt):
        assert "input_token_logprobs" not in meta
        return
    got = meta["input_token_logprobs"]
    assert [t for _, t, _ in got] == prompt[start:]
    assert all(text is None for *_, text in got)  # SGLang's entries: no text unless asked
    if start == 0:
        assert got[0][0] is None and meta["input_top_logprobs"][0] is None
    first = max(start, 1)
    assert len(got) == len(prompt) - start
    if first >= len(prompt):
        return
    ref = _hf_logprobs(path, prompt)[first - 1 :]
    want = ref.gather(1, torch.tensor(prompt[first:]).unsqueeze(1)).squeeze(1)
    values = torch.tensor([lp for lp, *_ in got[first - start :]], dtype=torch.float64)
    torch.testing.assert_close(values, want, atol=ATOL, rtol=0)
    tops = meta["input_top_logprobs"][first - start :]
    want_top = ref.topk(TOP, dim=-1)
    for row, (top, ids, vals) in enumerate(zip(tops, want_top.indices, want_top.values)):
        assert len(top) == TOP
        got_vals = torch.tensor([v for v, *_ in top], dtype=torch.float64)
        torch.testing.assert_close(got_vals, vals, atol=ATOL, rtol=0)
        # ids agree except where two candidates tie within the tolerance
        for (v, t, _), want_id in zip(top, ids.tolist()):
            assert t == want_id or abs(ref[row, t].item() - v) < ATOL, (row, t, want_id)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_prompt_logprobs_match_transformers(config: str) -> None:
    path, prompts, starts = _case()
    params = [
        {"max_new_tokens": 0 if i % 3 == 0 else 4, "temperature": 0.0, "ignore_eos": True,
         "logprob_start_len": s}
        for i, s in enumerate(starts)
    ]  # fmt: skip
    with Engine(model_path=path, **CONFIGS[config]) as engine:
        # the first wave fills the prefix cache with every prompt: the second wave hits it
        warm = {"max_new_tokens": 2, "temperature": 0.0}
        engine.generate(input_ids=prompts, sampling_params=warm)
        start_s = time.perf_counter()
        outs = engine.generate(
            input_ids=prompts, sampling_params=params, return_logprob=True, top_logprobs_num=TOP
        )
        call_s = time.perf_counter() - start_s
        stats = engine.get_stats()
        assert_engine_clean(engine)
    for i, (prompt, start, out) in enumerate(zip(prompts, starts, outs)):
        meta = out["meta_info"]
        _check(path, prompt, start, meta)
        want_new = params[i]["max_new_tokens"]
        assert len(out["output_ids"]) == want_new == meta["completion_tokens"]
        assert len(meta["output_token_logprobs"]) == want_new
        assert meta["finish_reason"] == {"type": "length", "length": want_new}
        assert 0 < meta["e2e_latency"] <= call_s  # SGLang's: the call's start to this end
    # the prefix cache stops where prompt logprobs need logits, and is used elsewhere
    for out, start, prompt in zip(outs, starts, prompts):
        if start < len(prompt):
            assert out["meta_info"]["cached_tokens"] <= max(start, 1) - 1
    if config == "retract":
        assert stats["num_retractions"] > 0, "the tiny KV pool should force retraction"
    else:
        assert any(o["meta_info"]["cached_tokens"] > 1 for o, s, p in zip(outs, starts, prompts)
                   if s >= len(p) - 1)  # fmt: skip

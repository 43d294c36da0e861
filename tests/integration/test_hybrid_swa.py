"""Hybrid sliding-window memory end to end: the engine generates the same tokens with and
without it, while the windowed layers' pool is far smaller than the tokens in flight; the
prefix cache still hits; a pool too small for one prefill chunk is refused at start."""

from __future__ import annotations

import pytest

from engine.engine import Engine
from tests.factories import mixed_prompts, model_path

GREEDY = {"max_new_tokens": 120, "temperature": 0, "ignore_eos": True}
# 8 requests of up to 300 + 120 tokens all fit the full pool at once (no retraction); the
# window pool gets a tenth of it: 640 tokens for the 2405 in flight
BASE = dict(max_total_tokens=6400, chunked_prefill_size=128, swa_full_tokens_ratio=0.1)
OVERLAP = {
    "off": dict(disable_overlap_schedule=True),
    "process": dict(cpu_overlap_executor="process"),
    "thread": dict(cpu_overlap_executor="thread"),
}


def run(path: str, prompts: list[list[int]], hybrid: bool, **kw: object):
    engine = Engine(model_path=path, hybrid_swa_memory=hybrid, **BASE, **kw)
    try:
        out = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        scheduler = engine.scheduler
        scheduler.tree_cache.check_integrity()
        return out, scheduler
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    ("name", "page_size", "overlap"),
    [
        ("gemma3_text", 1, "off"),
        ("gemma3_text", 16, "process"),
        ("mistral-sliding", 4, "thread"),
        ("gemma2", 1, "process"),
    ],
)
def test_same_tokens_in_a_fraction_of_the_memory(name: str, page_size: int, overlap: str) -> None:
    path = model_path(name)
    prompts = mixed_prompts(500, n=8, max_len=300, seed=3)
    kw = dict(page_size=page_size, **OVERLAP[overlap])
    plain, _ = run(path, prompts, hybrid=False, **kw)
    hybrid, scheduler = run(path, prompts, hybrid=True, **kw)
    assert [r["output_ids"] for r in hybrid] == [r["output_ids"] for r in plain]
    alloc = scheduler.pools.allocator
    in_flight = sum(len(p) + GREEDY["max_new_tokens"] for p in prompts)
    assert alloc.swa_size * 3 < in_flight
    assert scheduler.stats.num_retractions == 0
    assert alloc.swa_available_size() + scheduler.tree_cache.swa_evictable_size() == alloc.swa_size


def test_prefix_cache_hits_with_window_memory() -> None:
    path = model_path("gemma3_text")
    prompts = mixed_prompts(500, n=8, max_len=300, seed=5)
    shared = [p for p in prompts if len(p) > 200][:2]  # the long common prefix
    kw = dict(disable_overlap_schedule=True)
    engine = Engine(model_path=path, hybrid_swa_memory=True, **BASE, **kw)
    try:
        first = engine.generate(input_ids=shared[:1], sampling_params=GREEDY)
        second = engine.generate(input_ids=shared, sampling_params=GREEDY)
        engine.scheduler.tree_cache.check_integrity()
    finally:
        engine.shutdown()
    assert second[0]["meta_info"]["cached_tokens"] >= len(shared[0]) - 1 - 32
    assert second[1]["meta_info"]["cached_tokens"] > 100  # the common prefix
    plain, _ = run(path, shared, hybrid=False, **kw)
    assert [r["output_ids"] for r in second] == [r["output_ids"] for r in plain]
    assert first[0]["output_ids"] == plain[0]["output_ids"]


def test_a_window_pool_too_small_for_a_chunk_is_refused() -> None:
    with pytest.raises(ValueError, match="swa_full_tokens_ratio"):
        Engine(
            model_path=model_path("gemma3_text"),
            hybrid_swa_memory=True,
            max_total_tokens=2048,
            swa_full_tokens_ratio=0.05,
            chunked_prefill_size=512,
            disable_overlap_schedule=True,
        )


def test_models_without_windows_ignore_the_flag() -> None:
    engine = Engine(
        model_path=model_path("llama"), hybrid_swa_memory=True, disable_overlap_schedule=True
    )
    try:
        assert engine.scheduler.pools.sliding_window is None
        assert not hasattr(engine.scheduler.pools.allocator, "swa_size")
    finally:
        engine.shutdown()


def test_cli_flags() -> None:
    import argparse

    from services.engine_args import add_engine_args, engine_args_from

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    flags = ["--model", "m", "--hybrid-swa-memory", "--swa-full-tokens-ratio", "0.3"]
    args = engine_args_from(parser.parse_args(flags))
    assert args.hybrid_swa_memory and args.swa_full_tokens_ratio == 0.3
    assert not engine_args_from(parser.parse_args(["--model", "m"])).hybrid_swa_memory
    with pytest.raises(ValueError, match="swa_full_tokens_ratio"):
        engine_args_from(parser.parse_args(["--model", "m", "--swa-full-tokens-ratio", "0"]))

"""The hierarchical cache end to end: documents evicted from a small device pool come back
from host memory (their prefill is not computed again), and the tokens generated are those
of a plain radix cache, with every scheduler (plain, overlap with a device process or a
forward thread) and page size."""

from __future__ import annotations

import random

import pytest

from engine.engine import Engine
from tests.factories import assert_engine_clean, model_path

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
OVERLAP = {
    "off": dict(disable_overlap_schedule=True),
    "process": dict(cpu_overlap_executor="process"),
    "thread": dict(cpu_overlap_executor="thread"),
}
DOC_LEN = 240


def documents(n: int, vocab: int = 500, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(8, vocab) for _ in range(DOC_LEN)] for _ in range(n)]


def rounds(path: str, hicache: bool, **kw: object):
    """Two rounds over 6 documents, each time with a new question; the device pool holds
    about two documents at a time, so each round evicts the round before."""
    docs = documents(6)
    engine = Engine(
        model_path=path,
        max_total_tokens=640,
        chunked_prefill_size=128,
        enable_hierarchical_cache=hicache,
        hicache_ratio=4.0,
        **kw,
    )
    try:
        outs = []
        for r in range(2):
            for i, doc in enumerate(docs):
                question = [10 + r, 11 + i, 12]
                outs.append(engine.generate(input_ids=[doc + question], sampling_params=GREEDY)[0])
        stats = engine.get_stats()
        host = getattr(engine.scheduler.tree_cache, "host", None)
        assert_engine_clean(engine)
        if host is not None:
            assert host.available_size() == host.size, "host slots leaked"
        return outs, stats
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    ("page_size", "overlap"), [(1, "off"), (16, "process"), (4, "thread"), (1, "process")]
)
def test_evicted_documents_come_back_from_host_memory(page_size: int, overlap: str) -> None:
    path = model_path("llama")
    kw = dict(page_size=page_size, **OVERLAP[overlap])
    plain, _ = rounds(path, hicache=False, **kw)
    hier, stats = rounds(path, hicache=True, **kw)
    assert [o["output_ids"] for o in hier] == [o["output_ids"] for o in plain]
    second = [o["meta_info"]["cached_tokens"] for o in hier[6:]]
    # every document of the second round was served from the cache (host memory), the
    # page-aligned part of it
    assert min(second) >= DOC_LEN - page_size, second
    assert sum(o["meta_info"]["cached_tokens"] for o in plain[6:]) < DOC_LEN  # evicted
    assert stats["hicache_host_hit_tokens"] >= 5 * (DOC_LEN - page_size)
    assert stats["hicache_loaded_tokens"] == stats["hicache_host_hit_tokens"]


def test_shared_prefix_loaded_once_for_a_batch() -> None:
    """Requests admitted together that share a prefix in host memory: the first loads it,
    the others share what it loaded."""
    path = model_path("llama")
    docs = documents(4, seed=1)
    engine = Engine(
        model_path=path,
        max_total_tokens=640,
        enable_hierarchical_cache=True,
        disable_overlap_schedule=True,
    )
    try:
        engine.generate(input_ids=[docs[0] + [9]], sampling_params=GREEDY)
        engine.generate(input_ids=[d + [9] for d in docs[1:]], sampling_params=GREEDY)
        assert engine.scheduler.tree_cache.match(docs[0]).host_len > 0  # evicted to host
        before = engine.get_stats()["hicache_loaded_tokens"]
        outs = engine.generate(input_ids=[docs[0] + [20 + i] for i in range(3)],
                               sampling_params=GREEDY)  # fmt: skip
        loaded = engine.get_stats()["hicache_loaded_tokens"] - before
        assert loaded == DOC_LEN
        assert all(o["meta_info"]["cached_tokens"] >= DOC_LEN for o in outs)
        assert_engine_clean(engine)
    finally:
        engine.shutdown()


def test_flags_are_checked() -> None:
    path = model_path("llama")
    with pytest.raises(ValueError, match="hicache_ratio must be > 1"):
        Engine(model_path=path, enable_hierarchical_cache=True, hicache_ratio=1.0)
    with pytest.raises(ValueError, match="disable_radix_cache"):
        Engine(model_path=path, enable_hierarchical_cache=True, disable_radix_cache=True)
    with pytest.raises(ValueError, match="hicache_write_policy"):
        Engine(model_path=path, enable_hierarchical_cache=True, hicache_write_policy="never")
    with pytest.raises(ValueError, match="hybrid_swa_memory"):
        Engine(model_path=model_path("gemma3_text"), enable_hierarchical_cache=True,
               hybrid_swa_memory=True, disable_overlap_schedule=True)  # fmt: skip


def test_host_pool_figures_reach_metrics_through_the_heartbeat() -> None:
    from services.router_metrics import RouterMetrics
    from services.worker_load import LoadReporter, WorkerFacts, load_figures
    from tests.unit.test_router_workers_metrics import _samples

    docs = documents(4, seed=2)
    engine = Engine(model_path=model_path("llama"), max_total_tokens=640,
                    enable_hierarchical_cache=True, disable_overlap_schedule=True)  # fmt: skip
    try:
        for doc in docs + docs[:1]:  # the first document comes back from host memory
            engine.generate(input_ids=[doc + [9]], sampling_params=GREEDY)
        s = engine.scheduler
        reporter = LoadReporter(WorkerFacts.of(s, "w0", "tiny"))
        reporter.figures = load_figures(s)
        beat = reporter.payload()
    finally:
        engine.shutdown()
    assert beat.host_cache_tokens == 2 * 640
    assert 0 < beat.host_cache_used_tokens <= beat.host_cache_tokens
    assert beat.host_cache_hit_tokens == DOC_LEN
    samples = _samples(RouterMetrics("tiny").render({"w0": beat}))
    worker = '{model_name="tiny",worker_id="w0"}'
    assert samples[f"sluice:hicache_host_total_tokens{worker}"] == 1280
    assert samples[f"sglang:hicache_host_hit_tokens{worker}"] == DOC_LEN

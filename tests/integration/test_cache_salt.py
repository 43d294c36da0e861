"""vLLM's `cache_salt` (SGLang's `extra_key`): a request reuses cached prefixes only of
requests with the same salt, so a tenant cannot learn from a fast first token that another
sent the same prompt; the outputs do not change. Checked over the prefix cache's variants
(page sizes, the overlap loop, host memory behind the cache) and in one batch."""

from __future__ import annotations

import pytest

from engine.engine import Engine
from engine.mem_cache.base import cache_namespace
from tests.factories import assert_engine_clean, mixed_prompts, model_path

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
PROMPT = mixed_prompts(500, n=1, max_len=80, seed=5)[0] + list(range(100, 160))


def test_namespaces_of_salts_and_adapters_differ() -> None:
    spaces = [cache_namespace(lora, salt) for lora in (0, 1, 7)
              for salt in (None, "a", "b", "ab", "\ud800")]  # fmt: skip
    assert len(set(spaces)) == len(spaces)
    assert [cache_namespace(lora) for lora in (0, 1, 7)] == [0, 1, 7]  # unsalted: as before
    assert cache_namespace(2, "a") == cache_namespace(2, "a")
    assert min(cache_namespace(0, s) for s in ("a", "b", "")) >= 1 << 160  # never an adapter's


@pytest.mark.parametrize(
    ("page_size", "kw"),
    [
        (1, {"disable_overlap_schedule": True}),
        (16, {}),
        (4, {"enable_hierarchical_cache": True, "hicache_ratio": 4.0}),
    ],
    ids=["page1-plain", "page16-overlap", "page4-hicache"],
)
def test_prefix_cache_is_per_salt(page_size: int, kw: dict) -> None:
    engine = Engine(model_path=model_path("llama"), page_size=page_size, max_total_tokens=1024,
                    **kw)  # fmt: skip
    try:
        outs, cached = [], []
        for salt in ("tenant-a", "tenant-b", None, "tenant-a", "tenant-b", None):
            out = engine.generate(input_ids=PROMPT, sampling_params=GREEDY, extra_key=salt)
            outs.append(out["output_ids"])
            cached.append(out["meta_info"]["cached_tokens"])
        assert cached[:3] == [0, 0, 0], cached  # nothing shared across salts or with none
        whole = (len(PROMPT) - 1) // page_size * page_size
        assert min(cached[3:]) >= whole, cached  # each salt's own run is reused
        assert all(o == outs[0] for o in outs), outs
        assert_engine_clean(engine)
    finally:
        engine.shutdown()


def test_one_batch_shares_only_within_a_salt() -> None:
    engine = Engine(model_path=model_path("llama"), max_total_tokens=1024)
    try:
        engine.generate(input_ids=PROMPT, sampling_params=GREEDY, extra_key="warm")
        salts = ["warm", "cold", None, "warm"]
        outs = engine.generate(input_ids=[PROMPT] * 4, sampling_params=GREEDY, extra_key=salts)
        cached = [o["meta_info"]["cached_tokens"] for o in outs]
        assert cached[0] >= len(PROMPT) - 1 and cached[3] >= len(PROMPT) - 1, cached
        assert cached[1] == cached[2] == 0, cached
        assert all(o["output_ids"] == outs[0]["output_ids"] for o in outs)
        assert_engine_clean(engine)
    finally:
        engine.shutdown()


def test_bad_salts_are_clear_errors() -> None:
    engine = Engine(model_path=model_path("llama"), max_total_tokens=1024,
                    disable_overlap_schedule=True)  # fmt: skip
    try:
        with pytest.raises(ValueError, match="cache_salt: must be a non-empty string"):
            engine.generate(input_ids=PROMPT, sampling_params=GREEDY, extra_key="")
        with pytest.raises(ValueError, match="extra_key: 2 given for 1 prompts"):
            engine.generate(input_ids=[PROMPT], sampling_params=GREEDY, extra_key=["a", "b"])
    finally:
        engine.shutdown()

"""Mixed chunk on a real (tiny) model: the overlap loop against the plain loop with mixed
batches (placeholders as a mixed batch's decode inputs, requests that finish or are retracted
while a mixed batch is in flight), and mixed against unmixed batches (a decode token computed
as a one-token extend gives the same greedy tokens)."""

from __future__ import annotations

import pytest

from tests.integration.test_overlap import _params, _prompt, _stress, drive


@pytest.mark.parametrize("config", ["tiny_pool", "paged_chunked"])
def test_stress_mixed_chunk_overlap_matches_plain(config: str) -> None:
    _stress(config, 1, enable_mixed_chunk=True)


@pytest.mark.parametrize("page_size", [1, 4])
def test_mixed_batches_give_the_unmixed_greedy_tokens(page_size: int) -> None:
    greedy = {"temperature": 0.0, "ignore_eos": True}
    arrivals = {
        step: [(f"r{step}", _prompt(step, 5 + 7 * step), _params(max_new_tokens=30, **greedy))]
        for step in range(0, 24, 3)
    }
    kw = {"chunked_prefill_size": 24, "page_size": page_size}
    mixed = drive(arrivals, {}, False, enable_mixed_chunk=True, **kw)
    plain = drive(arrivals, {}, False, **kw)
    assert mixed.stats["mixed_steps"] >= 8 and plain.stats["mixed_steps"] == 0
    assert mixed.tokens == plain.tokens
    assert all(len(t) == 30 for t in plain.tokens.values())

"""FutureMap: slot allocation (contiguous, never slot 0, wrap-around without overlap between
nearby batches), store and on-device resolution of placeholders."""

from __future__ import annotations

import random

import pytest
import torch

from engine.overlap.future_map import LIMIT_BATCHES, FutureMap


def test_placeholders_are_negative_slot_ids() -> None:
    fm = FutureMap(max_bs=4)
    a = fm.alloc_future_indices(3)
    b = fm.alloc_future_indices(2)
    assert a.placeholders() == [-1, -2, -3]
    assert b.placeholders() == [-4, -5]


def test_batch_size_is_checked() -> None:
    fm = FutureMap(max_bs=4)
    for bs in (0, 5):
        with pytest.raises(ValueError):
            fm.alloc_future_indices(bs)


@pytest.mark.parametrize("seed", range(5))
def test_wrap_around_keeps_nearby_batches_apart(seed: int) -> None:
    """Any LIMIT_BATCHES consecutive batches own pairwise disjoint slots, every slot lies in
    1 .. len(buffer) - 1, and a batch's slots are contiguous even across the wrap."""
    rng = random.Random(seed)
    max_bs = rng.randint(1, 9)
    fm = FutureMap(max_bs)
    recent: list[set[int]] = []
    for _ in range(500):
        slots = fm.alloc_future_indices(rng.randint(1, max_bs))
        ids = set(range(slots.start, slots.start + slots.size))
        assert min(ids) >= 1 and max(ids) < fm.token_ids.numel()
        for other in recent:
            assert not ids & other
        recent = (recent + [ids])[-(LIMIT_BATCHES - 1) :]
    assert fm.num_wraps > 10


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_store_then_resolve_across_wraps(device: str) -> None:
    """Simulates the loop: batch N's tokens are stored, then batch N+1's input ids (a mix of
    placeholders of N and known tokens) are resolved on the device."""
    rng = random.Random(0)
    fm = FutureMap(max_bs=5, device=device)
    prev_slots, prev_tokens = None, None
    for _ in range(200):
        bs = rng.randint(1, 5)
        slots = fm.alloc_future_indices(bs)
        tokens = torch.tensor([rng.randrange(0, 1000) for _ in range(bs)], device=device)
        if prev_slots is not None:
            placeholders = prev_slots.placeholders()
            rows = [rng.randrange(prev_slots.size) for _ in range(bs)]
            known = [rng.random() < 0.3 for _ in range(bs)]
            inputs = [rng.randrange(0, 1000) if k else placeholders[r] for r, k in zip(rows, known)]
            want = [x if k else int(prev_tokens[r]) for x, r, k in zip(inputs, rows, known)]
            ids = torch.tensor(inputs, dtype=torch.int64, device=device)
            assert fm.resolve_future(ids) is ids
            assert ids.tolist() == want
        fm.store_to_map(slots, tokens)
        prev_slots, prev_tokens = slots, tokens
    assert fm.num_wraps > 0


def test_resolve_leaves_real_tokens_alone() -> None:
    fm = FutureMap(max_bs=2)
    ids = torch.tensor([0, 7, 1999], dtype=torch.int64)
    assert fm.resolve_future(ids).tolist() == [0, 7, 1999]

"""A flattened bucket (SGLang's load_format "flattened_bucket": each tensor's bytes in turn,
one uint8 tensor; engine/weight_groups.py) comes apart into the tensors sent, whatever their
dtypes, including offsets that do not suit a dtype; a buffer of the wrong size is refused;
dtype names as trainers write them."""

from __future__ import annotations

import pytest
import torch

from engine.weight_groups import unflatten, weight_dtype


def test_a_flattened_bucket_of_mixed_dtypes_comes_apart() -> None:
    sent = [
        ("a", torch.randn(3)),
        ("b", torch.randn(3, dtype=torch.float64).to(torch.bfloat16)),  # 6 bytes: misaligns
        ("c", torch.randn(2, 2)),
        ("d", torch.tensor([True, False, True])),
        ("e", torch.tensor([7, -1], dtype=torch.int64)),
        ("f", torch.empty(0, 4)),
    ]
    flat = torch.cat([t.flatten().view(torch.uint8) for _, t in sent])
    got = unflatten(flat, [n for n, _ in sent], [t.dtype for _, t in sent],
                    [list(t.shape) for _, t in sent])  # fmt: skip
    assert [n for n, _ in got] == [n for n, _ in sent]
    for (_, want), (_, t) in zip(sent, got):
        assert t.dtype == want.dtype and t.shape == want.shape
        assert torch.equal(t, want)


def test_a_flattened_bucket_of_the_wrong_size_is_refused() -> None:
    flat = torch.zeros(13, dtype=torch.uint8)
    with pytest.raises(ValueError, match="has 13 bytes; the tensors named take 12"):
        unflatten(flat, ["a"], [torch.float32], [[3]])


def test_dtype_names() -> None:
    assert weight_dtype("bfloat16") is weight_dtype("torch.bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="'float4' is not a weight dtype"):
        weight_dtype("float4")

"""An encoder's attention (engine/models/bert.py): each request's tokens attend to all of
that request's tokens and to no other request's, whether run one request at a time (the
CPU's way) or as one padded batch (the GPU's), against a dense block-diagonal reference."""

from __future__ import annotations

import math

import pytest
import torch

from engine.models.bert import attend_each, attend_padded

HEADS, HEAD_DIM = 4, 8


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int]) -> torch.Tensor:
    owner = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    allowed = owner[:, None] == owner[None, :]
    qh, kh, vh = (x.view(-1, HEADS, HEAD_DIM).transpose(0, 1) for x in (q, k, v))
    scores = qh @ kh.transpose(1, 2) / math.sqrt(HEAD_DIM)
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return (probs @ vh).transpose(0, 1).reshape(q.shape)


@pytest.mark.parametrize("lens", [[5], [3, 9, 1, 6], [7, 7]])
@pytest.mark.parametrize("attend", [attend_each, attend_padded])
def test_each_request_attends_to_its_own_tokens_both_ways(lens: list[int], attend) -> None:
    gen = torch.Generator().manual_seed(sum(lens))
    q, k, v = (torch.randn(sum(lens), HEADS * HEAD_DIM, generator=gen, dtype=torch.float64)
               for _ in range(3))  # fmt: skip
    got = attend(q, k, v, lens, HEADS)
    assert got.shape == q.shape
    torch.testing.assert_close(got, reference(q, k, v, lens), rtol=1e-10, atol=1e-10)
    # a later token changes an earlier one's output (not causal)
    k2 = k.clone()
    k2[lens[0] - 1] += 1.0
    changed = attend(q, k2, v, lens, HEADS)
    if lens[0] > 1:
        assert not torch.allclose(changed[0], got[0])
    torch.testing.assert_close(changed[lens[0]:], got[lens[0]:])  # (other requests: unchanged)

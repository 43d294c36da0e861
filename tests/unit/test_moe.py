"""The mixture-of-experts layer against a token-by-token reference, and its weight loading.

Whole-model parity with transformers for Mixtral, Qwen2-MoE and Qwen3-MoE is in test_models.py
(float64 and float32) and tests/integration/test_parity.py (the engine's greedy outputs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.layers.moe import ExpertWeights, SparseMoeBlock, fused_experts, select_experts
from engine.loader import load_named_weights


def _reference(x, w13, w2, topk_weights, topk_ids):
    """Each token's chosen experts, one by one, in float64."""
    out = torch.zeros_like(x, dtype=torch.float64)
    for t in range(x.shape[0]):
        for weight, expert in zip(topk_weights[t].tolist(), topk_ids[t].tolist(), strict=True):
            gate, up = (w13[expert].double() @ x[t].double()).chunk(2)
            out[t] += weight * (w2[expert].double() @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 4, 2), (7, 8, 3), (33, 16, 1)])
def test_fused_experts_equals_each_tokens_experts(num_tokens, num_experts, top_k):
    g = torch.Generator().manual_seed(num_tokens)
    hidden, inter = 24, 20
    x = torch.randn(num_tokens, hidden, generator=g)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.2
    w2 = torch.randn(num_experts, hidden, inter, generator=g) * 0.2
    logits = torch.randn(num_tokens, num_experts, generator=g)
    logits[:, -1] = -1e4  # one expert nobody picks
    topk_weights, topk_ids = select_experts(logits, top_k, renormalize=top_k > 1)
    assert topk_weights.dtype == torch.float32 and not (topk_ids == num_experts - 1).any()
    got = fused_experts(x, w13, w2, topk_weights, topk_ids)
    want = _reference(x, w13, w2, topk_weights, topk_ids)  # float64; got is float32
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)


def test_select_experts_takes_the_top_k_probabilities():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 3.5]])
    probs = torch.softmax(logits, dim=-1)
    weights, ids = select_experts(logits, 2, renormalize=False)
    assert ids.tolist() == [[1, 2], [3, 0]]
    torch.testing.assert_close(weights, probs.gather(1, ids))
    weights, _ = select_experts(logits, 2, renormalize=True)
    torch.testing.assert_close(weights.sum(dim=-1), torch.ones(2))


def test_sparse_block_adds_the_gated_shared_expert():
    torch.manual_seed(0)
    shared = torch.nn.Linear(8, 8, bias=False)
    block = SparseMoeBlock(8, num_experts=4, top_k=2, intermediate_size=6, renormalize=False,
                           shared_expert=shared)  # fmt: skip
    for param in block.parameters():
        torch.nn.init.normal_(param, std=0.3)
    x = torch.randn(5, 8)
    weights, ids = select_experts(block.gate(x), 2, renormalize=False)
    routed = fused_experts(x, block.experts.w13.weight, block.experts.w2.weight, weights, ids)
    want = routed + torch.sigmoid(block.shared_expert_gate(x)) * shared(x)
    torch.testing.assert_close(block(x), want)
    with pytest.raises(ValueError, match="num_experts_per_tok=5"):
        SparseMoeBlock(8, num_experts=4, top_k=5, intermediate_size=6, renormalize=True)


class _Experts(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w13 = ExpertWeights(2, 3, [("gate", 4), ("up", 4)])


def test_expert_shards_load_into_their_rows_and_count_once_all_are_there():
    model = _Experts()
    parts = {(e, s): torch.full((4, 3), float(10 * e + i)) for e in range(2)
             for i, s in enumerate(("gate", "up"))}  # fmt: skip

    def as_shard(name, tensor):
        expert, shard = name.split(".")
        return "w13.weight", tensor, (int(expert), shard)

    some = [(f"{e}.{s}", t) for (e, s), t in parts.items() if (e, s) != (1, "up")]
    assert load_named_weights(model, some, transform=as_shard) == set()  # one shard missing
    loaded = load_named_weights(model, [(f"{e}.{s}", t) for (e, s), t in parts.items()],
                                transform=as_shard)  # fmt: skip
    assert loaded == {"w13.weight"}
    assert model.w13.weight[1, :4].eq(10).all() and model.w13.weight[1, 4:].eq(11).all()
    with pytest.raises(ValueError, match=r"does not match expected \(4, 3\)"):
        load_named_weights(model, [("0.gate", torch.zeros(4, 2))], transform=as_shard)
    with pytest.raises(ValueError, match="no expert shard"):
        load_named_weights(model, [("2.gate", torch.zeros(4, 3))], transform=as_shard)

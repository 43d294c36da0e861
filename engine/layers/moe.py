"""Mixture-of-experts feed-forward: top-k routing and the experts' SwiGLU MLPs.

Every expert's weights are stacked into one tensor, as SGLang's and vLLM's `FusedMoE` hold
them: `w13[e]` is expert e's [gate; up] projection ([2 * inter, hidden]) and `w2[e]` its down
projection ([hidden, inter]). Checkpoints store one matrix per expert
(`experts.{e}.gate_proj.weight`, or Mixtral's `w1` / `w3` / `w2`); the loader sends each into
its rows through `ExpertWeights.load_shard` with shard id `(e, "gate" | "up" | "down")`.

Routing follows transformers: softmax over the router logits in float32, the top k
probabilities, renormalised to sum to 1 where the model says so (`norm_topk_prob`; Mixtral
always). `fused_experts` then computes each token's weighted sum of its experts' outputs:
on CUDA with Triton as two grouped GEMMs (`kernels.fused_moe`, CUDA-graph capturable), else
with `fused_experts_torch`, which runs each chosen expert once over its tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import current_tp


class ExpertWeights(nn.Module):
    """`weight[e]` = expert e's [out, in] matrix, whose output rows are the named shards.

    `split` (tensor parallelism): (dim, start, length, full) — this rank holds `length` of the
    `full` rows (dim 0) or columns (dim 1) of every checkpoint matrix, from `start`.
    `experts` (expert parallelism): (first, total) — `weight[i]` is expert first + i of the
    layer's `total`; the checkpoint's other experts are skipped (`skipped`: the last one was)."""

    def __init__(
        self,
        num_experts: int,
        in_features: int,
        shards: Sequence[tuple[str, int]],
        split: tuple[int, int, int, int] | None = None,
        experts: tuple[int, int] | None = None,
    ):
        super().__init__()
        self.split = split
        self.first, self.total = experts or (0, num_experts)
        self.skipped = False
        self.num_local, self.in_features = num_experts, in_features
        self.shards = list(shards)
        self.out_features = sum(size for _, size in shards)
        self.shard_ranges: dict[tuple[int, str], tuple[int, int]] = {}
        for expert in range(self.first, self.first + num_experts):
            offset = 0
            for name, size in shards:
                self.shard_ranges[(expert, name)] = (offset, size)
                offset += size
        self._init_weights()

    def _init_weights(self) -> None:
        self.weight = nn.Parameter(
            torch.empty(self.num_local, self.out_features, self.in_features)
        )

    def operand(self) -> Any:
        """What `fused_experts` multiplies by: the stacked weight [E, out, in]."""
        return self.weight

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, str]
                   ) -> None:  # fmt: skip
        rows = self._rows(loaded, shard_id)
        if rows is None:
            return
        expert, offset, size = rows
        target = param.data[expert].narrow(0, offset, size)
        loaded = self._part(loaded, shard_id)
        if target.shape != loaded.shape:
            raise ValueError(
                f"expert shard {shard_id!r}: checkpoint shape {tuple(loaded.shape)} does not "
                f"match expected {tuple(target.shape)}"
            )
        target.copy_(loaded)

    def _rows(self, loaded: object, shard_id: tuple[int, str]) -> tuple[int, int, int] | None:
        """(local expert, first row, rows) that shard `shard_id` fills; None for another
        expert group's (expert parallelism: skipped)."""
        self.skipped = False
        if shard_id not in self.shard_ranges:
            if 0 <= shard_id[0] < self.total and (self.first, shard_id[1]) in self.shard_ranges:
                self.skipped = True  # another expert group's
                return None
            raise ValueError(f"no expert shard {shard_id!r} (experts: {self.total})")
        return (shard_id[0] - self.first, *self.shard_ranges[shard_id])

    def _quantized_rows(
        self, loaded: Any, kind: type, shard_id: tuple[int, str]
    ) -> tuple[int, int, int] | None:
        """`_rows` of a quantized checkpoint matrix (a `kind`: what quantized experts take);
        ValueError for a plain tensor."""
        if not isinstance(loaded, kind):
            raise ValueError(f"expert shard {shard_id!r}: the checkpoint's weight is not "
                             f"quantized (a {loaded.dtype} tensor) but the config says it "
                             "is")  # fmt: skip
        return self._rows(loaded, shard_id)

    def _part(self, loaded: Any, shard_id: tuple[int, str]) -> Any:
        """This rank's rows or columns of a checkpoint matrix (tensor parallelism)."""
        if self.split is None:
            return loaded
        dim, start, length, full = self.split
        if len(loaded.shape) != 2 or loaded.shape[dim] != full:
            raise ValueError(f"expert shard {shard_id!r}: checkpoint shape "
                             f"{tuple(loaded.shape)} has not {full} in dim {dim}")  # fmt: skip
        return loaded.narrow(dim, start, length)


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k] int64) of each token's top-k experts."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_experts(
    x: torch.Tensor,
    w13: Any,
    w2: Any,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) for every token t. w13 / w2:
    [E, N, K] tensors, or integer or float8 experts (`engine.layers.int_experts.IntExperts`,
    `engine.layers.fp8_experts.Fp8Experts`)."""
    impl = _cuda_experts() if x.is_cuda else fused_experts_torch
    if x.is_cuda and not isinstance(w13, torch.Tensor) and any(
        (w.group % 16 and getattr(w, "gidx", None) is None) or getattr(w, "offset", 0) % 16
        for w in (w13, w2)
    ):  # fmt: skip
        # (the kernels' K steps divide a group, and a float8 part's offset into its first
        # one: other groups run on every expert dequantized, which keeps the layer capturable
        # in a CUDA graph)
        w13, w2 = w13.dequantized(), w2.dequantized()
    return impl(x, w13, w2, topk_weights, topk_ids)


@functools.cache
def _cuda_experts() -> Callable[..., torch.Tensor]:
    """The Triton kernels (torch without Triton), looked up once, not on every layer's call."""
    from kernels.jit import HAS_TRITON

    if not HAS_TRITON:
        return fused_experts_torch
    from kernels.fused_moe import fused_experts_triton

    return fused_experts_triton


def fused_experts_torch(
    x: torch.Tensor,
    w13: Any,
    w2: Any,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """`fused_experts` in torch (the reference of the Triton kernels).

    The (token, choice) pairs are sorted by expert, so each expert that any token chose runs
    one matmul pair over its tokens. The experts' token counts are read on the host (one sync
    per layer), so this path is not CUDA-graph capturable. (Integer experts: each expert that
    runs is dequantized, `w13[expert]`; float8 ones too.)
    """
    num_experts = w13.shape[0]
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    tokens = order // top_k
    weights = topk_weights.reshape(-1)[order].to(x.dtype).unsqueeze(1)
    # (an id of num_experts: a choice of an expert another rank holds, sorted last, skipped)
    counts = torch.bincount(flat_ids, minlength=num_experts + 1).tolist()[:num_experts]
    # each (token, choice)'s weighted output, in expert order, then summed per token (no
    # index_add: on the CPU a scatter_add, 10x slower than this over a prefill's tokens)
    pairs = x.new_zeros(len(flat_ids), x.shape[1])
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = tokens[start : start + count]
        gate, up = F.linear(x[rows], w13[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert])
        pairs[start : start + count] = y * weights[start : start + count]
        start += count
    unsorted = pairs.index_select(0, torch.argsort(order))
    return unsorted.view(len(x), top_k, -1).sum(dim=1)


class FusedMoE(nn.Module):
    """The routed experts of one layer: `forward(x, topk_weights, topk_ids)`.

    With tensor parallelism (`current_tp()` while built) every expert is split as a dense MLP
    is (engine/layers/parallel.py): each rank holds its part of every expert's intermediate
    features (w13's rows, w2's columns), every rank computes every token's experts over its
    part, and one all-reduce sums the parts (SGLang's and vLLM's default for MoE models under
    tensor parallelism, without expert parallelism)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.tp = tp = current_tp()
        self.first, local = tp.experts(num_experts)
        start, inter = tp.expert_part(intermediate_size, "expert intermediate features")
        split = inter < intermediate_size
        experts = (self.first, num_experts) if local < num_experts else None
        self.w13 = ExpertWeights(
            local, hidden_size, [("gate", inter), ("up", inter)],
            split=(0, start, inter, intermediate_size) if split else None, experts=experts,
        )  # fmt: skip
        self.w2 = ExpertWeights(local, inter, [("down", hidden_size)],
                                split=(1, start, inter, intermediate_size) if split else None,
                                experts=experts)  # fmt: skip

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        local = self.w13.num_local
        if local < self.num_experts:  # expert parallelism: this rank's experts' share only
            ids = topk_ids - self.first
            mine = (ids >= 0) & (ids < local)
            if x.is_cuda:  # (the kernels take no "none" id: a zero weight on expert 0)
                topk_ids, topk_weights = torch.where(mine, ids, 0), topk_weights * mine
            else:
                topk_ids = torch.where(mine, ids, local)
        out = fused_experts(x, self.w13.operand(), self.w2.operand(), topk_weights, topk_ids)
        return self.tp.all_reduce(out)


class SparseMoeBlock(nn.Module):
    """Router (`gate`, no bias) + routed experts, plus Qwen2-MoE's sigmoid-gated shared expert
    when `shared_expert` is given."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        renormalize: bool,
        shared_expert: nn.Module | None = None,
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, {num_experts}]")
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size)
        self.shared_expert = shared_expert
        if shared_expert is not None:
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        out = self.experts(x, topk_weights, topk_ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

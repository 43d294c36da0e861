"""Tensor-parallel layers (Megatron-LM's split, as SGLang and vLLM make it).

Each rank of a group of `tp.size` holds:
* column-parallel projections (q/k/v, gate/up): its own rows of each output — its attention
  heads, its part of the MLP's intermediate features — as a `MergedLinear` whose `sources`
  name the rows of each checkpoint tensor it takes (`column_sources`). No communication:
  each rank attends with its own heads and activates its own features;
* row-parallel projections (o_proj, down_proj: `RowParallelLinear`): the matching columns of
  the weight, so each rank's product is a partial sum of the output; one all-reduce adds
  them, then the bias (once);
* the vocabulary in equal parts (`VocabParallelEmbedding`, and the lm_head's rows): an
  embedding row is looked up by the rank that holds it, zeros elsewhere, then all-reduced;
  the logits of each rank's part are all-gathered (`gather_vocab`, the logits processor).

K/V heads: with fewer K/V heads than ranks (Llama-3-70B's 8 on 16 GPUs), each K/V head is
held by `size / num_kv_heads` ranks, whose query heads are its group (SGLang and vLLM
replicate them the same way). Every rank's KV cache holds only its heads.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import TensorParallel
from engine.layers.linear import shard_ranges


def kv_heads_per_rank(num_kv_heads: int, tp: TensorParallel) -> tuple[int, int]:
    """(first K/V head, K/V heads) of this rank: an equal part, or the one head its query heads
    share when there are fewer heads than ranks."""
    if num_kv_heads >= tp.size:
        return tp.shard(num_kv_heads, "key/value heads")
    if tp.size % num_kv_heads:
        raise ValueError(
            f"tensor parallelism: {num_kv_heads} key/value heads do not split over {tp.size} "
            "ranks (the ranks must be a multiple of the heads, or divide them)"
        )
    return tp.rank * num_kv_heads // tp.size, 1


class RowParallelLinear(nn.Linear):
    """y = all_reduce(x_r @ W_r.T) + b, where x_r is this rank's part of the input features
    and W_r the matching columns of the checkpoint's weight; the bias is whole on every rank."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel) -> None:
        self.tp = tp
        self.in_start, in_part = tp.shard(in_features)
        self.full_in = in_features
        super().__init__(in_part, out_features, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias

    def load_weight(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if param is self.weight:
            expected = (self.out_features, self.full_in)
            if tuple(loaded.shape) != expected:
                raise ValueError(f"checkpoint shape {tuple(loaded.shape)} is not {expected}")
            loaded = loaded.narrow(1, self.in_start, self.in_features)
        elif loaded.shape != param.shape:
            raise ValueError(f"checkpoint shape {tuple(loaded.shape)} is not {tuple(param.shape)}")
        param.data.copy_(loaded)


class QuantizedLinearBase(nn.Module):
    """What the quantized linear layers (`Fp8Linear`, `IntWeightLinear`) share: their output
    rows in shards as `MergedLinear`'s (the stacked q/k/v and gate/up; one block otherwise),
    the bias, and the part of a split layer they replace (`take_split`)."""

    sources: dict[Hashable, tuple[int, int, int]] | None = None
    column_part: tuple[int, int, int] | None = None
    tp: TensorParallel | None = None

    def _init_outputs(
        self, out_features: int, bias: bool, shards: Sequence[tuple[Hashable, int]] | None
    ) -> None:
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.shard_ranges = shard_ranges(shards or [(None, out_features)])
        self.output_sizes = [size for _, size in self.shard_ranges.values()]
        self.merged = shards is not None

    def _rank_part(self, loaded: Any, shard_id: Hashable, weight: bool) -> tuple[int, int, Any]:
        """(first row, rows, the checkpoint tensor's part) that shard `shard_id` of the weight
        (or of the bias) fills: of a split layer, this rank's rows or columns. ValueError
        where the shapes do not fit."""
        offset, size = self.shard_ranges[shard_id if self.merged else None]
        if self.sources and shard_id in self.sources:
            start, rows, total = self.sources[shard_id]
            if loaded.shape[0] != total:
                raise ValueError(f"shard {shard_id!r}: checkpoint shape {tuple(loaded.shape)} "
                                 f"has not {total} rows")  # fmt: skip
            loaded = loaded.narrow(0, start, rows)
        if self.column_part is not None and weight:
            start, length, full = self.column_part
            if loaded.shape[1] != full:
                raise ValueError(f"checkpoint shape {tuple(loaded.shape)} has not {full} columns")
            loaded = loaded.narrow(1, start, length)
        if loaded.shape[0] != size or (weight and loaded.shape[1] != self.in_features):
            expected = (size, self.in_features) if weight else (size,)
            raise ValueError(f"shard {shard_id!r}: checkpoint shape {tuple(loaded.shape)} does "
                             f"not match expected {expected}")  # fmt: skip
        return offset, size, loaded


def take_split(layer: nn.Module, linear: nn.Module) -> None:
    """A quantized layer replacing `linear` takes its part of a split layer: a column-parallel
    layer's `sources` (the rows of each checkpoint shard this rank holds), or a row-parallel
    one's `column_part` (its columns of the input) and the group whose all-reduce sums the
    ranks' outputs before the bias (`tp`)."""
    layer.sources = getattr(linear, "sources", None) or None
    if isinstance(linear, RowParallelLinear):
        layer.column_part = (linear.in_start, linear.in_features, linear.full_in)
        layer.tp = linear.tp


def vocab_part(vocab_size: int, tp: TensorParallel) -> tuple[int, int]:
    """(first token id, rows) of this rank's part of the vocabulary: ceil(V / size) rows each,
    the last rank's padded with zero rows past the vocabulary."""
    part = -(-vocab_size // tp.size)
    return tp.rank * part, part


class VocabParallelEmbedding(nn.Embedding):
    """The embedding rows of this rank's part of the vocabulary (`vocab_part`)."""

    def __init__(self, vocab_size: int, hidden: int, tp: TensorParallel) -> None:
        self.tp = tp
        self.full_vocab = vocab_size
        self.vocab_start, part = vocab_part(vocab_size, tp)
        super().__init__(part, hidden)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(input_ids)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.num_embeddings)
        out = F.embedding(torch.where(mine, local, 0), self.weight)
        out.masked_fill_(~mine.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)

    def load_weight(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        load_vocab_rows(param, loaded, self.full_vocab, self.vocab_start)


class ParallelLMHead(nn.Module):
    """The lm_head rows of this rank's part of the vocabulary (the logits processor gathers
    every rank's logits: `gather_vocab`)."""

    def __init__(self, vocab_size: int, hidden: int, tp: TensorParallel) -> None:
        super().__init__()
        self.full_vocab = vocab_size
        self.vocab_start, part = vocab_part(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(part, hidden))

    def load_weight(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        load_vocab_rows(param, loaded, self.full_vocab, self.vocab_start)


def load_vocab_rows(param: nn.Parameter, loaded: torch.Tensor, vocab: int, start: int) -> None:
    """This rank's rows of a [vocab, hidden] checkpoint tensor; rows past the vocabulary 0."""
    part, hidden = param.shape
    if tuple(loaded.shape) != (vocab, hidden):
        raise ValueError(f"checkpoint shape {tuple(loaded.shape)} is not {(vocab, hidden)}")
    rows = max(0, min(part, vocab - start))
    param.data[:rows].copy_(loaded[start:start + rows])
    param.data[rows:].zero_()


def gather_vocab(logits: torch.Tensor, vocab_size: int, tp: TensorParallel) -> torch.Tensor:
    """Each rank's logits over its part of the vocabulary -> every token's, [N, vocab]."""
    if tp.size == 1:
        return logits
    return tp.all_gather_columns(logits)[:, :vocab_size]

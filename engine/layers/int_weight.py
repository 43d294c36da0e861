"""`IntWeightLinear`: a linear layer whose weight is 4- or 8-bit integers with a scale per
group of input columns (and, asymmetric, a zero point per group), activations in the model's
dtype: weight-only quantization (W4A16 / W8A16), as compressed-tensors' "pack-quantized"
checkpoints store it (llm-compressor's W4A16 and W8A16 schemes; vLLM's and SGLang's
`compressed-tensors` method). The layout is `kernels.int_gemm`'s.

The weight stays packed (a quarter of bf16's bytes at 4 bits, plus the scales). The matmul:
on CUDA the Triton kernel (`kernels.int_gemm.int_gemm`), which expands each tile of the
weight in registers; elsewhere the weight is dequantized (float32, then the input's dtype)
and multiplied, which is what the kernel computes up to summation order.

GPTQ's activation ordering (`desc_act`): each column's group is in a g_idx. On one rank (and
in column-parallel layers) the columns are sorted by group as they load and the input is
permuted alike (`input_perm`). A row-parallel rank's part holds columns of every group, so
it keeps them in the input's order with each column's group (`weight_gidx`) and all of the
weight's scales; the kernels then gather a scale per column.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.parallel import QuantizedLinearBase, RowParallelLinear, take_split
from kernels.int_gemm import (
    dequantize_int,
    int_gemm,
    int_gemm_reference,
    pack_int,
    unpack_int,
)
from kernels.jit import HAS_TRITON, cdiv, interpreting


@dataclass
class PackedIntWeight:
    """A checkpoint's packed integer weight: `packed` [N, ceil(K * bits / 32)] int32, `scale`
    [N, K / group], `zero` [N, K / group] int8 (asymmetric; None: symmetric), K `columns`;
    with activation ordering (GPTQ's `desc_act`), `perm` [K]: column j of the packed weight
    is the input's column perm[j] (its columns sorted by group, so groups are contiguous).
    A part of its columns (`narrow`: a row-parallel rank's) is in the input's order instead,
    each column's group in `gidx` [K] int32, the scales and zero points all of the weight's
    groups."""

    packed: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    bits: int
    group: int
    columns: int
    perm: torch.Tensor | None = None
    gidx: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.packed.shape[0], self.columns))

    def __getitem__(self, rows: slice | torch.Tensor) -> PackedIntWeight:
        """Some of its rows (a slice or an index tensor): the rows' words, scales, zeros."""
        return replace(self, packed=self.packed[rows], scale=self.scale[rows],
                       zero=None if self.zero is None else self.zero[rows])  # fmt: skip

    def narrow(self, dim: int, start: int, length: int) -> PackedIntWeight:
        """Rows (dim 0), or columns (dim 1: whole groups; with activation ordering any
        columns, in the input's order with each one's group, `gidx`) of it."""
        if dim == 0:
            return self[start : start + length]
        per_word = 32 // self.bits
        end = start + length
        if self.perm is not None:  # (its columns back in the input's order, each its group)
            ints = unpack_int(self.packed, self.bits, self.columns)
            ints = torch.empty_like(ints).index_copy_(1, self.perm, ints)[:, start:end]
            place = torch.empty_like(self.perm).index_copy_(
                0, self.perm, torch.arange(self.columns, device=self.perm.device)
            )  # (where each input column sits in the sorted order)
            return replace(self, packed=pack_int(F.pad(ints, (0, -length % per_word)), self.bits),
                           columns=length, perm=None,
                           gidx=(place[start:end] // self.group).to(torch.int32))  # fmt: skip
        if start % per_word:  # (a part that starts inside a word: its integers repacked)
            ints = unpack_int(self.packed, self.bits, self.columns)[:, start:end]
            words = pack_int(F.pad(ints, (0, -length % per_word)), self.bits)
        else:
            words = self.packed[:, start // per_word : cdiv(end, per_word)]
        if self.group >= self.columns:  # (per channel: a row's scale holds for any part of it)
            return replace(self, packed=words, group=length, columns=length)
        if start % self.group or not (length % self.group == 0 or end == self.columns):
            raise ValueError(f"columns {start}..{end} are not whole {self.group}-column groups "
                             "of the quantized weight")  # fmt: skip
        g0, g1 = start // self.group, cdiv(end, self.group)
        return replace(
            self, packed=words, scale=self.scale[:, g0:g1],
            zero=None if self.zero is None else self.zero[:, g0:g1], columns=length,
        )  # fmt: skip

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The float weight [N, K], its columns in the input's order."""
        w = dequantize_int(self.packed, self.scale, self.zero, self.bits, self.group,
                           self.columns, dtype, self.gidx)  # fmt: skip
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out


def check_whole_groups(start: int, length: int, group: int | None, what: str) -> None:
    """ValueError unless this rank's columns `start` .. `start + length` of `what` are whole
    `group`-column quantization groups (tensor parallelism; None: per channel, any part)."""
    if group is not None and (start % group or length % group):
        raise ValueError(
            f"tensor parallelism: this rank's {length} input columns of {what} are not whole "
            f"{group}-column quantization groups; choose a tp_size whose parts are"
        )


def unpack_zero_points(packed: torch.Tensor, bits: int, rows: int) -> torch.Tensor:
    """compressed-tensors' zero points, packed along the output rows ([ceil(rows * bits / 32),
    groups] int32), as [rows, groups] int8 (signed, as the weight's integers)."""
    u = unpack_int(packed.t().contiguous(), bits, rows).t()
    return (u - (1 << (bits - 1))).to(torch.int8).contiguous()


class IntWeightLinear(QuantizedLinearBase):
    """y = x @ dequant(weight).T + bias; `shards` as `MergedLinear`'s (the stacked q/k/v and
    gate/up), else one output block. `weight` is the packed int32 words (a parameter, so the
    loader fills and checks it like any weight); `weight_scale` and `weight_zero` are
    buffers."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        bits: int,
        group: int | None,
        symmetric: bool,
        shards: Sequence[tuple[Hashable, int]] | None = None,
        scale_dtype: torch.dtype | None = None,
        act_order: bool = False,
        full_in: int | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bits = bits
        # activation ordering on a part of the weight's `full_in` columns (a row-parallel
        # rank's): its columns in the input's order, each of any group of the whole weight's
        part_order = act_order and full_in is not None
        columns = full_in if part_order else in_features
        self.group = columns if group is None else int(group)
        if columns % self.group:
            raise ValueError(f"{columns} input features are not whole {self.group}-column "
                             "quantization groups")  # fmt: skip
        groups = columns // self.group
        words = cdiv(in_features * bits, 32)
        self.weight = nn.Parameter(
            torch.empty(out_features, words, dtype=torch.int32), requires_grad=False
        )
        self.register_buffer("weight_scale", torch.empty(out_features, groups, dtype=scale_dtype))
        zero = None if symmetric else torch.empty(out_features, groups, dtype=torch.int8)
        self.register_buffer("weight_zero", zero)
        # activation ordering: the input's columns in the packed weight's order; on a part of
        # the columns, each column's group instead (`PackedIntWeight.gidx`)
        perm = torch.arange(in_features, dtype=torch.int32) if act_order else None
        self.register_buffer("input_perm", None if part_order else perm)
        gidx = torch.zeros(in_features, dtype=torch.int32) if part_order else None
        self.register_buffer("weight_gidx", gidx)
        self._shard_perms: dict[Hashable, torch.Tensor] = {}  # each part's, as loaded
        self._init_outputs(out_features, bias, shards)

    @classmethod
    def like(
        cls, linear: nn.Linear, bits: int, group: int | None, symmetric: bool,
        act_order: bool = False,
    ) -> IntWeightLinear:
        """An empty layer of `linear`'s shape (and shards, and part of a split layer), on its
        device; its scales in the linear's dtype. A row-parallel part must be whole groups,
        but with activation ordering (GPTQ's desc_act: each rank's columns belong to groups
        spread over all ranks, so it keeps every group's scales and each column's group)."""
        shards = getattr(linear, "shard_ranges", None)
        part = isinstance(linear, RowParallelLinear) and linear.in_features != linear.full_in
        if isinstance(linear, RowParallelLinear) and not act_order:
            check_whole_groups(linear.in_start, linear.in_features, group, "a row-parallel layer")
        with torch.device(linear.weight.device):
            layer = cls(
                linear.in_features, linear.out_features, linear.bias is not None, bits, group,
                symmetric, [(s, size) for s, (_, size) in shards.items()] if shards else None,
                scale_dtype=linear.weight.dtype, act_order=act_order,
                full_in=linear.full_in if act_order and part else None,
            )  # fmt: skip
        take_split(layer, linear)
        return layer

    def extra_repr(self) -> str:
        kind = "symmetric" if self.weight_zero is None else "asymmetric"
        order = ", act_order" if self.input_perm is not None or self.weight_gidx is not None else ""
        return (f"in={self.in_features}, out={self.out_features}, bits={self.bits}, "
                f"group={self.group}, {kind}{order}")  # fmt: skip

    # -- loading ------------------------------------------------------------------------------
    def load_shard(
        self, param: nn.Parameter, loaded: torch.Tensor | PackedIntWeight, shard_id: Hashable
    ) -> None:
        """Fill shard `shard_id`'s rows of the weight (its words, scales and zero points) or of
        the bias from a checkpoint tensor; of a split layer, this rank's rows or columns."""
        weight = param is self.weight
        if weight and not isinstance(loaded, PackedIntWeight):
            raise ValueError(f"shard {shard_id!r}: the checkpoint's weight is not quantized "
                             f"(a {loaded.dtype} tensor) but the config says it is")  # fmt: skip
        offset, size, loaded = self._rank_part(loaded, shard_id, weight)
        if not weight:
            param.data.narrow(0, offset, size).copy_(loaded)
            return
        assert isinstance(loaded, PackedIntWeight)
        if (loaded.bits, loaded.group, loaded.zero is None) != (
            self.bits, self.group, self.weight_zero is None
        ):  # fmt: skip
            raise ValueError(
                f"shard {shard_id!r}: {loaded.bits}-bit groups of {loaded.group} "
                f"({'symmetric' if loaded.zero is None else 'asymmetric'}), the config says "
                f"{self.bits}-bit groups of {self.group}"
            )
        self._load_order(loaded.perm, shard_id)
        if (self.weight_gidx is None) != (loaded.gidx is None):
            raise ValueError(f"shard {shard_id!r}: only a part of a weight with activation "
                             "ordering has, and needs, each column's group")  # fmt: skip
        if self.weight_gidx is not None:
            self.weight_gidx.copy_(loaded.gidx)
        self.weight.data.narrow(0, offset, size).copy_(loaded.packed)
        self.weight_scale.narrow(0, offset, size).copy_(loaded.scale)
        if self.weight_zero is not None:
            self.weight_zero.narrow(0, offset, size).copy_(loaded.zero)

    def _load_order(self, perm: torch.Tensor | None, shard_id: Hashable) -> None:
        """A part's input order (activation ordering): the layer's, which its stacked parts
        share (`finish_loading` checks they do)."""
        if self.input_perm is None:  # (the config's: a checkpoint's g_idx is checked then)
            return
        if perm is None:  # (in order)
            perm = torch.arange(self.in_features, device=self.input_perm.device)
        self._shard_perms[shard_id] = perm
        self.input_perm.copy_(perm)

    def finish_loading(self) -> None:
        """After a load: ValueError unless the stacked parts (q/k/v, gate/up), which read the
        same input, order its columns alike (GPTQ orders them by the input's statistics, the
        same for all of them)."""
        perms = [p for p in self._shard_perms.values() if p.device.type != "meta"]
        if any(not torch.equal(p.to(perms[0].device), perms[0]) for p in perms[1:]):
            raise ValueError("the stacked parts of a layer with activation ordering order its "
                             "input columns differently (their g_idx differ)")  # fmt: skip

    # -- forward ------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if self.input_perm is not None:
            x = x.index_select(1, self.input_perm)
        bias = None if self.tp is not None else self.bias
        args = (self.weight, self.weight_scale, self.weight_zero, self.bits, self.group, bias)
        gidx = self.weight_gidx  # (a row-parallel part with activation ordering)
        whole = self.group % 16 == 0 if gidx is None else self.in_features % (32 // self.bits) == 0
        if x.is_cuda and HAS_TRITON and not interpreting() and whole:
            y = int_gemm(x, *args, gidx=gidx)
        else:
            y = int_gemm_reference(x, *args, gidx=gidx)
        if self.tp is not None:  # (row-parallel: the ranks' partial sums, then the bias)
            y = self.tp.all_reduce(y)
            y = y if self.bias is None else y + self.bias
        return y.view(*shape[:-1], self.out_features)

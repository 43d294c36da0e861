"""Mixture-of-experts weights kept as packed integers (W4A16 / W8A16 experts: a compressed-
tensors, AWQ or GPTQ checkpoint whose experts are quantized, as vLLM and SGLang keep them).

`IntExpertWeights` replaces a `FusedMoE`'s `ExpertWeights` (engine/layers/moe.py): expert e's
[out, in] matrix is `weight[e]`, its packed int32 words in `kernels.int_gemm`'s layout (an
output row's integers packed along K), with `weight_scale[e]` [out, in / group] and, with
zero points, `weight_zero[e]`. The loader sends each expert's `PackedIntWeight` (the
checkpoint's parts, joined and repacked by `engine.checkpoint_parts`) to its rows, as the float
experts get theirs; tensor and expert parallelism split them the same way (a row-parallel
part of the down projection must be whole groups). With GPTQ's activation ordering each
expert's columns are sorted by group as they load (`PackedIntWeight.perm`), and the order is
kept per expert, `input_perm` [E, K] (a dense layer permutes its input once; here each
expert reads the input in its own order, so the kernels gather the columns); a rank's part
of the down projection's columns keeps them in the input's order instead, each column's
group in `weight_gidx` [E, K] (the kernels gather the scales), in any split.

`IntExperts` is what the compute takes: on CUDA the grouped GEMMs of `kernels.fused_moe`
expand each tile of words in registers; elsewhere `fused_experts_torch` dequantizes each
expert it runs (`IntExperts[e]`), which is what the kernels compute up to summation order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from engine.layers.int8 import Int8Weight
from engine.layers.int_weight import PackedIntWeight, check_whole_groups
from engine.layers.moe import ExpertWeights
from kernels.int_gemm import dequantize_int
from kernels.jit import cdiv


@dataclass(frozen=True)
class IntExperts:
    """Every expert's packed weight: `packed` [E, N, ceil(K * bits / 32)] int32, `scale`
    [E, N, K / group], `zero` [E, N, K / group] int8 or None, K `columns`; with activation
    ordering (GPTQ's desc_act), `perm` [E, K] int32: column j of expert e's packed weight is
    the input's column perm[e, j] (each expert's columns sorted by group); or, a row-parallel
    part of such experts (tensor parallelism), the columns in the input's order and `gidx`
    [E, K] int32 each column's group (the scales and zero points of all groups)."""

    packed: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    bits: int
    group: int
    columns: int
    perm: torch.Tensor | None = None
    gidx: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.packed.shape[0], self.packed.shape[1], self.columns)

    def dequantized(self) -> torch.Tensor:
        """Every expert's weight [E, N, K] in the scales' dtype, its columns in the input's
        order."""
        e, n, k = self.shape
        if self.gidx is not None:
            return torch.stack([self[expert] for expert in range(e)])
        zero = None if self.zero is None else self.zero.reshape(e * n, -1)
        w = dequantize_int(self.packed.reshape(e * n, -1), self.scale.reshape(e * n, -1), zero,
                           self.bits, self.group, self.columns, self.scale.dtype)  # fmt: skip
        w = w.view(e, n, k)
        if self.perm is None:
            return w
        columns = self.perm.long().unsqueeze(1).expand(e, n, k)
        return torch.empty_like(w).scatter_(2, columns, w)

    def __getitem__(self, expert: int) -> torch.Tensor:
        """Expert `expert`'s weight [N, K], dequantized in the scales' dtype, its columns in
        the input's order."""
        zero = None if self.zero is None else self.zero[expert]
        gidx = None if self.gidx is None else self.gidx[expert]
        w = dequantize_int(self.packed[expert], self.scale[expert], zero, self.bits,
                           self.group, self.columns, self.scale.dtype, gidx)  # fmt: skip
        if self.perm is None:
            return w
        return torch.empty_like(w).index_copy_(1, self.perm[expert].long(), w)


class IntExpertWeights(ExpertWeights):
    """`ExpertWeights` of `bits`-bit integers with a scale per `group` input columns (None:
    per output channel) and, unless `symmetric`, zero points."""

    def __init__(
        self,
        num_experts: int,
        in_features: int,
        shards: Sequence[tuple[str, int]],
        bits: int,
        group: int | None,
        symmetric: bool,
        scale_dtype: torch.dtype | None = None,
        split: tuple[int, int, int, int] | None = None,
        experts: tuple[int, int] | None = None,
        act_order: bool = False,
    ) -> None:
        self.bits, self.symmetric, self.scale_dtype = bits, symmetric, scale_dtype
        self.act_order = act_order
        # activation ordering on a part of the columns (tensor parallelism's down projection):
        # the columns in the input's order, each of any group of the whole matrix's
        self.part_order = act_order and split is not None and split[0] == 1
        self.columns = split[3] if self.part_order else in_features
        self.group = self.columns if group is None else int(group)
        if self.columns % self.group:
            raise ValueError(f"experts' {self.columns} input features are not whole "
                             f"{self.group}-column quantization groups")  # fmt: skip
        super().__init__(num_experts, in_features, shards, split, experts)
        # (activation ordering: the shard that set each expert's input order in this load;
        # the expert's other shards must order its columns alike, `load_shard` checks)
        self._order_from: dict[int, str] = {}

    def _init_weights(self) -> None:
        e, n, k = self.num_local, self.out_features, self.in_features
        words, groups = cdiv(k * self.bits, 32), self.columns // self.group
        self.weight = nn.Parameter(torch.empty(e, n, words, dtype=torch.int32),
                                   requires_grad=False)  # fmt: skip
        self.register_buffer("weight_scale", torch.empty(e, n, groups, dtype=self.scale_dtype))
        zero = None if self.symmetric else torch.empty(e, n, groups, dtype=torch.int8)
        self.register_buffer("weight_zero", zero)
        perm = torch.empty(e, k, dtype=torch.int32) if self.act_order else None
        self.register_buffer("input_perm", None if self.part_order else perm)
        gidx = torch.empty(e, k, dtype=torch.int32) if self.part_order else None
        self.register_buffer("weight_gidx", gidx)

    @classmethod
    def like(
        cls,
        experts: ExpertWeights,
        bits: int,
        group: int | None,
        symmetric: bool,
        act_order: bool = False,
    ) -> IntExpertWeights:
        """Empty integer experts of `experts`' shape, shards and parallel split, on its
        device, their scales in its dtype. ValueError where a rank's part of the down
        projection would not be whole groups (any part with `act_order`: each column keeps
        its group)."""
        split = experts.split
        if split is not None and split[0] == 1 and not act_order:
            check_whole_groups(split[1], split[2], group, "the experts' down projection")
        with torch.device(experts.weight.device):
            return cls(
                experts.num_local, experts.in_features, experts.shards, bits, group, symmetric,
                scale_dtype=experts.weight.dtype, split=split,
                experts=(experts.first, experts.total) if experts.num_local < experts.total
                else None, act_order=act_order,
            )  # fmt: skip

    def extra_repr(self) -> str:
        kind = "symmetric" if self.weight_zero is None else "asymmetric"
        order = ", act_order" if self.act_order else ""
        return (f"experts={self.num_local}, in={self.in_features}, out={self.out_features}, "
                f"bits={self.bits}, group={self.group}, {kind}{order}")  # fmt: skip

    def operand(self) -> IntExperts:
        return IntExperts(self.weight, self.weight_scale, self.weight_zero, self.bits,
                          self.group, self.in_features, self.input_perm,
                          self.weight_gidx)  # fmt: skip

    def load_shard(
        self,
        param: nn.Parameter,
        loaded: torch.Tensor | PackedIntWeight | Int8Weight,
        shard_id: tuple[int, str],
    ) -> None:
        if isinstance(loaded, Int8Weight):  # (a W8A8 checkpoint's expert)
            loaded = loaded.as_packed()
        rows = self._quantized_rows(loaded, PackedIntWeight, shard_id)
        if rows is None:
            return
        expert, offset, size = rows
        loaded = self._part(loaded, shard_id)
        if loaded.shape != (size, self.in_features):
            raise ValueError(f"expert shard {shard_id!r}: checkpoint shape "
                             f"{tuple(loaded.shape)} does not match expected "
                             f"{(size, self.in_features)}")  # fmt: skip
        if (loaded.bits, loaded.group, loaded.zero is None) != (
            self.bits, self.group, self.weight_zero is None
        ):  # fmt: skip
            raise ValueError(f"expert shard {shard_id!r}: {loaded.bits}-bit groups of "
                             f"{loaded.group}, the config says {self.bits}-bit groups of "
                             f"{self.group}")  # fmt: skip
        self._load_order(expert, loaded.perm, shard_id)
        if (self.weight_gidx is None) != (loaded.gidx is None):
            raise ValueError(f"expert shard {shard_id!r}: only a part of experts with "
                             "activation ordering has, and needs, each column's group")  # fmt: skip
        if self.weight_gidx is not None:
            self.weight_gidx[expert].copy_(loaded.gidx)
        self.weight.data[expert].narrow(0, offset, size).copy_(loaded.packed)
        self.weight_scale[expert].narrow(0, offset, size).copy_(loaded.scale)
        if self.weight_zero is not None:
            self.weight_zero[expert].narrow(0, offset, size).copy_(loaded.zero)

    def _load_order(self, expert: int, perm: torch.Tensor | None,
                    shard_id: tuple[int, str]) -> None:  # fmt: skip
        """Expert `expert`'s input order (activation ordering) from shard `shard_id`; its
        stacked shards (gate and up read the same input, GPTQ orders their columns by the
        same statistics) must agree."""
        if self.input_perm is None:
            if perm is not None:
                raise ValueError(f"expert shard {shard_id!r}: its columns are ordered by "
                                 "group (a g_idx) but the config has no activation "
                                 "ordering")  # fmt: skip
            return
        if self.input_perm.device.type == "meta":
            return
        if perm is None:  # (in order)
            perm = torch.arange(self.in_features)
        perm = perm.to(self.input_perm.device, torch.int32)
        first = self._order_from.setdefault(expert, shard_id[1])
        if first != shard_id[1] and not torch.equal(self.input_perm[expert], perm):
            raise ValueError(f"expert shard {shard_id!r}: its columns' order (g_idx) differs "
                             f"from its {first!r} shard's; the stacked parts of an expert with "
                             "activation ordering must order them alike")  # fmt: skip
        self.input_perm[expert].copy_(perm)

    def finish_loading(self) -> None:
        """After a load (the next one sets each expert's order anew)."""
        self._order_from.clear()

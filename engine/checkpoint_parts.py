"""A quantized checkpoint's tensors as the loader takes them: each quantized weight's parts
(the stored integers or float8 values, their scales, zero points, group indices), which
checkpoints store as separate tensors in any order, joined into one object the quantized
layers load (`QuantizedWeight`, `PackedIntWeight`, `Int8Weight`), repacked where the
format's layout is not the layers' (AutoAWQ's and GPTQ's). Which of these a model runs with
is engine/quantization.py's.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from engine.layers.fp8 import QuantizedWeight
    from engine.quantization import IntWeightConfig

# static activation scales (unused: activations are scaled as they come); KV-cache scales never
# get here, the loader takes them first (engine/mem_cache/kv_quant.take_kv_scales)
_DROPPED = (".input_scale",)


def _pair_scales(
    weights: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    take_scale: Callable[[str, torch.Tensor], Any],
    make: Callable[[torch.Tensor, Any], object],
    what: str,
) -> Iterator[tuple[str, object]]:
    """A checkpoint's tensors with each `dtype` weight joined to its scale (`.weight_scale`
    or `.weight_scale_inv`; either may come first): `make(weight, take_scale(scale name,
    scale))`, yielded as the weight; static activation scales dropped, the other tensors as
    they come. ValueError for a weight without its scale or the reverse."""
    weights_waiting: dict[str, torch.Tensor] = {}
    scales_waiting: dict[str, Any] = {}
    for name, tensor in weights:
        if name.endswith(_DROPPED):
            continue
        if name.endswith((".weight_scale_inv", ".weight_scale")):
            base = name.rsplit(".", 1)[0] + ".weight"
            scale = take_scale(name, tensor)
            if base in weights_waiting:
                yield base, make(weights_waiting.pop(base), scale)
            else:
                scales_waiting[base] = scale
        elif tensor.dtype == dtype:
            if name in scales_waiting:
                yield name, make(tensor, scales_waiting.pop(name))
            else:
                weights_waiting[name] = tensor
        else:
            yield name, tensor
    orphans = sorted(weights_waiting) + sorted(scales_waiting)
    if orphans:
        raise ValueError(f"{what} weights without a scale or the reverse: {orphans[:5]}")


def pair_fp8_scales(
    weights: Iterable[tuple[str, torch.Tensor]], block: tuple[int, int] | None
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """An FP8 checkpoint's tensors with each float8 weight joined to its scale as one
    `QuantizedWeight` (block scales, `weight_scale_inv`, or per tensor)."""
    from engine.layers.fp8 import FP8_DTYPE, QuantizedWeight

    def take_scale(name: str, scale: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if not name.endswith("_inv"):
            return scale, None
        if block is None:
            raise ValueError(f"{name}: block scales without weight_block_size in the config")
        return scale, block

    return _pair_scales(weights, FP8_DTYPE, take_scale,
                        lambda w, scale: QuantizedWeight(w, *scale),
                        "FP8 checkpoint: float8")  # type: ignore[return-value]  # fmt: skip


def pair_int8_weights(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, object]]:
    """A W8A8 checkpoint's tensors with each int8 weight joined to its `weight_scale` ([N] or
    [N, 1]) as one `Int8Weight`."""
    from engine.layers.int8 import Int8Weight

    return _pair_scales(weights, torch.int8, lambda _, s: s.reshape(-1).float(), Int8Weight,
                        "W8A8 checkpoint: int8")  # fmt: skip


INT_PARTS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")


def _join_parts(
    weights: Iterable[tuple[str, torch.Tensor]],
    parts_of: tuple[str, ...],
    needed: set[str],
    make: Callable[[str, dict[str, torch.Tensor]], object],
    what: str,
) -> Iterator[tuple[str, object]]:
    """A checkpoint's tensors with each layer's quantized parts (`parts_of`, in any order)
    joined, once it has the `needed` ones, into `make(layer, parts)`, yielded as the layer's
    `weight`; the other tensors as they come. ValueError for parts left without the others."""
    waiting: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        base, _, part = name.rpartition(".")
        if part not in parts_of:
            yield name, tensor
            continue
        parts = waiting.setdefault(base, {})
        parts[part] = tensor
        if needed <= set(parts):
            del waiting[base]
            yield base + ".weight", make(base, parts)
    if waiting:
        raise ValueError(f"{what}: quantized weights missing parts: {sorted(waiting)[:5]}")


def pair_int_weights(
    weights: Iterable[tuple[str, torch.Tensor]], config: IntWeightConfig
) -> Iterator[tuple[str, object]]:
    """A compressed-tensors checkpoint's tensors with each quantized weight's parts (packed
    words, scales, shape, zero points; in any order) joined into one `PackedIntWeight`,
    yielded as the module's `weight`. ValueError for a part without the others, or a
    `weight_g_idx` (activation ordering)."""
    from engine.layers.int_weight import PackedIntWeight, unpack_zero_points

    def make(base: str, parts: dict[str, torch.Tensor]) -> PackedIntWeight:
        rows, columns = (int(v) for v in parts["weight_shape"].tolist())
        scale = parts["weight_scale"]
        group = columns if config.group is None else config.group
        if scale.shape != (rows, -(-columns // group)):
            raise ValueError(f"{base}: scales of shape {tuple(scale.shape)} for a {rows} x "
                             f"{columns} weight in groups of {group}")  # fmt: skip
        zero = parts.get("weight_zero_point")
        if zero is not None:
            zero = unpack_zero_points(zero, config.bits, rows)
        return PackedIntWeight(parts["weight_packed"], scale, zero, config.bits, group, columns)

    needed = set(INT_PARTS[:3]) | (set() if config.symmetric else {"weight_zero_point"})
    return _join_parts(_no_group_index(weights), INT_PARTS, needed, make,
                       "compressed-tensors checkpoint")  # fmt: skip


def _no_group_index(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        if name.endswith(".weight_g_idx"):
            raise ValueError(f"{name}: activation ordering (a group index per column) is not "
                             "supported")  # fmt: skip
        yield name, tensor


# AutoAWQ's GEMM layout packs output columns 8j .. 8j + 7 into word j, nibble i holding column
# (0, 2, 4, 6, 1, 3, 5, 7)[i] of the eight: column c's four bits sit at nibble AWQ_NIBBLE[c % 8]
AWQ_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)
AWQ_PARTS = ("qweight", "qzeros", "scales")


def pair_awq_weights(
    weights: Iterable[tuple[str, torch.Tensor]], config: IntWeightConfig
) -> Iterator[tuple[str, object]]:
    """An AutoAWQ checkpoint's `qweight` [K, N / 8], `qzeros` [K / group, N / 8] and `scales`
    [K / group, N] of each layer (w = (q - z) * s, q and z in 0 .. 15) joined into one
    `PackedIntWeight` of the integer layers' layout: the integers transposed to [N, K] and
    packed along K, zero points signed (z - 8, as the words' offset)."""
    from engine.layers.int_weight import PackedIntWeight
    from kernels.int_gemm import pack_int, unpack_int

    def make(base: str, parts: dict[str, torch.Tensor]) -> PackedIntWeight:
        qweight, scales = parts["qweight"], parts["scales"]
        columns, rows = qweight.shape[0], qweight.shape[1] * 8
        group = config.group or columns
        if scales.shape != (columns // group, rows):
            raise ValueError(f"{base}: AWQ scales of shape {tuple(scales.shape)} for a "
                             f"{columns} x {rows} qweight in groups of {group}")  # fmt: skip
        if qweight.device.type == "meta":  # (a dry run: the shapes only)
            packed = torch.empty(rows, columns // 8, dtype=torch.int32, device="meta")
            zero = None if config.symmetric else torch.empty(rows, columns // group,
                                                             dtype=torch.int8, device="meta")
        else:
            packed = pack_int(unpack_int(qweight, 4, rows, AWQ_NIBBLE).t(), 4)
            zero = None
            if not config.symmetric:
                zero = unpack_int(parts["qzeros"], 4, rows, AWQ_NIBBLE) - 8
                zero = zero.to(torch.int8).t().contiguous()
        return PackedIntWeight(packed, scales.t().contiguous(), zero, 4, group, columns)

    needed = {"qweight", "scales"} | (set() if config.symmetric else {"qzeros"})
    return _join_parts(weights, AWQ_PARTS, needed, make, "AWQ checkpoint")


GPTQ_PARTS = ("qweight", "qzeros", "scales", "g_idx")


def pair_gptq_weights(
    weights: Iterable[tuple[str, torch.Tensor]], config: IntWeightConfig
) -> Iterator[tuple[str, object]]:
    """A GPTQ checkpoint's `qweight` [K / w, N] (input rows packed w to a word, lowest bits
    first), `qzeros` [groups, N / w] (output columns packed alike; stored less one in the
    "gptq" format, as they are in "gptq_v2"), `scales` [groups, N] and, with activation
    ordering, `g_idx` [K] (each input row's group) of each layer (w = (q - z) * s) joined
    into one `PackedIntWeight` of the integer layers' layout: the integers as [N, K] packed
    along K (GPTQ's words, transposed), zero points signed (z - 2^(bits-1)); with `g_idx`,
    the columns sorted by group and the order kept (`perm`; a row-parallel rank's part of
    the columns is taken in the input's order, `PackedIntWeight.narrow`). Without activation
    ordering a g_idx must be i // group_size, as AutoGPTQ writes it there."""
    from engine.layers.int_weight import PackedIntWeight
    from kernels.int_gemm import pack_int, unpack_int

    bits = config.bits
    per_word, middle = 32 // bits, 1 << (bits - 1)
    offset = 1 if config.layout == "gptq" else 0

    def make(base: str, parts: dict[str, torch.Tensor]) -> PackedIntWeight:
        qweight, scales = parts["qweight"], parts["scales"]
        columns, rows = qweight.shape[0] * per_word, qweight.shape[1]
        group = config.group or columns
        if scales.shape != (-(-columns // group), rows):
            raise ValueError(f"{base}: GPTQ scales of shape {tuple(scales.shape)} for a "
                             f"{columns} x {rows} weight in groups of {group}")  # fmt: skip
        g_idx = parts.get("g_idx")
        meta = qweight.device.type == "meta"  # (a dry run: the shapes only)
        perm = _group_order(base, g_idx, group) if g_idx is not None and not meta else None
        if meta:
            packed = torch.empty(rows, columns // per_word, dtype=torch.int32, device="meta")
            zero = None if config.symmetric else torch.empty(rows, scales.shape[0],
                                                             dtype=torch.int8, device="meta")
            perm = None if g_idx is None else torch.empty(columns, dtype=torch.int64,
                                                           device="meta")
            return PackedIntWeight(packed, scales.t(), zero, bits, group, columns, perm)
        packed = qweight.t().contiguous()  # (row n's words hold its columns, in order)
        if perm is not None:
            packed = pack_int(unpack_int(packed, bits, columns)[:, perm], bits)
        elif g_idx is not None:  # (ordered, but in order: a row-parallel part needs it too)
            perm = torch.arange(columns)
        zero = unpack_int(parts["qzeros"], bits, rows).to(torch.int16) + offset - middle
        if config.symmetric:
            if bool((zero != 0).any()):
                raise ValueError(f"{base}: a symmetric GPTQ checkpoint (sym: true) whose zero "
                                 f"points are not {middle}")  # fmt: skip
            zero = None
        elif int(zero.max()) > 127:
            raise ValueError(f"{base}: GPTQ zero point {int(zero.max()) + middle} is out of "
                             f"the {bits}-bit range")  # fmt: skip
        else:
            zero = zero.to(torch.int8).t().contiguous()
        return PackedIntWeight(packed, scales.t().contiguous(), zero, bits, group, columns, perm)

    needed = {"qweight", "qzeros", "scales"} | ({"g_idx"} if config.act_order else set())
    if not config.act_order:
        weights = _groups_in_order(weights, config.group)
    return _join_parts(weights, GPTQ_PARTS, needed, make, "GPTQ checkpoint")


def _groups_in_order(
    weights: Iterable[tuple[str, torch.Tensor]], group: int | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """A GPTQ checkpoint without activation ordering: its g_idx dropped (AutoGPTQ writes i //
    group_size), after checking that it is that; ValueError where it orders the columns."""
    for name, tensor in weights:
        if not name.endswith(".g_idx"):
            yield name, tensor
        elif tensor.device.type != "meta":
            in_order = torch.arange(tensor.shape[0]) // (group or tensor.shape[0])
            if not torch.equal(tensor.to(torch.int64), in_order):
                raise ValueError(f"{name}: the columns are ordered by group, but the config "
                                 "has no activation ordering (desc_act: false)")  # fmt: skip


def _group_order(base: str, g_idx: torch.Tensor, group: int) -> torch.Tensor | None:
    """The input columns sorted by their group (None: already in order); ValueError unless
    each group has `group` columns, as GPTQ's activation ordering makes them."""
    columns = g_idx.shape[0]
    in_order = torch.arange(columns) // group
    g_idx = g_idx.to(torch.int64)
    if torch.equal(g_idx, in_order):
        return None
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], in_order):
        raise ValueError(f"{base}: g_idx does not give each group {group} columns")
    return perm


_EXPERT_PART = re.compile(r"\.experts\.\d+\.[^.]+\.([^.]+)$")


def packed_experts(checkpoint: str, parts: tuple[str, ...]) -> bool:
    """Whether the checkpoint folder stores some expert's matrix as quantized parts (the
    tensor names only: a sharded checkpoint's index, or the file's header)."""
    import json
    import os

    from safetensors import safe_open

    from engine.loader import safetensors_files

    index = os.path.join(checkpoint, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = list(json.load(f)["weight_map"])
    else:
        names = []
        for file in safetensors_files(checkpoint):
            with safe_open(file, framework="pt", device="cpu") as f:
                names.extend(f.keys())
    return any((m := _EXPERT_PART.search(n)) and m.group(1) in parts for n in names)

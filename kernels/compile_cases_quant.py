"""The cases of `kernels.compile_check` for the quantized weights' kernels (see
kernels/compile_cases.py, whose `cases` yields these): the fused MoE's grouped GEMMs over
integer experts (W4A16 / W8A16, GPTQ's activation ordering and a rank's part of it) and float8
ones (block or tensor scales, a rank's part that starts inside a block), the FP8 W8A8 GEMM and
GEMV, the integer GEMM and GEMV, the activations' quantization, W8A8 int8's GEMV.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from kernels.fp8_gemm import fp8_gemm, fp8_gemv, quantize_rows, quantize_rows_int8_triton
from kernels.fused_moe import fused_experts_triton
from kernels.int_gemm import int_gemm

# (hidden, experts, top_k, expert intermediate) of Qwen3-30B-A3B
QWEN3_MOE = (2048, 128, 8, 768)


def quantized_weight_cases(
    dtypes: dict[str, torch.dtype],
) -> Iterator[tuple[dict[str, Any], Callable[[], None]]]:
    """(labels, launch) of every quantized-weight case, in each of `dtypes`."""
    for name, dtype in dtypes.items():
        for tokens in (4, 1024):  # 16-row and 64-row blocks
            for case, int_case in INT_MOE_CASES.items():
                labels = {"dtype": name, "case": f"{case} T{tokens}"}
                yield labels, functools.partial(launch_int_moe, dtype, tokens, *int_case)
            for case, fp8_case in FP8_MOE_CASES.items():
                labels = {"dtype": name, "case": f"{case} T{tokens}"}
                yield labels, functools.partial(launch_fp8_moe, dtype, tokens, *fp8_case)
        for group in ((128, 128), (1, 4096)):  # a block-scaled checkpoint; per channel
            for tokens in (4, 1024):  # 16-row and 64-row blocks
                labels = {"dtype": name, "case": f"fp8 gemm group {group} T{tokens}"}
                yield labels, functools.partial(launch_fp8, dtype, group, tokens)
        for k in (4096, 8192):  # one token: the GEMV (K steps of 1024; of 2048 from 8192)
            for group in ((128, 128), (1, k)):
                labels = {"dtype": name, "case": f"fp8 gemv group {group[0]} K{k}"}
                yield labels, functools.partial(launch_fp8, dtype, group, 1, k)
        for case, args in INT_CASES.items():
            yield {"dtype": name, "case": case}, functools.partial(launch_int, dtype, *args)
        for k, group_cols in ((4096, 4096), (8192, 128)):  # per token; a block checkpoint's
            labels = {"dtype": name, "case": f"fp8 quantize K{k} group {group_cols}"}
            yield labels, functools.partial(quantize_rows, torch.empty(4, k, dtype=dtype),
                                            group_cols)  # fmt: skip
        # W8A8 int8's per-token activations (engine/layers/int8.py), and its one-row GEMV
        # (K steps of 1024; of 2048 from 8192)
        yield {"dtype": name, "case": "int8 quantize K4096"}, functools.partial(
            quantize_rows_int8_triton, torch.empty(4, 4096, dtype=dtype)
        )
        for k in (4096, 8192):
            yield {"dtype": name, "case": f"int8 gemv K{k}"}, functools.partial(
                launch_int8_gemv, dtype, k
            )


def launch_int_moe(
    dtype: torch.dtype,
    tokens: int,
    bits: int,
    symmetric: bool,
    act_order: bool = False,
    part: bool = False,
) -> None:
    """Both grouped GEMMs over integer experts (Qwen3-30B-A3B's shape; W4A16 in groups of 128
    with or without zero points, or with activation ordering, W8A16 per channel). `part`:
    a rank's half of the down projection's columns under activation ordering (each column's
    group gathered)."""
    from engine.layers.int_experts import IntExperts

    hidden, experts, top_k, inter = QWEN3_MOE

    def packed(n: int, k: int, split: bool = False) -> IntExperts:
        group = 128 if bits == 4 else k
        groups = 2 * k // group if split else k // group
        scale = torch.empty(experts, n, groups, dtype=dtype)
        zero = None if symmetric else torch.empty(experts, n, groups, dtype=torch.int8)
        words = torch.empty(experts, n, k * bits // 32, dtype=torch.int32)
        order = torch.zeros(experts, k, dtype=torch.int32)
        if split:
            return IntExperts(words, scale, zero, bits, group, k, gidx=order)
        return IntExperts(words, scale, zero, bits, group, k, order if act_order else None)

    x = torch.empty(tokens, hidden, dtype=dtype)
    ids = torch.arange(tokens * top_k).remainder(experts).view(tokens, top_k)
    fused_experts_triton(x, packed(2 * inter, hidden), packed(hidden, inter // 2 if part else
                                                              inter, part),
                         torch.full(ids.shape, 1.0 / top_k), ids)  # fmt: skip


# integer experts: W4A16 (groups of 128; with zero points; GPTQ's activation ordering, and a
# rank's half of it: the down projection's columns each with its group), W8A16 per channel
INT_MOE_CASES = {"moe int w4 g128": (4, True), "moe int w4 g128 asym": (4, False),
                 "moe int w4 g128 act order": (4, True, True),
                 "moe int w4 g128 act order part": (4, False, True, True),
                 "moe int w8 channel": (8, True)}  # fmt: skip


def launch_fp8_moe(dtype: torch.dtype, tokens: int, block: bool, part: bool = False) -> None:
    """Both grouped GEMMs over float8 experts (Qwen3-30B-A3B's shape): a block checkpoint's
    scales (128 columns a scale, per row) or a per-tensor one's (a scale per row). `part`:
    rank 1 of 8's (96 of the 768 features: its down projection's columns start 96 into a
    block, K steps of 32)."""
    from engine.layers.fp8_experts import Fp8Experts

    hidden, experts, top_k, inter = QWEN3_MOE
    offset = 0
    if part:
        inter = offset = inter // 8

    def experts_of(n: int, k: int, offset: int = 0) -> Fp8Experts:
        group = 128 if block else k
        scale = torch.empty(experts, n, -(-(offset + k) // group))
        weight = torch.empty(experts, n, k, dtype=torch.float8_e4m3fn)
        return Fp8Experts(weight, scale, group, dtype, offset)

    x = torch.empty(tokens, hidden, dtype=dtype)
    ids = torch.arange(tokens * top_k).remainder(experts).view(tokens, top_k)
    fused_experts_triton(x, experts_of(2 * inter, hidden), experts_of(hidden, inter, offset),
                         torch.full(ids.shape, 1.0 / top_k), ids)  # fmt: skip


FP8_MOE_CASES = {"moe fp8 block 128": (True,), "moe fp8 tensor": (False,),
                 "moe fp8 block 128 part": (True, True)}  # fmt: skip


def launch_fp8(dtype: torch.dtype, group: tuple[int, int], tokens: int, k: int = 4096) -> None:
    """The W8A8 GEMM of a 4096 x `k` layer with `dtype` output (one token: the GEMV)."""
    n = 4096
    a = torch.empty(tokens, k, dtype=torch.float8_e4m3fn)
    w = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    a_s = torch.empty(tokens, -(-k // group[1]))
    w_s = torch.empty(-(-n // group[0]), -(-k // group[1]))
    (fp8_gemv if tokens == 1 else fp8_gemm)(a, a_s, w, w_s, group, None, dtype)


def launch_int(dtype: torch.dtype, bits: int, group: int | None, tokens: int,
                symmetric: bool = True, k: int = 4096, part: bool = False) -> None:  # fmt: skip
    """The W4A16 / W8A16 GEMM of a 4096 x k layer (group None: per channel); one token: the
    GEMV kernel. `part`: a row-parallel half of a weight with activation ordering (each
    column's group gathered, `gidx`)."""
    n = 4096
    g = group or k
    groups = 2 * k // g if part else k // g
    packed = torch.empty(n, k * bits // 32, dtype=torch.int32)
    scale = torch.empty(n, groups, dtype=dtype)
    zero = None if symmetric else torch.empty(n, groups, dtype=torch.int8)
    gidx = torch.zeros(k, dtype=torch.int32) if part else None
    int_gemm(torch.empty(tokens, k, dtype=dtype), packed, scale, zero, bits, g, gidx=gidx)


def launch_int8_gemv(dtype: torch.dtype, k: int = 4096) -> None:
    """W8A8 int8's one-row GEMV of a 4096 x k layer, out in `dtype`, with a bias."""
    from engine.layers.int8 import int8_gemv

    n = 4096
    int8_gemv(torch.empty(1, k, dtype=torch.int8), torch.empty(1),
              torch.empty(n, k, dtype=torch.int8), torch.empty(n), torch.empty(n, dtype=dtype),
              dtype)  # fmt: skip


# weight-only integer GEMMs: W4A16 in groups of 128 (decode and prefill row blocks; with
# zero points), W8A16 per channel; their one-row GEMV (1024 columns a step, 2048 from K 8192)
INT_CASES = {"int w4 g128 T4": (4, 128, 4, True), "int w4 g128 T1024": (4, 128, 1024, True),
             "int w4 g128 asym T1024": (4, 128, 1024, False),
             "int w8 channel T1024": (8, None, 1024, True),
             "int gemv w4 g128": (4, 128, 1, True), "int gemv w4 g128 asym": (4, 128, 1, False),
             "int gemv w4 g128 K14336": (4, 128, 1, True, 14336),
             "int gemv w8 channel": (8, None, 1, True),
             "int gemv w8 channel K14336": (8, None, 1, True, 14336),
             # (a row-parallel half with activation ordering, zero points)
             "int w4 g128 act order part T1024": (4, 128, 1024, False, 4096, True),
             "int gemv w4 g128 act order part": (4, 128, 1, False, 4096, True)}  # fmt: skip

"""The fused MoE kernels against the torch path (in the Triton interpreter on CPU, compiled on
CUDA), and the alignment that sorts (token, choice) pairs into per-expert row blocks."""

from __future__ import annotations

import pytest
import torch

from engine.layers.moe import fused_experts_torch, select_experts
from kernels.testing import triton_test_device

DEVICE, SKIP_REASON = triton_test_device()  # before anything below imports triton
needs_triton = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")


def _case(num_tokens, num_experts, top_k, hidden, inter, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) * inter**-0.5
    logits = torch.randn(num_tokens, num_experts, generator=g)
    logits[:, 0] = -1e4  # an expert nobody picks: its rows must stay empty
    weights, ids = select_experts(logits, top_k, renormalize=True)
    x, w13, w2, weights, ids = (t.to(DEVICE) for t in (x, w13, w2, weights, ids))
    return x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids


@needs_triton
@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(5, 8, 2), (3, 4, 4), (70, 6, 2)])
@pytest.mark.parametrize("block_m", [16, 64])
def test_moe_align_puts_each_pair_once_in_its_experts_blocks(
    num_tokens, num_experts, top_k, block_m
):
    from kernels.fused_moe import moe_align

    ids = _case(num_tokens, num_experts, top_k, 8, 8, torch.float32)[4]
    sorted_ids, block_experts, total = moe_align(ids, num_experts, block_m)
    num_pairs = ids.numel()
    assert sorted_ids.numel() % block_m == 0
    assert sorted_ids.numel() >= num_pairs + num_experts * (block_m - 1)
    total = int(total.item())
    assert total % block_m == 0
    valid = sorted_ids[:total]
    assert sorted(valid[valid < num_pairs].tolist()) == list(range(num_pairs))
    assert (sorted_ids[total:] == num_pairs).all()
    flat = ids.reshape(-1).tolist()
    for block in range(total // block_m):
        expert = int(block_experts[block])
        rows = sorted_ids[block * block_m : (block + 1) * block_m].tolist()
        assert all(flat[p] == expert for p in rows if p < num_pairs), (block, expert, rows)
    assert (block_experts[total // block_m :] == num_experts).all()


@needs_triton
@pytest.mark.parametrize(
    "num_tokens,num_experts,top_k,hidden,inter",
    # decode-like (16-row blocks), prefill-like (64-row blocks), sizes off the block grid
    [(3, 8, 2, 64, 32), (1, 4, 1, 48, 40), (80, 6, 2, 96, 72)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_experts_triton_matches_torch(num_tokens, num_experts, top_k, hidden, inter, dtype):
    from kernels.fused_moe import fused_experts_triton

    x, w13, w2, weights, ids = _case(num_tokens, num_experts, top_k, hidden, inter, dtype)
    got = fused_experts_triton(x, w13, w2, weights, ids)
    assert got.dtype == dtype and got.shape == x.shape
    want = fused_experts_torch(x.float(), w13.float(), w2.float(), weights, ids)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@needs_triton
def test_expert_groups_shares_add_up_to_every_experts_output() -> None:
    """Expert parallelism (engine/layers/moe.py): each group of experts computes its share of
    every token, the choices of other groups' experts skipped (torch: an id past its experts)
    or, for the Triton kernels, run on expert 0 with zero weight; the shares sum to the whole."""
    from kernels.fused_moe import fused_experts_triton

    x, w13, w2, weights, ids = _case(24, 8, 2, 64, 32, torch.float32)
    whole = fused_experts_torch(x, w13, w2, weights, ids)
    torch_sum = triton_sum = torch.zeros_like(whole)
    for first in (0, 4):
        local, mine = ids - first, (ids >= first) & (ids < first + 4)
        part = slice(first, first + 4)
        torch_sum = torch_sum + fused_experts_torch(x, w13[part], w2[part], weights,
                                                    torch.where(mine, local, 4))  # fmt: skip
        triton_sum = triton_sum + fused_experts_triton(x, w13[part], w2[part], weights * mine,
                                                       torch.where(mine, local, 0))  # fmt: skip
    torch.testing.assert_close(torch_sum, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(triton_sum, whole, atol=1e-4, rtol=1e-4)


def _assert_quantized_experts_match(x, weights, ids, w13_pair, w2_pair) -> None:
    """Quantized experts (`w13_pair`, `w2_pair`: the experts and the float weights they hold)
    through the grouped GEMMs and through the torch path (each expert dequantized) give the
    float weights' torch result; all experts dequantized at once (what CUDA runs for groups
    the kernels' K steps do not divide) are the float weights."""
    from kernels.fused_moe import fused_experts_triton

    (w13, w13_float), (w2, w2_float) = w13_pair, w2_pair
    want = fused_experts_torch(x, w13_float, w2_float, weights, ids)
    torch.testing.assert_close(fused_experts_triton(x, w13, w2, weights, ids), want,
                               atol=1e-4, rtol=1e-4)  # fmt: skip
    torch.testing.assert_close(fused_experts_torch(x, w13, w2, weights, ids), want,
                               atol=1e-5, rtol=1e-5)  # fmt: skip
    torch.testing.assert_close(w13.dequantized(), w13_float, atol=1e-6, rtol=1e-6)


def _int_experts(num_experts: int, n: int, k: int, bits: int, group: int, symmetric: bool,
                 seed: int, act_order: bool = False):  # fmt: skip
    """Random integer experts ([E, N, K] packed as compressed-tensors packs each matrix) and
    their float weights; `act_order`: each expert's packed columns are its input's in an
    order of its own (GPTQ's activation ordering: groups of columns spread over the input)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    from engine.layers.int_experts import IntExperts

    g = torch.Generator().manual_seed(seed)
    lo, hi = -(1 << (bits - 1)), 1 << (bits - 1)
    q = torch.randint(lo, hi, (num_experts, n, k), generator=g, dtype=torch.int8)
    scale = (torch.rand(num_experts, n, k // group, generator=g) + 0.5) * (k**-0.5 / hi)
    zero = None if symmetric else torch.randint(lo, hi, (num_experts, n, k // group),
                                                generator=g, dtype=torch.int8)  # fmt: skip
    z = 0.0 if zero is None else zero.float().repeat_interleave(group, 2)
    weight = (q.float() - z) * scale.repeat_interleave(group, 2)
    packed = torch.stack([pack_to_int32(q[e], bits) for e in range(num_experts)])
    perm = None
    if act_order:  # (packed column j is the input's column perm[e, j])
        perm = torch.stack([torch.randperm(k, generator=g) for _ in range(num_experts)])
        weight = torch.empty_like(weight).scatter_(2, perm.unsqueeze(1).expand_as(weight),
                                                   weight)  # fmt: skip
        perm = perm.to(torch.int32).to(DEVICE)
    experts = IntExperts(packed.to(DEVICE), scale.to(DEVICE),
                         None if zero is None else zero.to(DEVICE), bits, group, k,
                         perm)  # fmt: skip
    return experts, weight.to(DEVICE)


@needs_triton
@pytest.mark.parametrize(("bits", "groups", "symmetric", "act_order"), [
    (4, (16, 16), True, False), (4, (32, 16), False, False), (8, (96, 48), False, False),
    (4, (16, 16), False, True),
])  # fmt: skip
@pytest.mark.parametrize("num_tokens", [3, 80])  # (16- and 64-row blocks)
def test_integer_experts_match_their_float_weights(bits, groups, symmetric, act_order,
                                                   num_tokens):  # fmt: skip
    """Integer experts (W4A16 / W8A16, engine/layers/int_experts.py) through the grouped GEMMs
    (each tile of words expanded in registers, a scale per group of columns; groups of 16
    to 96, 8 bits per channel; with activation ordering, each expert's input columns
    gathered in its order) and through the torch path (each expert dequantized) against
    the float weights they hold."""
    x, _, _, weights, ids = _case(num_tokens, 6, 2, 96, 48, torch.float32, seed=3)
    w13, w13_float = _int_experts(6, 96, 96, bits, groups[0], symmetric, seed=4,
                                  act_order=act_order)  # fmt: skip
    w2, w2_float = _int_experts(6, 96, 48, bits, groups[1], symmetric, seed=5,
                                act_order=act_order)  # fmt: skip
    _assert_quantized_experts_match(x, weights, ids, (w13, w13_float), (w2, w2_float))


@needs_triton
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("num_tokens", [3, 80])
def test_integer_experts_with_a_group_index(symmetric: bool, num_tokens: int) -> None:
    """A row-parallel part of integer experts with activation ordering (`IntExperts.gidx`:
    each column in the input's order, of any of the matrix's groups; here 5 groups over 48
    columns): the grouped GEMMs gather each column's scale and zero point, and the torch
    path dequantizes alike, against the float weights."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    from engine.layers.int_experts import IntExperts

    g = torch.Generator().manual_seed(7)

    def experts(n: int, k: int, groups: int):
        q = torch.randint(-8, 8, (6, n, k), generator=g, dtype=torch.int8)
        scale = (torch.rand(6, n, groups, generator=g) + 0.5) * (k**-0.5 / 8)
        zero = None if symmetric else torch.randint(-8, 8, (6, n, groups), generator=g,
                                                    dtype=torch.int8)  # fmt: skip
        gidx = torch.randint(0, groups, (6, k), generator=g, dtype=torch.int32)
        cols = gidx.long().unsqueeze(1).expand(6, n, k)
        z = 0.0 if zero is None else zero.float().gather(2, cols)
        weight = (q.float() - z) * scale.gather(2, cols)
        packed = torch.stack([pack_to_int32(q[e], 4) for e in range(6)])
        part = IntExperts(packed.to(DEVICE), scale.to(DEVICE),
                          None if zero is None else zero.to(DEVICE), 4, 16, k,
                          gidx=gidx.to(DEVICE))  # fmt: skip
        return part, weight.to(DEVICE)

    x, _, _, weights, ids = _case(num_tokens, 6, 2, 96, 48, torch.float32, seed=3)
    w13, w13_float = _int_experts(6, 96, 96, 4, 16, symmetric, seed=4)
    w2, w2_float = experts(96, 48, 5)
    _assert_quantized_experts_match(x, weights, ids, (w13, w13_float), (w2, w2_float))
    torch.testing.assert_close(w2.dequantized(), w2_float, atol=1e-6, rtol=1e-6)


def _fp8_experts(num_experts: int, n: int, k: int, block: tuple[int, int] | None, seed: int):
    """Random float8 experts with a checkpoint's scales (per block, or per tensor: None) held
    per row (`row_scales`), and their float weights."""
    from engine.layers.fp8 import FP8_DTYPE, QuantizedWeight
    from engine.layers.fp8_experts import Fp8Experts, row_scales
    from kernels.fp8_gemm import dequantize_groups

    g = torch.Generator().manual_seed(seed)
    data = (torch.randn(num_experts, n, k, generator=g) * 100).clamp(-448, 448).to(FP8_DTYPE)
    shape = (1,) if block is None else (-(-n // block[0]), -(-k // block[1]))
    scales = (torch.rand(num_experts, *shape, generator=g) + 0.5) * (k**-0.5 / 100)
    weights = [QuantizedWeight(data[e], scales[e].reshape(shape if block else ()), block)
               for e in range(num_experts)]  # fmt: skip
    group = block[1] if block else k
    scale = torch.stack([row_scales(w, group) for w in weights])
    float_weight = torch.stack([dequantize_groups(w.data, w.scale, w.block) for w in weights])
    experts = Fp8Experts(data.to(DEVICE), scale.to(DEVICE), group, torch.float32)
    return experts, float_weight.to(DEVICE)


@needs_triton
@pytest.mark.parametrize("block", [(16, 16), (32, 16), None], ids=["16x16", "32x16", "tensor"])
@pytest.mark.parametrize("num_tokens", [3, 80])  # (16- and 64-row blocks)
def test_float8_experts_match_their_float_weights(block, num_tokens):
    """Float8 experts (engine/layers/fp8_experts.py) through the grouped GEMMs (each float8
    tile multiplied by its rows' scales of its block of columns in registers) and through
    the torch path (each expert dequantized) against the float weights they hold: block
    scales that do not divide the matrices (80 x 72 and 72 x 40 in 32 x 16 blocks) and one
    scale per tensor."""
    x, _, _, weights, ids = _case(num_tokens, 6, 2, 72, 40, torch.float32, seed=3)
    w13, w13_float = _fp8_experts(6, 80, 72, block, seed=4)
    w2, w2_float = _fp8_experts(6, 72, 40, block, seed=5)
    _assert_quantized_experts_match(x, weights, ids, (w13, w13_float), (w2, w2_float))


@needs_triton
@pytest.mark.parametrize("start", [16, 8])
@pytest.mark.parametrize("num_tokens", [3, 80])
def test_float8_experts_of_a_part_that_cuts_its_blocks(start, num_tokens):
    """A rank's part of float8 experts' down projection (tensor parallelism) that starts
    inside a scale block: columns `start`..`start` + 40 of 80 in 32-column blocks keep the
    scales of the blocks they overlap (`Fp8Experts.offset`: 16 or 8 columns into the first),
    and the grouped GEMMs' steps stay within a block (16 or 8 columns a step); against the
    float weights' same columns."""
    from dataclasses import replace

    x, _, _, weights, ids = _case(num_tokens, 6, 2, 72, 40, torch.float32, seed=3)
    w13, w13_float = _fp8_experts(6, 80, 72, (16, 16), seed=4)
    whole, whole_float = _fp8_experts(6, 72, 80, (16, 32), seed=5)
    end = start + 40
    w2 = replace(whole, data=whole.data[:, :, start:end].contiguous(),
                 scale=whole.scale[:, :, start // 32 : -(-end // 32)].contiguous(),
                 offset=start % 32)  # fmt: skip
    w2_float = whole_float[:, :, start:end].contiguous()
    _assert_quantized_experts_match(x, weights, ids, (w13, w13_float), (w2, w2_float))
    torch.testing.assert_close(w2.dequantized(), w2_float, atol=1e-6, rtol=1e-6)

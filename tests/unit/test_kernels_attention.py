"""Decode and extend attention kernels against their torch references on small shapes: in
the Triton interpreter on CPU, compiled on CUDA (tests/gpu/test_kernels_gpu.py runs real
shapes).

Cases come from `kernels.testing.make_paged_case`: shuffled pages and rows, poisoned free
slots and poisoned `req_to_token` tails, so a wrong slot, a key past the end or a wrong GQA
head shows up as a large error. Small blocks make short sequences span several key blocks,
query blocks and decode splits (including empty splits).
"""

from __future__ import annotations

import pytest
import torch

from kernels.reference import decode_attention_ref, extend_attention_ref
from kernels.testing import PagedCase, make_paged_case, triton_test_device

DEVICE, SKIP_REASON = triton_test_device()  # before any kernel module imports triton
if SKIP_REASON:
    pytest.skip(SKIP_REASON, allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kernels.attention_common import soft_cap  # noqa: E402
from kernels.decode_attention import (  # noqa: E402
    decode_attention,
    decode_scratch,
    kv_splits_for,
    merge_counters,
)
from kernels.extend_attention import extend_attention  # noqa: E402

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    err = (got.float() - want.float()).abs().max().item()
    assert err <= TOL[want.dtype], f"max abs error {err}"


def run_decode(
    case: PagedCase,
    window_left: int = -1,
    logit_cap: float = 0.0,
    merge: str = "kernel",
    **kw: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`merge`: "kernel" (stage 2 as its own launch) or "fused" (the last stage-1 program of
    each (request, KV head) merges; its counts must be zero again afterwards)."""
    case.store_new_kv()
    args = (case.q, case.k_buffer, case.v_buffer, case.req_to_token, case.req_pool_indices)
    args += (case.seq_lens, case.scale)
    if merge == "fused":
        kw["merge_counter"] = merge_counters(len(case.seq_lens) + 1, case.k_buffer.shape[1],
                                             case.q.device)  # fmt: skip
    got = decode_attention(*args, window_left=window_left, logit_cap=logit_cap, **kw)
    if merge == "fused":
        assert not kw["merge_counter"].any(), "the fused merge left a count behind"
    return got, decode_attention_ref(*args, window_left, logit_cap, kw.get("sinks"))


MERGES = ["kernel", "fused"]


def run_extend(
    case: PagedCase, window_left: int = -1, logit_cap: float = 0.0, **kw: object
) -> tuple[torch.Tensor, torch.Tensor]:
    args = (case.q, case.k, case.v, case.k_buffer, case.v_buffer, case.req_to_token)
    args += (case.req_pool_indices, case.prefix_lens, case.extend_lens, case.extend_start_loc)
    got = extend_attention(
        *args, case.max_extend_len, case.scale, window_left=window_left, logit_cap=logit_cap, **kw
    )
    return got, extend_attention_ref(*args, case.scale, window_left, logit_cap, kw.get("sinks"))


# (num_heads, num_kv_heads, head_dim, page_size, dtype)
SHAPES = [
    (4, 1, 64, 1, torch.float32),
    (8, 2, 128, 16, torch.float32),
    (4, 4, 64, 16, torch.float16),
    (6, 2, 128, 1, torch.bfloat16),
]


@pytest.mark.parametrize("merge", MERGES)
@pytest.mark.parametrize("heads,kv_heads,head_dim,page_size,dtype", SHAPES)
def test_decode_matches_reference(heads, kv_heads, head_dim, page_size, dtype, merge):
    # lengths: one key, a split boundary, several blocks in several splits
    case = make_paged_case(
        [0, 15, 40, 57], [1] * 4, heads, kv_heads, head_dim, page_size, dtype, DEVICE, seed=heads
    )
    got, want = run_decode(case, merge=merge, num_splits=3, block_n=16)
    _close(got, want)


@pytest.mark.parametrize("merge", MERGES)
def test_decode_more_splits_than_blocks_and_reused_scratch(merge):
    """Requests too short to fill every split leave empty splits the merge must skip; the
    scratch buffers carry stale values from the previous layer's call."""
    case = make_paged_case([2, 0, 33], [1, 1, 1], 4, 2, 64, device=DEVICE, seed=5)
    scratch = decode_scratch(3, 4, 64, 8, case.q.device)
    scratch[0].fill_(1e4)
    scratch[1].fill_(1e4)
    got, want = run_decode(case, merge=merge, num_splits=8, block_n=16, scratch=scratch)
    _close(got, want)
    out = torch.empty_like(case.q)
    got2, _ = run_decode(case, merge=merge, num_splits=8, block_n=16, scratch=scratch, out=out)
    assert got2.data_ptr() == out.data_ptr()
    _close(got2, want)


@pytest.mark.parametrize("merge", MERGES)
def test_decode_32_splits_into_a_slice_of_a_wider_scratch(merge):
    """The Triton backend's count at batch 1 (32 splits) over a long context, stage 1 writing
    into the first 32 splits of a scratch that has more rows and splits (a non-contiguous
    view: the kernels take its strides), stale values around."""
    case = make_paged_case([700, 3], [1, 1], 4, 2, 64, device=DEVICE, seed=7)
    mid_o, mid_lse = decode_scratch(4, 4, 64, 40, case.q.device)
    mid_o.fill_(1e4)
    mid_lse.fill_(1e4)
    scratch = (mid_o[:2, :, :32], mid_lse[:2, :, :32])
    assert not scratch[0].is_contiguous()
    got, want = run_decode(case, merge=merge, num_splits=32, block_n=16, scratch=scratch)
    _close(got, want)


@pytest.mark.parametrize("merge", MERGES)
@pytest.mark.parametrize("heads,kv_heads,head_dim,page_size,dtype", SHAPES)
def test_decode_writes_the_new_kv_itself(heads, kv_heads, head_dim, page_size, dtype, merge):
    """Given the new K/V (strided rows of a fused qkv, as the engine has them), the decode
    kernel stores them as the store kernel would and attends as if they had been stored
    first; the rest of the pool is untouched. With a window too (the new key is in every
    window)."""
    from kernels.reference import store_kv_ref

    for window_left in (-1, 5):
        case = make_paged_case([0, 15, 40, 57], [1] * 4, heads, kv_heads, head_dim, page_size,
                               dtype, DEVICE, seed=heads + 1)  # fmt: skip
        fused = torch.randn(4, (2 * kv_heads + 3) * head_dim, dtype=dtype, device=DEVICE)
        width = kv_heads * head_dim
        case.k.copy_(fused[:, :width].view_as(case.k))
        case.v.copy_(fused[:, width : 2 * width].view_as(case.v))
        k_rows, v_rows = fused[:, :width], fused[:, width : 2 * width]  # row stride > width
        pool_k, pool_v = case.k_buffer.clone(), case.v_buffer.clone()
        store_kv_ref(pool_k, pool_v, case.out_cache_loc, case.k, case.v)
        args = (case.q, case.k_buffer, case.v_buffer, case.req_to_token, case.req_pool_indices)
        args += (case.seq_lens, case.scale)
        kw: dict = {"num_splits": 3, "block_n": 16, "window_left": window_left}
        if merge == "fused":
            kw["merge_counter"] = merge_counters(4, kv_heads, case.q.device)
        got = decode_attention(*args, new_kv=(k_rows, v_rows, case.out_cache_loc), **kw)
        assert torch.equal(case.k_buffer, pool_k) and torch.equal(case.v_buffer, pool_v)
        _close(got, decode_attention_ref(*args, window_left, 0.0))


def test_fused_merge_is_the_merge_kernels_sum():
    """The fused merge weighs the chunks as the merge kernel does (only the order of the float32
    sum differs), GQA groups of 4 and 3 heads over 5 splits, an empty request included."""
    for heads, kv_heads in ((8, 2), (6, 2)):
        case = make_paged_case([70, 0, 9, 131], [1] * 4, heads, kv_heads, 64, device=DEVICE)
        kernel, want = run_decode(case, num_splits=5, block_n=16)
        fused, _ = run_decode(case, merge="fused", num_splits=5, block_n=16)
        _close(fused, want)
        torch.testing.assert_close(fused, kernel, rtol=1e-6, atol=1e-6)


def test_the_count_decides_which_program_merges():
    """The merge runs in the program whose count completes the (request, KV head), after every
    chunk is written: a count that starts one short merges before the last chunk is in (stale
    scratch shows), one that starts past it never merges (out keeps its poison), and the
    counts of other (request, KV head) pairs are left alone."""
    case = make_paged_case([40, 40], [1, 1], 4, 2, 64, device=DEVICE, seed=3)
    case.store_new_kv()
    args = (case.q, case.k_buffer, case.v_buffer, case.req_to_token, case.req_pool_indices)
    args += (case.seq_lens, case.scale)
    want = decode_attention_ref(*args, -1, 0.0)
    scratch = decode_scratch(2, 4, 64, 3, case.q.device)

    def run(first_count: int) -> tuple[torch.Tensor, torch.Tensor]:
        scratch[0].fill_(1e4)
        scratch[1].fill_(1e4)
        counts = merge_counters(2, 2, case.q.device)
        counts[0] = first_count  # request 0, KV head 0 only
        out = torch.full_like(case.q, -7.0)
        decode_attention(*args, num_splits=3, block_n=16, out=out, scratch=scratch,
                         merge_counter=counts)  # fmt: skip
        return out, counts

    out, counts = run(0)
    _close(out, want)
    assert not counts.any()
    early, counts = run(1)  # the second program to arrive merges: the third chunk is stale
    assert (early[0, :2] - want[0, :2]).abs().max() > 1.0
    _close(early[0, 2:], want[0, 2:])
    _close(early[1], want[1])
    assert counts.tolist() == [1, 0, 0, 0]  # the third arrival counted after the reset
    never, counts = run(3)
    assert (never[0, :2] == -7.0).all()
    _close(never[1], want[1])
    assert counts.tolist() == [6, 0, 0, 0]


def test_split_count_by_batch_size():
    """kv_splits_for on the H100's 132 SMs: about two programs per SM, 8 to 32 splits."""
    llama_1b = [kv_splits_for(bs, 8, 132) for bs in (1, 2, 3, 4, 8, 64, 256)]
    assert llama_1b == [32, 16, 8, 8, 8, 8, 8]
    assert kv_splits_for(1, 12, 132) == 16  # GPT-2: 12 KV heads
    assert [kv_splits_for(bs, 2, 132) for bs in (1, 4, 8, 16)] == [32, 32, 16, 8]
    assert kv_splits_for(1, 2, 4, lo=1, hi=4) == 4 and kv_splits_for(9, 2, 4, lo=1, hi=4) == 1


@pytest.mark.parametrize("heads,kv_heads,head_dim,page_size,dtype", SHAPES)
def test_extend_matches_reference(heads, kv_heads, head_dim, page_size, dtype):
    # no prefix; a one-token chunk on a prefix; a chunk spanning several query and key
    # blocks on an unaligned prefix
    case = make_paged_case(
        [0, 20, 37], [9, 1, 35], heads, kv_heads, head_dim, page_size, dtype, DEVICE, seed=heads + 1
    )
    got, want = run_extend(case, block_m=16, block_n=16)
    _close(got, want)


def test_extend_reads_strided_new_kv():
    """k/v arrive as column slices of a fused qkv projection ([N, Hk * D], row stride > H*D)."""
    case = make_paged_case([5, 0], [12, 7], 4, 2, 64, device=DEVICE, seed=9)
    num_tokens = case.q.shape[0]
    qkv = torch.cat([case.q.view(num_tokens, -1), case.k.view(num_tokens, -1),
                     case.v.view(num_tokens, -1)], dim=1)  # fmt: skip
    q, k, v = qkv.split([4 * 64, 2 * 64, 2 * 64], dim=1)
    _, want = run_extend(case, block_m=16, block_n=16)
    got = extend_attention(
        q.view(num_tokens, 4, 64), k, v, case.k_buffer, case.v_buffer,
        case.req_to_token, case.req_pool_indices,
        case.prefix_lens, case.extend_lens, case.extend_start_loc, case.max_extend_len,
        case.scale, block_m=16, block_n=16,
    )  # fmt: skip
    _close(got, want)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_float8_cache_reads_its_values(kv_dtype, q_dtype):
    """A float8 pool (and float8 new K/V for extend): the kernels convert each value as they
    load it and compute as for q's dtype; the reference reads the same float8 values."""
    fp8 = dict(block_m=16, block_n=16)
    case = make_paged_case([0, 20, 37], [9, 1, 35], 8, 2, 64, 16, q_dtype, DEVICE,
                           seed=4).as_float8(kv_dtype)  # fmt: skip
    got, want = run_extend(case, **fp8)
    _close(got, want)
    case = make_paged_case([0, 33, 70], [1, 1, 1], 8, 2, 64, 16, q_dtype, DEVICE,
                           seed=5).as_float8(kv_dtype)  # fmt: skip
    got, want = run_decode(case, num_splits=3, block_n=16)
    _close(got, want)


def test_extend_then_decode_agree_on_last_token():
    """Extending one token on a prefix is the decode computation: both kernels agree."""
    case = make_paged_case([23, 48], [1, 1], 8, 2, 64, 16, device=DEVICE, seed=11)
    extended, _ = run_extend(case, block_m=16, block_n=16)
    decoded, _ = run_decode(case, num_splits=2, block_n=16)
    _close(decoded, extended)


def _window_matters(case: PagedCase, run, window_left: int, **kw: object) -> None:
    """The windowed reference differs from the full one (so the comparison can fail)."""
    _, full = run(case, **kw)
    _, windowed = run(case, window_left, **kw)
    assert (full.float() - windowed.float()).abs().max().item() > 10 * TOL[full.dtype]


# window_left 0 (only itself), inside one key block, across blocks and splits
@pytest.mark.parametrize("window_left", [0, 5, 21])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_sliding_window_matches_reference(window_left, dtype):
    case = make_paged_case([0, 15, 40, 57], [1] * 4, 4, 2, 64, 4, dtype, DEVICE, seed=3)
    got, want = run_decode(case, window_left, num_splits=3, block_n=16)
    _close(got, want)
    _window_matters(case, run_decode, window_left, num_splits=3, block_n=16)


@pytest.mark.parametrize("window_left", [0, 5, 21])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_sliding_window_matches_reference(window_left, dtype):
    # rows whose window ends inside the prefix, inside the new tokens, or covers both
    case = make_paged_case([0, 20, 37], [9, 1, 35], 4, 2, 64, 4, dtype, DEVICE, seed=4)
    got, want = run_extend(case, window_left, block_m=16, block_n=16)
    _close(got, want)
    _window_matters(case, run_extend, window_left, block_m=16, block_n=16)


def test_sliding_window_wider_than_every_sequence_is_full_attention():
    case = make_paged_case([20, 3], [9, 30], 4, 2, 64, device=DEVICE, seed=6)
    windowed, _ = run_extend(case, 64, block_m=16, block_n=16)
    full, _ = run_extend(case, block_m=16, block_n=16)
    _close(windowed, full)


def _cap_matters(case: PagedCase, run, window_left: int, logit_cap: float, **kw: object) -> None:
    """The capped reference differs from the uncapped one (so the comparison can fail)."""
    _, plain = run(case, window_left, **kw)
    _, capped = run(case, window_left, logit_cap, **kw)
    assert (plain.float() - capped.float()).abs().max().item() > 10 * TOL[plain.dtype]


# Gemma 2's attention soft-capping: scores s -> c * tanh(s / c). The cases' scores reach a few
# units, so caps 0.5 and 2 bend most of them; with and without a sliding window (Gemma 2 has both)
@pytest.mark.parametrize("logit_cap,window_left", [(0.5, -1), (2.0, -1), (2.0, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_soft_cap_matches_reference(logit_cap, window_left, dtype):
    case = make_paged_case([0, 15, 40, 57], [1] * 4, 4, 2, 64, 4, dtype, DEVICE, seed=7)
    got, want = run_decode(case, window_left, logit_cap, num_splits=3, block_n=16)
    _close(got, want)
    _cap_matters(case, run_decode, window_left, logit_cap, num_splits=3, block_n=16)


@pytest.mark.parametrize("logit_cap,window_left", [(0.5, -1), (2.0, -1), (2.0, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_soft_cap_matches_reference(logit_cap, window_left, dtype):
    case = make_paged_case([0, 20, 37], [9, 1, 35], 4, 2, 64, 4, dtype, DEVICE, seed=8)
    got, want = run_extend(case, window_left, logit_cap, block_m=16, block_n=16)
    _close(got, want)
    _cap_matters(case, run_extend, window_left, logit_cap, block_m=16, block_n=16)


# gpt-oss's attention sinks: a logit per query head joins each softmax as a key with no value.
# Sinks around the scores' size (a few units) take a visible share; with a window (gpt-oss
# windows every other layer), several splits (the sink is added once, where they merge)
@pytest.mark.parametrize("merge", MERGES)
@pytest.mark.parametrize("window_left", [-1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_sinks_match_reference(merge, window_left, dtype):
    case = make_paged_case([0, 15, 40, 57], [1] * 4, 4, 2, 64, 4, dtype, DEVICE, seed=10)
    sinks = torch.tensor([-1.0, 0.5, 2.0, 4.0], device=DEVICE)
    got, want = run_decode(case, window_left, merge=merge, num_splits=3, block_n=16,
                           sinks=sinks)  # fmt: skip
    _close(got, want)
    _, plain = run_decode(case, window_left, num_splits=3, block_n=16)
    assert (plain.float() - want.float()).abs().max().item() > 10 * TOL[dtype]


@pytest.mark.parametrize("window_left", [-1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_sinks_match_reference(window_left, dtype):
    case = make_paged_case([0, 20, 37], [9, 1, 35], 4, 2, 64, 4, dtype, DEVICE, seed=11)
    sinks = torch.tensor([-1.0, 0.5, 2.0, 4.0], device=DEVICE)
    got, want = run_extend(case, window_left, block_m=16, block_n=16, sinks=sinks)
    _close(got, want)
    _, plain = run_extend(case, window_left, block_m=16, block_n=16)
    assert (plain.float() - want.float()).abs().max().item() > 10 * TOL[dtype]


def test_a_cap_far_above_every_score_changes_nothing():
    case = make_paged_case([20, 3], [9, 30], 4, 2, 64, device=DEVICE, seed=9)
    capped, _ = run_extend(case, -1, 1e4, block_m=16, block_n=16)
    plain, _ = run_extend(case, block_m=16, block_n=16)
    _close(capped, plain)


@triton.jit
def _apply_soft_cap(x_ptr, y_ptr, N: tl.constexpr, CAP: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(y_ptr + offs, soft_cap(tl.load(x_ptr + offs), CAP))


def test_soft_cap_is_tanh_to_float32_rounding():
    """The kernels' tanh (exp2 above |y| = 1/8, a series below) against torch's, over scores
    from 1e-6 to 1e3 of the cap, both signs, and saturation."""
    cap = 7.0
    mags = torch.logspace(-6, 3, 256, dtype=torch.float64) * cap
    x = torch.cat([mags, -mags, torch.tensor([0.0, 1e30, -1e30], dtype=torch.float64)])
    x = torch.cat([x, torch.zeros(1024 - x.numel(), dtype=torch.float64)])
    got = torch.empty(x.numel(), dtype=torch.float32, device=DEVICE)
    _apply_soft_cap[(1,)](x.to(torch.float32).to(DEVICE), got, N=x.numel(), CAP=cap)
    want = cap * torch.tanh(x.to(torch.float32).double() / cap)
    err = (got.cpu().double() - want).abs() / want.abs().clamp_min(1e-30)
    assert err.max().item() < 1e-6, f"worst relative error {err.max().item():.3g}"


@pytest.mark.parametrize("window_left", [4, 30])
def test_extend_tree_mask_in_a_sliding_window(window_left):
    """Draft trees in a sliding-window layer: a node sits at the request's prefix length plus
    its depth, and the window compares those positions (for the prefix's keys and for its
    ancestors), not its row in the tree. Rows placed at prefix + row instead give another
    result (the comparison can fail); a window of 31 reaches into the 37-key prefix."""
    from engine.speculative.tree import ancestor_mask, depths, packed_masks

    gen = torch.Generator().manual_seed(5)
    parents = [_random_parents(24, gen), [], _random_parents(9, gen)]
    prefix = [20, 37, 5]
    case = make_paged_case(prefix, [len(p) + 1 for p in parents], 4, 2, 64, 4, torch.float32,
                           DEVICE, seed=13)  # fmt: skip
    masks, starts = packed_masks(parents)
    tree = (torch.from_numpy(masks).to(DEVICE), torch.from_numpy(starts).to(DEVICE))
    positions = torch.tensor([n + d for n, p in zip(prefix, parents) for d in depths(p)],
                             device=DEVICE)  # fmt: skip
    args = (case.q, case.k, case.v, case.k_buffer, case.v_buffer, case.req_to_token)
    args += (case.req_pool_indices, case.prefix_lens, case.extend_lens, case.extend_start_loc)
    got = extend_attention(*args, case.max_extend_len, case.scale, block_m=16, block_n=16,
                           window_left=window_left, tree_mask=tree, positions=positions)
    own = [torch.from_numpy(ancestor_mask(p)) for p in parents]
    want = extend_attention_ref(*args, case.scale, window_left=window_left, tree_masks=own)
    _close(got, want)
    rows = torch.cat([n + torch.arange(len(p) + 1) for n, p in zip(prefix, parents)])
    by_row = extend_attention(*args, case.max_extend_len, case.scale, block_m=16, block_n=16,
                              window_left=window_left, tree_mask=tree,
                              positions=rows.to(DEVICE))  # fmt: skip
    assert (by_row.float() - want.float()).abs().max().item() > 10 * TOL[torch.float32]
    with pytest.raises(ValueError, match="needs positions"):
        extend_attention(*args, case.max_extend_len, case.scale, window_left=window_left,
                         tree_mask=tree)  # fmt: skip


def _random_parents(n: int, gen: torch.Generator) -> list[int]:
    return [int(torch.randint(0, j, (1,), generator=gen)) for j in range(1, n)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_tree_mask_matches_reference(dtype):
    """A verify step's draft trees (engine/speculative/tree.py): each new token sees the
    prefix and its ancestors only; a tree spanning two query and key blocks, a lone root, a
    chain. The tree mask changes the result (the comparison can fail)."""
    from engine.speculative.tree import ancestor_mask, chain_parents, packed_masks

    gen = torch.Generator().manual_seed(3)
    parents = [_random_parents(20, gen), [], chain_parents(6)]
    case = make_paged_case([20, 37, 5], [len(p) + 1 for p in parents], 4, 2, 64, 4, dtype,
                           DEVICE, seed=12)  # fmt: skip
    masks, starts = packed_masks(parents)
    tree = (torch.from_numpy(masks).to(DEVICE), torch.from_numpy(starts).to(DEVICE))
    args = (case.q, case.k, case.v, case.k_buffer, case.v_buffer, case.req_to_token)
    args += (case.req_pool_indices, case.prefix_lens, case.extend_lens, case.extend_start_loc)
    got = extend_attention(*args, case.max_extend_len, case.scale, block_m=16, block_n=16,
                           tree_mask=tree)  # fmt: skip
    own = [torch.from_numpy(ancestor_mask(p)) for p in parents]
    want = extend_attention_ref(*args, case.scale, tree_masks=own)
    _close(got, want)
    _, causal = run_extend(case, block_m=16, block_n=16)
    assert (causal.float() - want.float()).abs().max().item() > 10 * TOL[dtype]

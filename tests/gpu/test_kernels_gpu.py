"""Triton kernels compiled on CUDA at real shapes, against the torch references.

GQA (32 query heads over 8 KV heads) and MHA, head_dim 64/128, page sizes 1 and 16,
float32 / float16 / bfloat16, contexts up to a few thousand tokens, default block sizes and
split counts (the unit tests cover the same code with small blocks in the interpreter); and
Gemma's head_dim 256 with sliding windows and attention soft-capping.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

from tests.factories import require_compiled_cuda  # noqa: E402

require_compiled_cuda()

from kernels.decode_attention import (  # noqa: E402
    decode_attention,
    decode_scratch,
    merge_counters,
)
from kernels.extend_attention import extend_attention  # noqa: E402
from kernels.future_tokens import resolve_future_tokens, resolve_future_tokens_torch  # noqa: E402
from kernels.kv_store import store_kv  # noqa: E402
from kernels.reference import (  # noqa: E402
    decode_attention_ref,
    extend_attention_ref,
    store_kv_ref,
)
from kernels.testing import PagedCase, make_paged_case  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
HEADS = [(32, 8), (16, 16)]  # (query heads, KV heads)


def _close(got: torch.Tensor, want: torch.Tensor, size: float = 1.0) -> None:
    """`size`: the outputs' magnitude, where it is not about 1 (the tolerance scales)."""
    err = (got.float() - want.float()).abs().max().item()
    assert err <= TOL[want.dtype] * size, f"max abs error {err} (outputs of size {size})"


def _decode(
    case: PagedCase, merge: str = "kernel", **kw: object
) -> tuple[torch.Tensor, torch.Tensor]:
    """`merge` "fused": the merge in the last split program (its counts zero again after)."""
    case.store_new_kv()
    args = (case.q, case.k_buffer, case.v_buffer, case.req_to_token, case.req_pool_indices)
    if merge == "fused":
        kw["merge_counter"] = merge_counters(len(case.seq_lens), case.k_buffer.shape[1], "cuda")
    got = decode_attention(*args, case.seq_lens, case.scale, **kw)
    if merge == "fused":
        assert not kw["merge_counter"].any()
    return got, decode_attention_ref(*args, case.seq_lens, case.scale)


@pytest.mark.parametrize("merge", ["kernel", "fused"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads,kv_heads", HEADS)
def test_decode(heads, kv_heads, head_dim, page_size, dtype, merge):
    prefix = [1, 17, 255, 256, 1000, 3000, 4095, 63]
    case = make_paged_case(prefix, [1] * len(prefix), heads, kv_heads, head_dim, page_size,
                           dtype, "cuda", seed=head_dim + page_size)  # fmt: skip
    got, want = _decode(case, merge)
    _close(got, want)


@pytest.mark.parametrize("merge", ["kernel", "fused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(12, 12), (32, 8)])
def test_decode_writes_the_new_kv_itself(heads, kv_heads, head_dim, dtype, merge):
    """`new_kv`: the decode kernel stores the new tokens' K/V (column slices of a fused qkv)
    as the store kernel does, then reads them back in the same program (a barrier between):
    the pool equals the stored one bit for bit and the output the reference's."""
    from kernels.kv_store import store_kv

    prefix = [1, 17, 255, 256, 1000, 3000, 4095, 63]
    case = make_paged_case(prefix, [1] * len(prefix), heads, kv_heads, head_dim, 16, dtype,
                           "cuda", seed=head_dim + heads)  # fmt: skip
    width = kv_heads * head_dim
    qkv = torch.randn(len(prefix), heads * head_dim + 2 * width, device="cuda").to(dtype)
    k, v = qkv[:, heads * head_dim : -width], qkv[:, -width:]
    want_k, want_v = case.k_buffer.clone(), case.v_buffer.clone()
    store_kv(want_k, want_v, case.out_cache_loc, k, v)
    kw: dict = {"new_kv": (k, v, case.out_cache_loc)}
    if merge == "fused":
        kw["merge_counter"] = merge_counters(len(prefix), kv_heads, "cuda")
    args = (case.q, case.k_buffer, case.v_buffer, case.req_to_token, case.req_pool_indices)
    got = decode_attention(*args, case.seq_lens, case.scale, **kw)
    assert torch.equal(case.k_buffer, want_k) and torch.equal(case.v_buffer, want_v)
    _close(got, decode_attention_ref(*args, case.seq_lens, case.scale))


@pytest.mark.parametrize("batch,splits", [(1, 32), (2, 16), (64, 8), (256, 8)])
def test_fused_merge_under_concurrency(batch, splits):
    """The fused merge's ordering on the device (a barrier, an acquire-release count, loads
    past L1): 200 launches at the Triton backend's split counts for Llama-3.2-1B's heads, each
    equal to the merge kernel's result up to the order of the float32 sum, the counts zero
    after every launch. A merge that ran before the last chunk landed reads the stale chunks
    of the previous launch (another q, so another output)."""
    gen = torch.Generator().manual_seed(batch)
    lens = torch.randint(1, 4096 if batch <= 64 else 1024, (batch,), generator=gen).tolist()
    case = make_paged_case(lens, [1] * batch, 32, 8, 64, 16, torch.bfloat16, "cuda", seed=batch)
    case.store_new_kv()
    args = (case.q, case.k_buffer, case.v_buffer, case.req_to_token, case.req_pool_indices)
    counts = merge_counters(batch, 8, "cuda")
    scratch = decode_scratch(batch, 32, 64, splits, torch.device("cuda"))
    fused, kernel = torch.empty_like(case.q), torch.empty_like(case.q)
    qs = [torch.randn_like(case.q) for _ in range(4)]
    bad = 0
    for i in range(200):
        q = qs[i % 4]
        decode_attention(q, *args[1:], case.seq_lens, case.scale, num_splits=splits, out=fused,
                         scratch=scratch, merge_counter=counts)  # fmt: skip
        decode_attention(q, *args[1:], case.seq_lens, case.scale, num_splits=splits, out=kernel)
        # (bf16 outputs: the two sums may round a last bit apart)
        bad += not torch.allclose(fused.float(), kernel.float(), rtol=2e-2, atol=2e-2)
        assert not counts.any()
    assert bad == 0, f"{bad} of 200 launches differ"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads,kv_heads", HEADS)
def test_extend(heads, kv_heads, head_dim, page_size, dtype):
    prefix = [0, 0, 512, 37, 1500, 16]
    extend = [1, 700, 300, 129, 1, 64]
    case = make_paged_case(prefix, extend, heads, kv_heads, head_dim, page_size, dtype, "cuda",
                           seed=head_dim + page_size)  # fmt: skip
    args = (case.q, case.k, case.v, case.k_buffer, case.v_buffer, case.req_to_token)
    args += (case.req_pool_indices, case.prefix_lens, case.extend_lens, case.extend_start_loc)
    got = extend_attention(*args, case.max_extend_len, case.scale)
    _close(got, extend_attention_ref(*args, case.scale))


# Gemma's shapes at head_dim 256 (its own launch configs): gemma-2-2b's heads with its local
# window and soft cap, gemma-3-1b's with its window and no cap; plus a small cap that bends
# most scores. (window, cap): full attention with a cap, windowed with and without.
GEMMA_HEADS = [(8, 4), (4, 1)]
GEMMA_VARIANTS = [(-1, 50.0), (511, 50.0), (511, 0.0), (-1, 2.0)]


@pytest.mark.parametrize("window_left,cap", GEMMA_VARIANTS)
@pytest.mark.parametrize("heads,kv_heads", GEMMA_HEADS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_head_dim_256(dtype, heads, kv_heads, window_left, cap):
    prefix, extend = [0, 512, 37, 1500, 3000], [700, 300, 129, 1, 64]
    case = make_paged_case(prefix, extend, heads, kv_heads, 256, 16, dtype, "cuda", seed=5)
    args = (case.q, case.k, case.v, case.k_buffer, case.v_buffer, case.req_to_token)
    args += (case.req_pool_indices, case.prefix_lens, case.extend_lens, case.extend_start_loc)
    got = extend_attention(*args, case.max_extend_len, case.scale, window_left=window_left,
                           logit_cap=cap)  # fmt: skip
    _close(got, extend_attention_ref(*args, case.scale, window_left, cap))
    dec = make_paged_case(prefix, [1] * len(prefix), heads, kv_heads, 256, 16, dtype, "cuda",
                          seed=6)  # fmt: skip
    dec.store_new_kv()
    args = (dec.q, dec.k_buffer, dec.v_buffer, dec.req_to_token, dec.req_pool_indices)
    args += (dec.seq_lens, dec.scale)
    got = decode_attention(*args, window_left=window_left, logit_cap=cap)
    _close(got, decode_attention_ref(*args, window_left, cap))


def test_decode_replays_in_a_cuda_graph():
    """The launch shape depends on the batch size only: a captured decode stays right when
    the lengths and slots in the static inputs change between replays."""
    # float32: the poisoned slots read past the old lengths hold large values
    case = make_paged_case([100, 900, 33, 2000], [1] * 4, 32, 8, 128, 16, torch.float32, "cuda")
    case.store_new_kv()
    out = torch.empty_like(case.q)
    scratch = decode_scratch(4, 32, 128, 8, torch.device("cuda"))
    args = (case.q, case.k_buffer, case.v_buffer, case.req_to_token, case.req_pool_indices)
    decode_attention(*args, case.seq_lens, case.scale, out=out, scratch=scratch)  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention(*args, case.seq_lens, case.scale, out=out, scratch=scratch)
    for seq_lens in ([101, 901, 34, 2001], [1, 57, 2001, 640]):
        case.seq_lens.copy_(torch.tensor(seq_lens))
        graph.replay()
        torch.cuda.synchronize()
        want = decode_attention_ref(*args, case.seq_lens, case.scale)
        # the second replay's requests read poisoned slots (std 30): outputs up to ~30
        _close(out, want, size=max(1.0, want.abs().max().item()))


def test_fused_merge_replays_in_a_cuda_graph():
    """The fused merge's counts are zero again after each replay, so a captured launch keeps
    merging at the right program, replay after replay."""
    case = make_paged_case([100, 900, 33, 2000], [1] * 4, 32, 8, 128, 16, torch.float32, "cuda")
    case.store_new_kv()
    out = torch.empty_like(case.q)
    scratch = decode_scratch(4, 32, 128, 16, torch.device("cuda"))
    counts = merge_counters(4, 8, "cuda")
    args = (case.q, case.k_buffer, case.v_buffer, case.req_to_token, case.req_pool_indices)
    kw = {"out": out, "scratch": scratch, "num_splits": 16, "merge_counter": counts}
    decode_attention(*args, case.seq_lens, case.scale, **kw)  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention(*args, case.seq_lens, case.scale, **kw)
    for seq_lens in ([101, 901, 34, 2001], [1, 57, 2001, 640], [2001, 640, 1, 1]):
        case.seq_lens.copy_(torch.tensor(seq_lens))
        graph.replay()
        torch.cuda.synchronize()
        want = decode_attention_ref(*args, case.seq_lens, case.scale)
        _close(out, want, size=max(1.0, want.abs().max().item()))
        assert not counts.any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv(dtype):
    num_slots, kv_heads, head_dim, num_tokens = 50_000, 8, 128, 4096
    k_buf = torch.randn(num_slots, kv_heads, head_dim, device="cuda", dtype=dtype)
    v_buf = torch.randn_like(k_buf)
    qkv = torch.randn(num_tokens, 48 * head_dim, device="cuda", dtype=dtype)
    k, v = qkv[:, 32 * head_dim : 40 * head_dim], qkv[:, 40 * head_dim :]
    loc = torch.randperm(num_slots - 1, device="cuda")[:num_tokens] + 1
    want_k, want_v = k_buf.clone(), v_buf.clone()
    store_kv(k_buf, v_buf, loc, k, v)
    store_kv_ref(want_k, want_v, loc, k, v)
    assert torch.equal(k_buf, want_k) and torch.equal(v_buf, want_v)


def test_resolve_future_tokens():
    future = torch.randint(0, 150_000, (1024,), device="cuda")
    ids = torch.randint(0, 150_000, (8192,), device="cuda")
    ids[::3] = -torch.randint(1, 1024, (len(ids[::3]),), device="cuda")
    want = resolve_future_tokens_torch(ids.clone(), future)
    assert resolve_future_tokens(ids, future) is ids
    assert torch.equal(ids, want) and bool((ids >= 0).all())


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_float8_cache(head_dim, dtype, kv_dtype):
    """fp16/bf16 queries over a float8 pool (GQA 32/8, page 16): the kernels convert float8 as
    they load it; the reference reads the same values."""
    prefix = [1, 17, 255, 1000, 3000]
    case = make_paged_case(prefix, [1] * len(prefix), 32, 8, head_dim, 16, dtype, "cuda",
                           seed=head_dim).as_float8(kv_dtype)  # fmt: skip
    got, want = _decode(case)
    _close(got, want)
    case = make_paged_case([0, 512, 37, 1500], [700, 300, 129, 1], 32, 8, head_dim, 16, dtype,
                           "cuda", seed=head_dim).as_float8(kv_dtype)  # fmt: skip
    args = (case.q, case.k, case.v, case.k_buffer, case.v_buffer, case.req_to_token)
    args += (case.req_pool_indices, case.prefix_lens, case.extend_lens, case.extend_start_loc)
    got = extend_attention(*args, case.max_extend_len, case.scale)
    _close(got, extend_attention_ref(*args, case.scale))

"""The flashinfer backend's CPU-checkable parts.

* Page tables and query offsets against a per-token Python reference, on random paged batches
  (shuffled pages and rows, prefixes empty, whole and partial pages, page sizes 1 and 16).
* The log-sum-exp merge against attention over the union of the keys.
* The backend itself over a stand-in for flashinfer (`FakeFlashInfer`: the slice of the 0.6
  API the backend calls, computed with torch): decode, extend with and without a cached prefix,
  and the CUDA-graph capture/replay hooks (the stand-in's graph wrappers read only their fixed
  buffers, as captured kernels do), each against the torch_native backend. Every call the
  backend makes is recorded and, where flashinfer is installed, bound to the real signatures.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import random
from types import SimpleNamespace

import pytest
import torch

from engine.attention import flashinfer_backend as fib
from engine.attention import flashinfer_support, page_table
from engine.attention.base import create_attention_backend
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.mem_cache.kv_pool import KVPool
from kernels.testing import PagedCase, make_paged_case
from tests.factories import paged_case_batch

# -- page tables ----------------------------------------------------------------------------------


def _reference_table(case: PagedCase, kv_lens: list[int], page_size: int):
    indptr, indices, last = [0], [], []
    for row, kv_len in zip(case.req_pool_indices.tolist(), kv_lens):
        pages = []
        for j in range(kv_len):
            page = int(case.req_to_token[row, j]) // page_size
            if j % page_size == 0:
                pages.append(page)
            assert page == pages[-1], "the test batch must keep a page's keys together"
        indices += pages
        indptr.append(len(indices))
        last.append(kv_len - (len(pages) - 1) * page_size if pages else 0)
    return indptr, indices, last


def _random_lens(rng: random.Random, n: int, page_size: int) -> tuple[list[int], list[int]]:
    prefix = [rng.choice([0, page_size, 2 * page_size + 3, rng.randint(1, 90)]) for _ in range(n)]
    extend = [rng.randint(1, 40) for _ in range(n)]
    return prefix, extend


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("page_size", [1, 16])
def test_page_table_matches_reference(page_size, seed):
    prefix, extend = _random_lens(random.Random(seed), 7, page_size)
    case = make_paged_case(prefix, extend, 2, 1, 8, page_size, seed=seed)
    for kv_lens in (prefix, case.seq_lens.tolist()):  # an extend's prefix, a decode's context
        indptr, indices, last = _reference_table(case, kv_lens, page_size)
        # the lengths from the host only, and also on the device (no host-to-device copy)
        for on_device in (None, torch.tensor(kv_lens, dtype=torch.int64)):
            table = page_table.build_page_table(
                case.req_to_token, case.req_pool_indices, kv_lens, page_size, on_device
            )
            assert table.indptr.tolist() == indptr
            assert table.indices.tolist() == indices
            assert table.last_page_len.tolist() == last
            for t in (table.indptr, table.indices, table.last_page_len):
                assert t.dtype == torch.int32


def test_page_table_of_empty_prefixes():
    case = make_paged_case([0, 0], [5, 9], 2, 1, 8, page_size=16)
    table = page_table.build_page_table(case.req_to_token, case.req_pool_indices, [0, 0], 16)
    assert table.indptr.tolist() == [0, 0, 0]
    assert table.indices.numel() == 0
    assert table.last_page_len.tolist() == [0, 0]


def test_qo_indptr():
    assert page_table.build_qo_indptr([3, 1, 20]).tolist() == [0, 3, 4, 24]
    assert page_table.build_qo_indptr([3]).dtype == torch.int32


# -- merging partial attentions -------------------------------------------------------------------


def _attend(q, k, v, scale, causal=False, window_left=-1, cap=None):
    """q [n, Hq, D], k/v [m, Hk, D] -> out [n, Hq, D] in q's dtype, lse [n, Hq] (base 2, -inf
    without keys). Causal as in flashinfer: the last query sees every key, earlier ones fewer;
    query t sits at key position t + m - n, and window_left >= 0 hides the keys before that
    position minus window_left. `cap` > 0: the scores are cap * tanh(score / cap)."""
    n, m = q.shape[0], k.shape[0]
    if m == 0:
        return torch.zeros_like(q), torch.full(q.shape[:2], -math.inf)
    group = q.shape[1] // k.shape[1]
    k, v = (x.float().repeat_interleave(group, 1) for x in (k, v))
    logits = torch.einsum("nhd,mhd->hnm", q.float(), k) * scale
    if cap:
        logits = torch.tanh(logits / cap) * cap
    key, pos = torch.arange(m)[None, :], torch.arange(n)[:, None] + (m - n)
    if causal:
        logits = logits.masked_fill(key > pos, -math.inf)
    if window_left >= 0:
        logits = logits.masked_fill(key < pos - window_left, -math.inf)
    out = torch.einsum("hnm,mhd->nhd", logits.softmax(-1), v)
    return out.to(q.dtype), (logits.logsumexp(-1) / math.log(2)).T.contiguous()


def test_merge_states_torch_equals_attention_over_all_keys():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(5, 4, 16, generator=gen) for _ in range(3))
    want, _ = _attend(q, k, v, 0.3)
    out, lse = _attend(q, k[:2], v[:2], 0.3)
    page_table.merge_states_torch(out, lse, *_attend(q, k[2:], v[2:], 0.3))
    torch.testing.assert_close(out, want)
    empty_out, empty_lse = _attend(q, k[:0], v[:0], 0.3)  # a request without a cached prefix
    page_table.merge_states_torch(out, lse, empty_out, empty_lse)
    torch.testing.assert_close(out, want)


# -- a stand-in for flashinfer --------------------------------------------------------------------

CALLS: list[tuple[str, str, tuple, dict]] = []


def _recorded(method):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        CALLS.append((type(self).__name__, method.__name__, args, kwargs))
        return method(self, *args, **kwargs)

    return wrapper


def _paged_keys(cache, indptr, indices, last_page_len, i):
    """Request i's keys from a [pages, P, H, D] cache, read as flashinfer's kernels do."""
    pages = indices[int(indptr[i]) : int(indptr[i + 1])].long()
    num_keys = 0 if len(pages) == 0 else (len(pages) - 1) * cache.shape[1] + int(last_page_len[i])
    return cache[pages].flatten(0, 1)[:num_keys]


class _Wrapper:
    @_recorded
    def __init__(self, float_workspace_buffer, kv_layout="NHD", backend="auto"):
        assert kv_layout == "NHD"
        self.planned = None

    def _check(self, q, k, causal, window_left=-1, cap=None):
        assert self.planned is not None, "run before plan"
        assert (q.dtype, k.dtype) == self.planned["dtypes"], "flashinfer rejects other dtypes"
        assert causal == self.planned["causal"], "run with the mask the work was split for"
        # the kernel variant (sliding window or not, soft-capped or not) is picked by plan();
        # forward() resets both to its own arguments
        assert window_left == self.planned.get("window_left", -1), "window differs from plan"
        assert (cap or 0.0) == (self.planned["cap"] or 0.0), "soft cap differs from plan"


class BatchPrefillWithRaggedKVCacheWrapper(_Wrapper):
    @_recorded
    def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, causal=False,
             logits_soft_cap=None, sm_scale=None, q_data_type="float16",
             kv_data_type=None):  # fmt: skip
        assert qo_indptr.device.type == "cpu" and qo_indptr.dtype == torch.int32
        dtypes = (q_data_type, kv_data_type)
        self.planned = dict(
            qo=qo_indptr.tolist(), kv=kv_indptr.tolist(), causal=causal, dtypes=dtypes,
            cap=logits_soft_cap,
        )  # fmt: skip

    @_recorded
    def forward(self, q, k, v, causal=False, logits_soft_cap=None, sm_scale=None):
        return self.forward_return_lse(q, k, v, causal, logits_soft_cap, sm_scale)[0]

    @_recorded
    def forward_return_lse(self, q, k, v, causal=False, logits_soft_cap=None, sm_scale=None):
        self._check(q, k, causal, cap=logits_soft_cap)
        qo, kv = self.planned["qo"], self.planned["kv"]
        parts = [
            _attend(q[qo[i] : qo[i + 1]], k[kv[i] : kv[i + 1]], v[kv[i] : kv[i + 1]], sm_scale,
                    causal, cap=logits_soft_cap)
            for i in range(len(qo) - 1)
        ]  # fmt: skip
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
    @_recorded
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False,
                 qo_indptr_buf=None, paged_kv_indptr_buf=None, paged_kv_indices_buf=None,
                 paged_kv_last_page_len_buf=None, backend="auto"):  # fmt: skip
        assert kv_layout == "NHD"
        self.planned = None
        self.graph = use_cuda_graph
        self.buffers = (qo_indptr_buf, paged_kv_indptr_buf, paged_kv_indices_buf,
                        paged_kv_last_page_len_buf)  # fmt: skip
        self.max_rows = None

    @_recorded
    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
             num_qo_heads, num_kv_heads, head_dim_qk, page_size, causal=False, window_left=-1,
             logits_soft_cap=None, sm_scale=None, q_data_type="float16",
             kv_data_type=None, max_token_per_sequence=None):  # fmt: skip
        qo_lens = (qo_indptr[1:] - qo_indptr[:-1]).tolist()
        assert max_token_per_sequence in (None, max(qo_lens)), "flashinfer would trust it"
        table = (paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len)
        qo = qo_indptr
        if self.graph:  # what flashinfer does: copy into the buffers the graph will read
            qo_buf, indptr_buf, indices_buf, last_buf = self.buffers
            assert len(qo_indptr) == len(qo_buf), "graph batch size is fixed"
            rows = int(qo_indptr[-1])
            self.max_rows = rows if self.max_rows is None else self.max_rows
            assert rows <= self.max_rows, "no more rows than at the first plan"
            assert len(paged_kv_indices) <= len(indices_buf)
            qo_buf.copy_(qo_indptr)
            indptr_buf.copy_(paged_kv_indptr)
            last_buf.copy_(paged_kv_last_page_len)
            indices_buf[: len(paged_kv_indices)].copy_(paged_kv_indices)
            qo, table = qo_buf, (indptr_buf, indices_buf, last_buf)
        self.planned = dict(
            qo=qo, table=table, causal=causal, dtypes=(q_data_type, kv_data_type),
            window_left=window_left, cap=logits_soft_cap,
        )  # fmt: skip

    @_recorded
    def forward(self, q, paged_kv_cache, causal=False, window_left=-1, logits_soft_cap=None,
                sm_scale=None):  # fmt: skip
        return self.forward_return_lse(
            q, paged_kv_cache, causal, window_left, logits_soft_cap, sm_scale
        )[0]

    @_recorded
    def forward_return_lse(self, q, paged_kv_cache, causal=False, window_left=-1,
                           logits_soft_cap=None, sm_scale=None):  # fmt: skip
        k_cache, v_cache = paged_kv_cache
        self._check(q, k_cache, causal, window_left, logits_soft_cap)
        qo, table = self.planned["qo"].tolist(), self.planned["table"]
        parts = [
            _attend(q[qo[i] : qo[i + 1]], _paged_keys(k_cache, *table, i),
                    _paged_keys(v_cache, *table, i), sm_scale, causal, window_left,
                    logits_soft_cap)
            for i in range(len(qo) - 1)
        ]  # fmt: skip
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
    @_recorded
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False,
                 use_tensor_cores=False, paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
                 paged_kv_last_page_len_buffer=None, backend="auto"):  # fmt: skip
        self.planned = None
        self.graph = use_cuda_graph
        self.use_tensor_cores = use_tensor_cores
        self.buffers = (
            paged_kv_indptr_buffer,
            paged_kv_indices_buffer,
            paged_kv_last_page_len_buffer,
        )

    @_recorded
    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
             page_size, window_left=-1, logits_soft_cap=None, q_data_type="float16",
             kv_data_type=None, sm_scale=None):  # fmt: skip
        if self.graph:  # what flashinfer does: copy into the buffers the graph will read
            indptr_buf, indices_buf, last_buf = self.buffers
            assert len(last_page_len) == len(last_buf), "graph batch size is fixed"
            assert len(indices) <= len(indices_buf)
            indptr_buf.copy_(indptr)
            last_buf.copy_(last_page_len)
            indices_buf[: len(indices)].copy_(indices)
        else:
            self.buffers = (indptr.clone(), indices.clone(), last_page_len.clone())
        self.planned = dict(
            causal=False, dtypes=(q_data_type, kv_data_type), window_left=window_left,
            cap=logits_soft_cap,
        )  # fmt: skip

    @_recorded
    def forward(self, q, paged_kv_cache, window_left=-1, logits_soft_cap=None, sm_scale=None):
        k_cache, v_cache = paged_kv_cache
        self._check(q, k_cache, False, window_left, logits_soft_cap)
        parts = [
            _attend(q[i : i + 1], _paged_keys(k_cache, *self.buffers, i),
                    _paged_keys(v_cache, *self.buffers, i), sm_scale, False, window_left,
                    logits_soft_cap)[0]
            for i in range(q.shape[0])
        ]  # fmt: skip
        return torch.cat(parts)


def merge_state_in_place(v, s, v_other, s_other, mask=None):
    CALLS.append(("", "merge_state_in_place", (v, s, v_other, s_other), {}))
    logits = torch.stack([s, s_other]) * math.log(2)
    weights = logits.softmax(0)[..., None]
    v.copy_(weights[0] * v.float() + weights[1] * v_other.float())
    s.copy_(logits.logsumexp(0) / math.log(2))


FAKE_FLASHINFER = SimpleNamespace(
    BatchPrefillWithRaggedKVCacheWrapper=BatchPrefillWithRaggedKVCacheWrapper,
    BatchPrefillWithPagedKVCacheWrapper=BatchPrefillWithPagedKVCacheWrapper,
    BatchDecodeWithPagedKVCacheWrapper=BatchDecodeWithPagedKVCacheWrapper,
    merge_state_in_place=merge_state_in_place,
)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    monkeypatch.setattr(fib, "load_flashinfer", lambda device: FAKE_FLASHINFER)
    CALLS.clear()
    return CALLS


# -- the backend over the stand-in, against torch_native ------------------------------------------


def _layer(
    num_heads: int, num_kv_heads: int, head_dim: int, window: int | None = None,
    cap: float | None = None,
) -> SimpleNamespace:
    return SimpleNamespace(
        layer_id=1, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        scaling=0.7 * head_dim**-0.5,  # not the planned default: each layer passes its own
        sliding_window=window, logit_cap=cap,
    )  # fmt: skip


def _pool(
    case: PagedCase, layer, dtype: torch.dtype, page_size: int, kv_dtype=None, scales=None
) -> KVPool:
    """The case's prefix K/V in layer 1 of a pool (stored in float8 `kv_dtype`, divided by
    `scales` = (k_scale, v_scale), when given)."""
    pool = KVPool(case.k_buffer.shape[0], 2, layer.num_kv_heads, layer.head_dim, dtype,
                  page_size=page_size, kv_cache_dtype=kv_dtype)  # fmt: skip
    if scales is not None:
        pool.set_scales({1: scales})
    k, v = pool.quantize(1, case.k_buffer.to(dtype), case.v_buffer.to(dtype))
    pool.k_buffer[1].copy_(k)
    pool.v_buffer[1].copy_(v)
    return pool


_batch = paged_case_batch


def _flashinfer(layer, pool, page_size: int, windows: tuple | None = None, **options):
    """The backend for a model whose layers have `windows` (default: `layer`'s alone) and
    `layer`'s soft cap (and the backend's `options`)."""
    windows = (layer.sliding_window,) if windows is None else windows
    config = SimpleNamespace(
        num_heads=layer.num_heads, num_kv_heads=layer.num_kv_heads, head_dim=layer.head_dim,
        sliding_windows=windows, attn_logit_cap=layer.logit_cap,
    )  # fmt: skip
    return create_attention_backend(
        "flashinfer",
        device="cpu",
        model_config=config,
        kv_pool=pool,
        page_size=page_size,
        workspace_bytes=64,
        **options,
    )


def _run(name, case, layer, mode, page_size, rows=None, windows=None, kv_dtype=None, scales=None):
    """One layer of `case` through backend `name` (flashinfer in bfloat16 over the stand-in,
    for a model whose layers have `windows`; torch_native in float32 on the same values); its
    output and the pool after (a float8 one with `kv_dtype`)."""
    rows = list(range(len(case.seq_lens))) if rows is None else rows
    dtype = torch.bfloat16 if name == "flashinfer" else torch.float32
    pool = _pool(case, layer, dtype, page_size, kv_dtype, scales)
    if name == "flashinfer":
        backend = _flashinfer(layer, pool, page_size, windows)
    else:
        backend = create_attention_backend(name, device="cpu")
    fb = _batch(case, mode, pool, backend, rows)
    backend.init_forward_metadata(fb)
    picked = slice(None) if mode.is_extend() else rows
    q, k, v = (x[picked].to(dtype).flatten(1) for x in (case.q, case.k, case.v))
    return backend.forward(q, k, v, layer, fb).float(), pool


HEADS = [(8, 2), (4, 4)]  # GQA group 4 (tensor-core decode) and MHA


@pytest.mark.parametrize("heads,kv_heads", HEADS)
@pytest.mark.parametrize(
    "prefix_lens,extend_lens,mode,page_size",
    [
        ([0, 0, 0], [7, 20, 1], ForwardMode.EXTEND, 16),  # no prefix: the ragged kernel alone
        ([0, 21, 40], [7, 3, 1], ForwardMode.EXTEND, 1),
        ([16, 5, 0, 37], [20, 2, 9, 16], ForwardMode.EXTEND, 16),
        ([40, 0, 7, 63], [1, 20, 1, 1], ForwardMode.EXTEND, 16),  # mixed: decode rows + a prompt
        ([0, 33, 70, 15], [1, 1, 1, 1], ForwardMode.DECODE, 16),
        ([3, 33, 70], [1, 1, 1], ForwardMode.DECODE, 1),
    ],
)
def test_backend_matches_torch_native(
    fake_flashinfer, heads, kv_heads, prefix_lens, extend_lens, mode, page_size
):
    start = len(fake_flashinfer)
    case = make_paged_case(prefix_lens, extend_lens, heads, kv_heads, 64, page_size,
                           dtype=torch.bfloat16, seed=page_size)  # fmt: skip
    layer = _layer(heads, kv_heads, 64)
    got, got_pool = _run("flashinfer", case, layer, mode, page_size)
    want, want_pool = _run("torch_native", case, layer, mode, page_size)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=1e-2)
    assert torch.equal(got_pool.k_buffer[1].float(), want_pool.k_buffer[1])  # K/V stored
    assert torch.equal(got_pool.v_buffer[1].float(), want_pool.v_buffer[1])
    merged = any(c[1] == "merge_state_in_place" for c in fake_flashinfer[start:])
    assert merged == (mode.is_extend() and any(prefix_lens))


@pytest.mark.parametrize(
    "prefix_lens,extend_lens,mode",
    [
        ([16, 5, 0, 37], [20, 2, 9, 16], ForwardMode.EXTEND),  # ragged + paged, merged
        ([0, 0], [7, 20], ForwardMode.EXTEND),  # ragged alone
        ([0, 33, 70, 15], [1, 1, 1, 1], ForwardMode.DECODE),
    ],
)
def test_fp8_cache_matches_torch_native(fake_flashinfer, prefix_lens, extend_lens, mode):
    """A float8 cache with scales: the paged and decode wrappers are planned with float8 K/V,
    the ragged one with the new tokens' stored values in bfloat16 (the stand-in rejects any
    other dtype pair), k_scale in the softmax scale and v_scale on the output; the pools hold
    the same bytes."""
    start = len(fake_flashinfer)
    case = make_paged_case(prefix_lens, extend_lens, 8, 2, 64, 16, dtype=torch.bfloat16,
                           seed=5)  # fmt: skip
    layer = _layer(8, 2, 64)
    fp8 = dict(kv_dtype=torch.float8_e4m3fn, scales=(0.5, 2.0))
    got, got_pool = _run("flashinfer", case, layer, mode, 16, **fp8)
    want, want_pool = _run("torch_native", case, layer, mode, 16, **fp8)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=1e-2)
    plain, _ = _run("torch_native", case, layer, mode, 16)
    assert (plain - want).abs().max() > 0.05  # float8 rounding shows (the bar above can fail)
    assert got_pool.k_buffer[1].dtype == torch.float8_e4m3fn
    assert torch.equal(
        got_pool.k_buffer[1].view(torch.uint8), want_pool.k_buffer[1].view(torch.uint8)
    )
    assert torch.equal(
        got_pool.v_buffer[1].view(torch.uint8), want_pool.v_buffer[1].view(torch.uint8)
    )
    planned = [c for c in fake_flashinfer[start:] if c[1] == "plan"]
    kv_dtypes = {c[0]: c[3]["kv_data_type"] for c in planned}
    assert kv_dtypes.pop("BatchPrefillWithRaggedKVCacheWrapper", torch.bfloat16) == torch.bfloat16
    assert set(kv_dtypes.values()) == ({torch.float8_e4m3fn} if any(prefix_lens) else set())
    runs = [c for c in fake_flashinfer[start:] if "forward" in c[1] and "sm_scale" in c[3]]
    scales = {c[3]["sm_scale"] for c in runs}  # (the backend's calls, by keyword)
    assert scales == {layer.scaling * 0.5}


def _graph_batch(case: PagedCase, pool, backend, bs: int, pad_row: int) -> ForwardBatch:
    """Static buffers as a graph runner holds them: every row padded (seq_len 1, slot 0)."""
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=bs,
        input_ids=torch.zeros(bs, dtype=torch.int64),
        positions=torch.zeros(bs, dtype=torch.int64),
        out_cache_loc=torch.zeros(bs, dtype=torch.int64),
        req_pool_indices=torch.full((bs,), pad_row, dtype=torch.int64),
        seq_lens=torch.ones(bs, dtype=torch.int64),
        seq_lens_cpu=[1] * bs,
        req_to_token=case.req_to_token,
        kv_pool=pool,
        attn_backend=backend,
    )


def _fill(fb: ForwardBatch, case: PagedCase, rows: list[int], pad_row: int) -> None:
    """Copy real requests into the static batch, padding the rest as the runner does."""
    n, bs = len(rows), fb.batch_size
    fb.out_cache_loc.zero_()[:n] = case.out_cache_loc[rows]
    fb.req_pool_indices.fill_(pad_row)[:n] = case.req_pool_indices[rows]
    fb.seq_lens.fill_(1)[:n] = case.seq_lens[rows]
    fb.seq_lens_cpu = case.seq_lens[rows].tolist() + [1] * (bs - n)


def graph_page_ids(backend, in_graph: bool) -> None:
    """After `init_cuda_graph_state`: whether the graphs write their page ids themselves
    (`cuda_graph_prologue`). A GPU does; on CPU the page-table kernel runs in Triton's
    interpreter, which the backend does not choose by itself."""
    if in_graph and page_table.page_ids is None:
        pytest.skip("Triton is not installed")
    backend.graph_page_ids = in_graph


def replay_page_ids(backend, fb: ForwardBatch, in_graph: bool) -> None:
    """The replay's plan (outside the graph) and the graph's prologue: with the page ids in the
    graph, the plan leaves the buffer as it was (zeroed here) and the prologue fills it."""
    indices = backend.graph_buffers.indices.zero_()
    backend.init_forward_metadata_replay_cuda_graph(fb)
    assert bool(indices.any()) is not in_graph, "the plan wrote the page ids"
    backend.cuda_graph_prologue(fb)
    assert indices.any()


@pytest.mark.parametrize("heads,kv_heads", HEADS)
@pytest.mark.parametrize("in_graph", [False, True], ids=["ids-at-replay", "ids-in-graph"])
def test_graph_replay_reads_the_refreshed_tables(fake_flashinfer, heads, kv_heads, in_graph):
    page_size, bs = 16, 4
    case = make_paged_case([100, 37, 250, 3, 16, 64], [1] * 6, heads, kv_heads, 64, page_size,
                           dtype=torch.bfloat16, seed=3)  # fmt: skip
    pad_row = case.req_to_token.shape[0]
    case.req_to_token = torch.cat([case.req_to_token, torch.zeros_like(case.req_to_token[:1])])
    layer = _layer(heads, kv_heads, 64)
    pool = _pool(case, layer, torch.bfloat16, page_size)
    backend = _flashinfer(layer, pool, page_size)
    backend.init_cuda_graph_state(max_bs=8, max_context_len=case.req_to_token.shape[1])
    graph_page_ids(backend, in_graph)
    fb = _graph_batch(case, pool, backend, bs, pad_row)
    backend.init_forward_metadata_capture_cuda_graph(fb)
    static_qkv = [torch.zeros(bs, x.shape[1] * x.shape[2], dtype=torch.bfloat16)
                  for x in (case.q, case.k, case.v)]  # fmt: skip
    backend.cuda_graph_prologue(fb)  # what the capture records
    backend.forward(*static_qkv, layer, fb)
    captured = backend.metadata.wrapper
    for rows in ([0, 1, 2], [5, 3, 4, 2]):
        _fill(fb, case, rows, pad_row)
        for static, x in zip(static_qkv, (case.q, case.k, case.v)):
            static.zero_()[: len(rows)] = x[rows].flatten(1)
        replay_page_ids(backend, fb, in_graph)
        assert backend.metadata.wrapper is captured
        got = backend.forward(*static_qkv, layer, fb)[: len(rows)].float()  # "replay"
        want, _ = _run("torch_native", case, layer, ForwardMode.DECODE, page_size, rows)
        torch.testing.assert_close(got, want, atol=2e-2, rtol=1e-2)


def _verify_graph_batch(case: PagedCase, pool, backend, bs: int, width: int, pad_row: int):
    """Static buffers as the verify graph runner holds them: every request padded (`width`
    tokens over the padding row, slot 0)."""
    m = bs * width
    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=bs,
        input_ids=torch.zeros(m, dtype=torch.int64),
        positions=torch.zeros(m, dtype=torch.int64),
        out_cache_loc=torch.zeros(m, dtype=torch.int64),
        req_pool_indices=torch.full((bs,), pad_row, dtype=torch.int64),
        seq_lens=torch.full((bs,), width, dtype=torch.int64),
        seq_lens_cpu=[width] * bs,
        req_to_token=case.req_to_token,
        kv_pool=pool,
        attn_backend=backend,
        extend_prefix_lens_cpu=[0] * bs,
        extend_seq_lens_cpu=[width] * bs,
        extend_start_loc=torch.arange(0, m, width),
        extend_seq_lens=torch.full((bs,), width, dtype=torch.int64),
        return_all_logits=True,
    )


@pytest.mark.parametrize("heads,kv_heads", HEADS)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("in_graph", [False, True], ids=["ids-at-replay", "ids-in-graph"])
@pytest.mark.parametrize("window", [None, 40])
def test_verify_graph_replay_matches_torch_native(
    fake_flashinfer, heads, kv_heads, page_size, in_graph, window, decode_graphs=True
):
    """A speculative verify graph (engine/speculative/verify_graphs.py) over the stand-in:
    captured over padding, replayed for batches whose requests have 1..width tokens (padded
    to width, their padding tokens' K/V to slot 0, the padded keys past each request's real
    length pointing at poisoned slots); every real token's output equals torch_native's over
    the unpadded extend; a sliding-window model's through its windowed wrappers."""
    width, bs = 4, 4
    prefix, extend = [100, 37, 250, 3, 16, 64], [4, 1, 3, 2, 4, 1]
    case = make_paged_case(prefix, extend, heads, kv_heads, 64, page_size, dtype=torch.bfloat16,
                           seed=5)  # fmt: skip
    layer = _layer(heads, kv_heads, 64, window)
    want, _ = _run("torch_native", case, layer, ForwardMode.EXTEND, page_size)
    rows_table = case.req_to_token
    # room for each request's padded length, the new columns pointing anywhere; a padding row
    gen = torch.Generator().manual_seed(1)
    extra = torch.randint(0, case.k_buffer.shape[0], (rows_table.shape[0], width),
                          dtype=torch.int32, generator=gen)  # fmt: skip
    case.req_to_token = torch.cat([rows_table, extra], 1)
    pad_row = case.req_to_token.shape[0]
    case.req_to_token = torch.cat([case.req_to_token, torch.zeros_like(case.req_to_token[:1])])
    pool = _pool(case, layer, torch.bfloat16, page_size)
    backend = _flashinfer(layer, pool, page_size)
    cols = case.req_to_token.shape[1]
    if decode_graphs:  # (else a hybrid's prefill backend: the verify state makes the buffer)
        backend.init_cuda_graph_state(max_bs=8, max_context_len=cols)
    backend.init_verify_cuda_graph_state(max_bs=8, width=width, max_context_len=cols)
    graph_page_ids(backend, in_graph)
    fb = _verify_graph_batch(case, pool, backend, bs, width, pad_row)
    backend.init_forward_metadata_capture_cuda_graph(fb)
    static = [torch.zeros(bs * width, x.shape[1] * x.shape[2], dtype=torch.bfloat16)
              for x in (case.q, case.k, case.v)]  # fmt: skip
    backend.cuda_graph_prologue(fb)  # what the capture records
    backend.forward(*static, layer, fb)
    captured = backend.metadata
    assert (captured.wrapper is None) == (window is not None)
    starts = case.extend_start_loc.tolist()
    for rows in ([0, 1, 2], [5, 3, 4, 2]):
        places, tokens = [], []
        for x in static:
            x.zero_()
        fb.out_cache_loc.zero_()
        fb.req_pool_indices.fill_(pad_row)
        fb.seq_lens.fill_(width)
        for i, r in enumerate(rows):
            e, p = extend[r], prefix[r]
            mine = list(range(starts[r], starts[r] + e))
            places += range(i * width, i * width + e)
            tokens += mine
            for x, src in zip(static, (case.q, case.k, case.v)):
                x[i * width : i * width + e] = src[mine].flatten(1)
            fb.out_cache_loc[i * width : i * width + e] = case.out_cache_loc[mine]
            fb.req_pool_indices[i] = case.req_pool_indices[r]
            fb.seq_lens[i] = p + width
        fb.seq_lens_cpu = fb.seq_lens.tolist()
        fb.extend_prefix_lens_cpu = [n - width for n in fb.seq_lens_cpu]
        replay_page_ids(backend, fb, in_graph)
        assert backend.metadata == captured
        got = backend.forward(*static, layer, fb).float()  # "replay"
        torch.testing.assert_close(got[places], want[tokens], atol=2e-2, rtol=1e-2)


def test_verify_graphs_without_decode_graphs(fake_flashinfer):
    """A backend that captures only verify graphs (the prefill backend of flashinfer prefill
    with Triton decode, the GPU's default) makes its page-id buffer itself."""
    test_verify_graph_replay_matches_torch_native(fake_flashinfer, 8, 2, 16, False, None,
                                                  decode_graphs=False)  # fmt: skip


def test_unsupported_setups_fail_at_construction(fake_flashinfer):
    layer = _layer(4, 4, 64)
    case = make_paged_case([3], [1], 4, 4, 64)
    with pytest.raises(ValueError, match="triton"):
        _flashinfer(layer, _pool(case, layer, torch.float32, 1), 1)
    odd = make_paged_case([3], [1], 4, 4, 16)
    with pytest.raises(ValueError, match="head_dim"):
        _flashinfer(_layer(4, 4, 16), _pool(odd, _layer(4, 4, 16), torch.bfloat16, 1), 1)


@pytest.mark.parametrize(
    "heads,kv_heads,option,want",
    [(8, 2, "auto", True), (8, 4, "auto", False), (8, 2, "off", False), (8, 8, "on", True)],
)
def test_decode_tensor_cores_option(fake_flashinfer, heads, kv_heads, option, want):
    """flashinfer_decode_tensor_cores: auto (from 4 query heads per KV head on), or forced;
    the decode wrappers, eager and captured, are made with it."""
    layer = _layer(heads, kv_heads, 64)
    pool = _pool(make_paged_case([3], [1], heads, kv_heads, 64), layer, torch.bfloat16, 1)
    backend = _flashinfer(layer, pool, 1, decode_tensor_cores=option)
    backend.init_cuda_graph_state(2, 8)
    for wrapper in (backend.decode[0], backend._decode_wrappers(graph_bs=2)[0]):
        assert wrapper.use_tensor_cores is want


def test_no_cuda_fails_at_construction():
    if torch.cuda.is_available():
        pytest.skip("the machine has CUDA")
    assert not flashinfer_support.flashinfer_available()
    layer = _layer(4, 4, 64)
    pool = _pool(make_paged_case([3], [1], 4, 4, 64), layer, torch.bfloat16, 1)
    with pytest.raises(RuntimeError, match="CUDA"):
        _flashinfer(layer, pool, 1)


# -- the calls against the real API --------------------------------------------------------------


def test_calls_bind_to_the_real_flashinfer_signatures(fake_flashinfer):
    """Where flashinfer is installed (not needed on CPU): every call the backend made in a
    decode, an extend with a prefix, a decode and a verify graph's capture/replay fits the real
    signatures."""
    real = pytest.importorskip("flashinfer")
    test_backend_matches_torch_native(fake_flashinfer, 8, 2, [16, 0], [5, 3],
                                      ForwardMode.EXTEND, 16)  # fmt: skip
    test_backend_matches_torch_native(fake_flashinfer, 4, 4, [16, 0], [1, 1],
                                      ForwardMode.DECODE, 16)  # fmt: skip
    test_graph_replay_reads_the_refreshed_tables(fake_flashinfer, 8, 2, True)  # (a GPU's way)
    test_verify_graph_replay_matches_torch_native(fake_flashinfer, 8, 2, 16, True, None)
    methods = {(cls, name) for cls, name, _, _ in fake_flashinfer}
    assert len(methods) >= 9, methods
    for cls, name, args, kwargs in fake_flashinfer:
        if not cls:
            inspect.signature(getattr(real, name)).bind(*args, **kwargs)
            continue
        real_cls = getattr(real, cls)
        # decode plan() takes **kwargs and hands them to _plan_impl
        func = getattr(real_cls, "_plan_impl", None) if name == "plan" else None
        inspect.signature(func or getattr(real_cls, name)).bind(None, *args, **kwargs)


def test_decode_tensor_cores_option_is_checked():
    from engine.config import EngineArgs

    with pytest.raises(ValueError, match="flashinfer_decode_tensor_cores"):
        EngineArgs(model_path="m", flashinfer_decode_tensor_cores="maybe")


class _FakeRing:
    """Stands for `PinnedRing` on a machine without pinned memory or CUDA events."""

    def __init__(self, device, size=8, nbytes=8 << 20):
        self.nbytes, self.synchronized = nbytes, False
        self.buffer = torch.zeros(nbytes, dtype=torch.uint8)

    def synchronize(self):
        self.synchronized = True

    @contextlib.contextmanager
    def stage(self):
        yield self.buffer


def test_table_ring_grows_for_batches_with_more_rows(fake_flashinfer, monkeypatch):
    """The pinned ring of host tables is sized at the first plan from `req_to_token`'s rows; a
    later batch with more rows (the hybrid window backend's batches have one per request) gets
    a larger ring, made after the old one's pending copies are done, and plans over it."""
    monkeypatch.setattr(fib, "PinnedRing", _FakeRing)
    layer = _layer(8, 2, 64)
    small = make_paged_case([40, 7], [1, 30], 8, 2, 64, page_size=16)
    big = make_paged_case([33] * 40, [1] * 39 + [250], 8, 2, 64, page_size=16)
    backend = _flashinfer(layer, _pool(small, layer, torch.bfloat16, 16), 16)
    backend.pinned_ring = _FakeRing(None)  # (CUDA's: the tables stage in `table_ring`)

    def extend(case):
        pool = _pool(case, layer, torch.bfloat16, 16)
        backend.init_forward_metadata(_batch(case, ForwardMode.EXTEND, pool, backend))
        return backend.table_ring

    first = extend(small)
    assert first.nbytes < 4 * (5 * 40 + 3)
    grown = extend(big)
    assert first.synchronized and grown is not first and grown.nbytes >= 4 * (5 * 40 + 3)
    assert extend(small) is grown and extend(big) is grown

"""`DecodePlanner`'s fast re-plan of decode wrappers and `PrefillPlanner`'s of paged prefill
wrappers (engine/attention/flashinfer_plan.py) against flashinfer's own `plan`, on the installed
flashinfer's real wrappers.

Its C++ planner is replaced by a recorder: a plan's result is a snapshot of the arguments it was
called with. Each case plans two wrappers over the same batches, one always with flashinfer's
`plan`, the other through `DecodePlanner`; after every plan both must have made the same
planner call and hold the same state (every attribute, tensors by value). flashinfer imports
on a CPU machine (CI installs it without its CUDA dependencies); its kernels are not run.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from engine.attention import flashinfer_plan
from engine.attention.flashinfer_plan import (
    DecodePlanner,
    PrefillPlanner,
    fast_replan_supported,
)
from engine.attention.page_table import build_page_table
from engine.forward_batch import ForwardMode
from tests.flashinfer_cpu import SHARED_BYTES, Recorder, stubbed_planners, unpinned

fi = pytest.importorskip("flashinfer")

HEADS = dict(num_qo_heads=32, num_kv_heads=8, head_dim=64)
SCALARS = dict(q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, sm_scale=0.125,
               logits_soft_cap=0.0)  # fmt: skip


@pytest.fixture
def recorder():
    with stubbed_planners(fi, Recorder()) as module:
        yield module


def _pair(tensor_cores=True, graph_bs=None, max_pages=4096):
    """Two wrappers sharing their workspaces (so their planner calls can be compared)."""
    workspace = torch.zeros(1 << 20, dtype=torch.uint8)
    wrappers = []
    for _ in range(2):
        kwargs = {}
        if graph_bs is not None:
            kwargs = dict(
                use_cuda_graph=True,
                paged_kv_indptr_buffer=torch.zeros(graph_bs + 1, dtype=torch.int32),
                paged_kv_indices_buffer=torch.zeros(max_pages, dtype=torch.int32),
                paged_kv_last_page_len_buffer=torch.zeros(graph_bs, dtype=torch.int32),
            )
        with unpinned():
            wrappers.append(fi.BatchDecodeWithPagedKVCacheWrapper(
                workspace, "NHD", use_tensor_cores=tensor_cores, backend="fa2", **kwargs
            ))  # fmt: skip
    ours, theirs = wrappers
    ours._int_workspace_buffer = theirs._int_workspace_buffer
    ours._pin_memory_int_workspace_buffer = theirs._pin_memory_int_workspace_buffer
    return ours, theirs


def _table(lens, page_size):
    """A page table of requests with `lens` keys over a shuffled pool."""
    rows = len(lens)
    width = -(-max(lens) // page_size) * page_size
    pages = torch.randperm(rows * width // page_size + 5)[: rows * width // page_size]
    req_to_token = (pages.view(rows, -1).repeat_interleave(page_size, 1) * page_size
                    + torch.arange(page_size).repeat(width // page_size))  # fmt: skip
    return build_page_table(req_to_token, torch.arange(rows), lens, page_size, use_kernel=False)


def _in_buffer(table, buffer):
    """The table with its page ids in `buffer` (a graph's), as the backend writes them."""
    n = len(table.indices)
    buffer[:n].copy_(table.indices)
    return type(table)(table.indptr, buffer[:n], table.last_page_len)


def _same_state(ours, theirs):
    keys = set(vars(ours)) | set(vars(theirs))
    for key in sorted(keys):
        a, b = vars(ours).get(key, "<missing>"), vars(theirs).get(key, "<missing>")
        if key == "_kv_lens_buffer" and isinstance(a, torch.Tensor):  # each one's own: a plan
            # fills its head
            n = ours._batch_size
            assert a.shape == b.shape and torch.equal(a[:n], b[:n]), key
        elif isinstance(a, torch.Tensor) and a.numel() * a.element_size() <= SHARED_BYTES:
            assert isinstance(b, torch.Tensor), key
            assert (a.dtype, a.shape) == (b.dtype, b.shape), key
            assert torch.equal(a, b), key
        elif isinstance(a, torch.Tensor):
            assert a is b, key
        else:
            assert a == b, f"{key}: {a!r} != {b!r}"


def _plan_both(planner, ours, theirs, recorder, lens, page_size, window_left=-1,
               scalars=SCALARS):  # fmt: skip
    table = _table(lens, page_size)
    theirs_table = table
    if ours.is_cuda_graph_enabled:
        table = _in_buffer(table, ours._paged_kv_indices_buf)
        theirs_table = _in_buffer(table, theirs._paged_kv_indices_buf)
    theirs.plan(theirs_table.indptr, theirs_table.indices, theirs_table.last_page_len,
                *HEADS.values(), page_size, window_left=window_left, **scalars)  # fmt: skip
    expected = recorder.calls[-1]
    planner.plan(ours, table, lens, *HEADS.values(), page_size, window_left=window_left,
                 **scalars)  # fmt: skip
    assert recorder.calls[-1] == expected
    _same_state(ours, theirs)


@pytest.mark.parametrize("tensor_cores", [True, False])
@pytest.mark.parametrize("page_size", [1, 16])
def test_eager_replans_match_flashinfer(recorder, page_size, tensor_cores):
    ours, theirs = _pair(tensor_cores)
    planner = DecodePlanner(fi)
    assert planner.enabled
    rng = np.random.default_rng(page_size)
    sizes = [3, 64, 1, 256, 17, 64]
    for i, bs in enumerate(sizes):
        lens = [int(x) for x in rng.integers(1, 300, bs)]
        _plan_both(planner, ours, theirs, recorder, lens, page_size)
        assert planner.fast_plans == i  # the first plan is flashinfer's own


@pytest.mark.parametrize("tensor_cores", [True, False])
@pytest.mark.parametrize("page_size", [1, 16])
def test_graph_replans_match_flashinfer(recorder, page_size, tensor_cores):
    """A graph's wrapper: tables copied into its buffers, page ids already in place."""
    ours, theirs = _pair(tensor_cores, graph_bs=8)
    planner = DecodePlanner(fi)
    rng = np.random.default_rng(7)
    for i in range(5):
        lens = [int(x) for x in rng.integers(1, 200, 8)]
        lens[-2:] = [1, 1]  # graph padding rows
        _plan_both(planner, ours, theirs, recorder, lens, page_size)
        assert planner.fast_plans == i


def test_a_graph_wrapper_refuses_another_batch_size(recorder):
    ours, _ = _pair(graph_bs=4)
    planner = DecodePlanner(fi)
    for _ in range(2):
        planner.plan(ours, _table([5] * 4, 16), [5] * 4, *HEADS.values(), 16, **SCALARS)
    assert planner.fast_plans == 1
    with pytest.raises(ValueError, match="4 requests"):
        planner.plan(ours, _table([5] * 3, 16), [5] * 3, *HEADS.values(), 16, **SCALARS)


@pytest.mark.parametrize("tensor_cores", [True, False])
def test_a_new_configuration_is_planned_by_flashinfer(recorder, tensor_cores):
    """A window, another scale or dtype: flashinfer's plan again (it may load another module),
    then fast re-plans under the new configuration."""
    ours, theirs = _pair(tensor_cores)
    planner = DecodePlanner(fi)
    lens = [40, 9, 130]
    _plan_both(planner, ours, theirs, recorder, lens, 16)
    _plan_both(planner, ours, theirs, recorder, lens, 16)
    assert planner.fast_plans == 1
    _plan_both(planner, ours, theirs, recorder, lens, 16, window_left=31)
    assert planner.fast_plans == 1
    _plan_both(planner, ours, theirs, recorder, lens, 16, window_left=31)
    assert planner.fast_plans == 2
    half = {**SCALARS, "q_data_type": torch.float16, "kv_data_type": torch.float16}
    _plan_both(planner, ours, theirs, recorder, lens, 16, scalars=half)
    assert planner.fast_plans == 2


@pytest.mark.parametrize("tensor_cores", [True, False])
@pytest.mark.parametrize("options", [
    dict(kv_data_type=torch.float8_e4m3fn),  # an FP8 KV cache
    dict(logits_soft_cap=50.0),  # Gemma 2
    dict(q_data_type=torch.float16, kv_data_type=None, logits_soft_cap=30.0),
])  # fmt: skip
def test_replans_of_other_configurations_match_flashinfer(recorder, tensor_cores, options):
    ours, theirs = _pair(tensor_cores)
    planner = DecodePlanner(fi)
    scalars = {**SCALARS, **options}
    for lens in ([5, 70, 300], [6, 71, 301], [1, 2]):
        _plan_both(planner, ours, theirs, recorder, lens, 16, window_left=63, scalars=scalars)
    assert planner.fast_plans == 2


# -- paged prefill (extend batches) ------------------------------------------------------------


def _prefill_pair(graph_bs=None, max_pages=4096):
    workspace = torch.zeros(1 << 20, dtype=torch.uint8)

    def graph_kwargs():
        if graph_bs is None:
            return {}
        return dict(
            use_cuda_graph=True, qo_indptr_buf=torch.zeros(graph_bs + 1, dtype=torch.int32),
            paged_kv_indptr_buf=torch.zeros(graph_bs + 1, dtype=torch.int32),
            paged_kv_indices_buf=torch.zeros(max_pages, dtype=torch.int32),
            paged_kv_last_page_len_buf=torch.zeros(graph_bs, dtype=torch.int32),
        )  # fmt: skip

    with unpinned():
        ours, theirs = (fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2",
                                                               **graph_kwargs())
                        for _ in range(2))  # fmt: skip
    ours._int_workspace_buffer = theirs._int_workspace_buffer
    ours._pin_memory_int_workspace_buffer = theirs._pin_memory_int_workspace_buffer
    return ours, theirs


def _plan_prefill_both(planner, ours, theirs, recorder, qo_lens, kv_lens, page_size,
                       causal=False, window_left=-1, scalars=SCALARS):  # fmt: skip
    table = theirs_table = _table(kv_lens, page_size)
    if ours.is_cuda_graph_enabled:
        table = _in_buffer(table, ours._paged_kv_indices_buf)
        theirs_table = _in_buffer(table, theirs._paged_kv_indices_buf)
    qo_indptr = torch.tensor(np.concatenate([[0], np.cumsum(qo_lens)]), dtype=torch.int32)
    theirs.plan(qo_indptr, theirs_table.indptr, theirs_table.indices,
                theirs_table.last_page_len, *HEADS.values(),
                page_size, causal=causal, window_left=window_left,
                max_token_per_sequence=max(qo_lens), **scalars)  # fmt: skip
    expected = recorder.calls[-1]
    planner.plan(ours, qo_indptr, table, qo_lens, *HEADS.values(), page_size, causal=causal,
                 window_left=window_left, **scalars)  # fmt: skip
    assert recorder.calls[-1] == expected
    _same_state(ours, theirs)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("causal,window_left", [(False, -1), (True, -1), (True, 40)])
def test_prefill_replans_match_flashinfer(recorder, page_size, causal, window_left):
    """Extend batches: a prompt chunk over a cached prefix and decode rows mixed in, requests
    without a prefix (no keys in the table), growing and shrinking batches."""
    ours, theirs = _prefill_pair()
    planner = PrefillPlanner(fi)
    rng = np.random.default_rng(page_size + window_left)
    for i, bs in enumerate([4, 64, 1, 256, 9, 64]):
        qo_lens = [1] * (bs - 1) + [int(rng.integers(1, 300))]
        kv_lens = [int(x) for x in rng.integers(0, 400, bs)]
        kv_lens[-1] = max(kv_lens[-1], 1)
        if bs > 2:
            kv_lens[0] = 0  # no cached prefix
        _plan_prefill_both(planner, ours, theirs, recorder, qo_lens, kv_lens, page_size,
                           causal, window_left)  # fmt: skip
        assert planner.fast_plans == i


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("window_left", [-1, 40])
def test_verify_graph_prefill_replans_match_flashinfer(recorder, page_size, window_left):
    """A verify graph's wrapper (engine/speculative/verify_graphs.py): a fixed number of
    requests of `width` queries each over changing contexts (padding requests: `width` keys),
    its tables copied into its buffers, the page ids already in place."""
    bs, width = 8, 4
    ours, theirs = _prefill_pair(graph_bs=bs)
    planner = PrefillPlanner(fi)
    rng = np.random.default_rng(page_size + window_left + 1)
    for i in range(5):
        real = [1, 3, 8, 5, 8][i]
        kv_lens = [int(x) + width for x in rng.integers(0, 500, real)] + [width] * (bs - real)
        # (a verify graph's queries are always `width` a request; any fewer fit the wrapper)
        qo_lens = [width] * bs if i % 2 == 0 else [int(x) for x in rng.integers(1, width, bs)]
        _plan_prefill_both(planner, ours, theirs, recorder, qo_lens, kv_lens, page_size,
                           True, window_left)  # fmt: skip
        assert planner.fast_plans == i
    with pytest.raises(ValueError, match="plans 8 requests"):
        planner.plan(ours, torch.arange(0, 20, width, dtype=torch.int32),
                     _table([30] * 4, page_size), [width] * 4, *HEADS.values(), page_size,
                     causal=True, window_left=window_left, **SCALARS)  # fmt: skip


def test_a_new_prefill_configuration_is_planned_by_flashinfer(recorder):
    ours, theirs = _prefill_pair()
    planner = PrefillPlanner(fi)
    qo_lens, kv_lens = [1, 1, 50], [30, 99, 16]
    for causal, fast_after in ((False, 0), (False, 1), (True, 1), (True, 2)):
        _plan_prefill_both(planner, ours, theirs, recorder, qo_lens, kv_lens, 16, causal)
        assert planner.fast_plans == fast_after
    capped = {**SCALARS, "logits_soft_cap": 50.0, "kv_data_type": torch.float8_e4m3fn}
    for fast_after in (2, 3):
        _plan_prefill_both(planner, ours, theirs, recorder, qo_lens, kv_lens, 16, True,
                           scalars=capped)  # fmt: skip
        assert planner.fast_plans == fast_after


def test_other_flashinfer_versions_always_take_flashinfers_plan(recorder, monkeypatch):
    monkeypatch.setattr(fi, "__version__", "0.6.99")
    assert not fast_replan_supported(fi)
    ours, theirs = _pair()
    planner = DecodePlanner(fi)
    for lens in ([5, 70], [6, 71], [7, 72]):
        _plan_both(planner, ours, theirs, recorder, lens, 16)
    assert planner.fast_plans == 0
    ours, theirs = _prefill_pair()
    planner = PrefillPlanner(fi)
    for lens in ([5, 70], [6, 71], [7, 72]):
        _plan_prefill_both(planner, ours, theirs, recorder, [1, 9], lens, 16)
    assert planner.fast_plans == 0


def test_the_installed_flashinfer_is_one_the_replan_was_checked_against():
    """CI pins flashinfer (`.ci/run`): a new pin must be checked by this module's cases and
    added to `VALIDATED_VERSIONS`, else the backend silently plans the slow way."""
    assert fi.__version__ in flashinfer_plan.VALIDATED_VERSIONS


# -- the backend: its decode plans, fast or not, make the same planner calls ---------------------


def _without_buffers(call):
    """A planner call with the workspaces (each backend has its own) left out."""
    return tuple(a for a in call if not (isinstance(a, tuple) and a[:1] == ("buffer",)))


def _backend_decode_calls(monkeypatch, recorder, heads, kv_heads, fast, graph):
    """The planner calls of a flashinfer backend (the real wrappers, on CPU) over a series of
    decode batches, with fast re-plans on or off; and how many were fast."""
    from engine.attention import flashinfer_backend as fib
    from tests.unit import test_flashinfer_indices as t

    monkeypatch.setattr(fib, "load_flashinfer", lambda device: fi)
    page_size, bs = 16, 4
    case = t.make_paged_case([100, 37, 250, 3, 16, 64], [1] * 6, heads, kv_heads, 64, page_size,
                             dtype=torch.bfloat16, seed=3)  # fmt: skip
    pad_row = case.req_to_token.shape[0]
    case.req_to_token = torch.cat([case.req_to_token, torch.zeros_like(case.req_to_token[:1])])
    layer = t._layer(heads, kv_heads, 64)
    pool = t._pool(case, layer, torch.bfloat16, page_size)
    with unpinned():  # (the wrappers are made here, and at the capture)
        backend = t._flashinfer(layer, pool, page_size)
        if graph:
            backend.init_cuda_graph_state(max_bs=8, max_context_len=case.req_to_token.shape[1])
            fb = t._graph_batch(case, pool, backend, bs, pad_row)
            backend.init_forward_metadata_capture_cuda_graph(fb)
    backend.decode_planner.enabled = fast
    start = len(recorder.calls) - (1 if graph else 0)
    if graph:
        for rows in ([0, 1, 2], [5, 3, 4, 2], [1]):
            t._fill(fb, case, rows, pad_row)
            backend.init_forward_metadata_replay_cuda_graph(fb)
    else:
        for rows in ([0, 1, 2], [5, 3, 4, 2, 0], [1]):
            backend.init_forward_metadata(t._batch(case, ForwardMode.DECODE, pool, backend, rows))
    calls = [_without_buffers(c) for c in recorder.calls[start:]]
    return calls, backend.decode_planner.fast_plans


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4)])
def test_backend_decode_plans_match_flashinfers(monkeypatch, recorder, heads, kv_heads, graph):
    """GQA group 4 (tensor-core decode) and MHA (CUDA-core decode): every plan after the
    first is fast and calls the planner as flashinfer's plan does."""
    fast, fast_plans = _backend_decode_calls(monkeypatch, recorder, heads, kv_heads, True, graph)
    slow, slow_fast_plans = _backend_decode_calls(monkeypatch, recorder, heads, kv_heads, False,
                                                  graph)  # fmt: skip
    assert len(fast) == (4 if graph else 3)
    assert fast == slow
    assert slow_fast_plans == 0
    assert fast_plans == len(fast) - 1


def _backend_extend_calls(monkeypatch, recorder, fast):
    """The planner calls of a flashinfer backend with full and windowed layers over a series
    of extend batches (prompt chunks over cached prefixes, decode rows mixed in), with fast
    re-plans on or off; and how many were fast."""
    from engine.attention import flashinfer_backend as fib
    from tests.unit import test_flashinfer_indices as t

    monkeypatch.setattr(fib, "load_flashinfer", lambda device: fi)
    case = t.make_paged_case([40, 0, 7, 63, 100, 16], [1, 20, 1, 1, 30, 1], 8, 2, 64, 16,
                             dtype=torch.bfloat16, seed=5)  # fmt: skip
    layer = t._layer(8, 2, 64)
    pool = t._pool(case, layer, torch.bfloat16, 16)
    with unpinned():
        backend = t._flashinfer(layer, pool, 16, windows=(None, 32))
    backend.prefill_planner.enabled = fast
    whole = t._batch(case, ForwardMode.EXTEND, pool, backend)
    start = len(recorder.calls)
    for rows in ([0, 1, 2], [3, 4, 0, 2], [1], [0, 1, 2, 3, 4, 5], [4]):
        extend = [whole.extend_seq_lens_cpu[i] for i in rows]  # (planning reads no tokens)
        backend.init_forward_metadata(dataclasses.replace(
            whole, batch_size=len(rows), req_pool_indices=whole.req_pool_indices[rows],
            seq_lens=whole.seq_lens[rows], seq_lens_cpu=[whole.seq_lens_cpu[i] for i in rows],
            extend_prefix_lens_cpu=[whole.extend_prefix_lens_cpu[i] for i in rows],
            extend_seq_lens_cpu=extend,
            extend_start_loc=torch.tensor(np.cumsum([0] + extend[:-1])),
        ))  # fmt: skip
    calls = [_without_buffers(c) for c in recorder.calls[start:]]
    return calls, backend.prefill_planner.fast_plans


def test_backend_extend_plans_match_flashinfers(monkeypatch, recorder):
    """The paged prefill wrappers (the prefix's, full layers; the whole context's, windowed
    layers) are re-planned fast after their first plan, with flashinfer's planner calls."""
    fast, fast_plans = _backend_extend_calls(monkeypatch, recorder, True)
    slow, slow_fast_plans = _backend_extend_calls(monkeypatch, recorder, False)
    assert fast == slow
    assert slow_fast_plans == 0
    # per batch: the windowed wrapper, the ragged one, and the prefix's where there is one
    # (every batch but [1]: a prompt without a cached prefix); all but each one's first fast
    assert len(fast) == 5 * 2 + 4
    assert fast_plans == 5 + 4 - 2

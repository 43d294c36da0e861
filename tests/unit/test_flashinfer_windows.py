"""The flashinfer backend's sliding-window and soft-capped layers, over the stand-in for
flashinfer of test_flashinfer_indices.py (which computes flashinfer's masks, window included,
with torch), against the torch_native backend.

A windowed layer attends with wrappers planned with `window_left`: the paged prefill wrapper
over each request's whole context (causal, the new tokens' K/V already in the pool) and a
decode wrapper of its own; full layers of the same model keep the ragged + prefix path. The
stand-in refuses a run whose window differs from its plan's, as flashinfer's kernel variant is
chosen at plan time. The same holds for Gemma 2's attention soft-cap (`logits_soft_cap`): every
wrapper is planned with the model's cap, and every forward passes it again.
"""

from __future__ import annotations

import pytest
import torch

from engine.attention import flashinfer_backend as fib
from engine.forward_batch import ForwardMode
from kernels.testing import make_paged_case
from tests.factories import paged_case_batch
from tests.unit.test_flashinfer_indices import (
    CALLS,
    FAKE_FLASHINFER,
    _fill,
    _flashinfer,
    _graph_batch,
    _layer,
    _pool,
    _run,
    graph_page_ids,
    replay_page_ids,
)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    monkeypatch.setattr(fib, "load_flashinfer", lambda device: FAKE_FLASHINFER)
    CALLS.clear()
    return CALLS

WINDOW = 9
CAP = 0.6  # the stand-in cases' bf16 scores reach a few units: most are bent
CASES = [
    ([0, 0, 0], [7, 20, 1], ForwardMode.EXTEND, 16),  # no prefix
    ([16, 5, 0, 37], [20, 2, 9, 16], ForwardMode.EXTEND, 16),
    ([40, 0, 7, 63], [1, 20, 1, 1], ForwardMode.EXTEND, 1),  # mixed: decode rows + a prompt
    ([0, 33, 70, 15], [1, 1, 1, 1], ForwardMode.DECODE, 16),
]


def _case(prefix_lens, extend_lens, heads, kv_heads, page_size, seed=0):
    return make_paged_case(prefix_lens, extend_lens, heads, kv_heads, 64, page_size,
                           dtype=torch.bfloat16, seed=seed)  # fmt: skip


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4)])
@pytest.mark.parametrize("prefix_lens,extend_lens,mode,page_size", CASES)
def test_windowed_layer_matches_torch_native(
    fake_flashinfer, heads, kv_heads, prefix_lens, extend_lens, mode, page_size
):
    case = _case(prefix_lens, extend_lens, heads, kv_heads, page_size)
    layer = _layer(heads, kv_heads, 64, WINDOW)
    got, _ = _run("flashinfer", case, layer, mode, page_size)
    want, _ = _run("torch_native", case, layer, mode, page_size)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=1e-2)
    full, _ = _run("torch_native", case, _layer(heads, kv_heads, 64), mode, page_size)
    assert (full - want).abs().max() > 0.1  # the window changed the answer
    # a model of windowed layers only plans no ragged or decode-full wrapper
    planned = {(cls, name) for cls, name, _, _ in fake_flashinfer if name == "plan"}
    assert ("BatchPrefillWithRaggedKVCacheWrapper", "plan") not in planned


@pytest.mark.parametrize("prefix_lens,extend_lens,mode,page_size", CASES)
def test_full_and_windowed_layers_of_one_model(fake_flashinfer, prefix_lens, extend_lens, mode,
                                               page_size):  # fmt: skip
    """Qwen2-style: some layers full, some windowed, one plan per batch serving both."""
    case = _case(prefix_lens, extend_lens, 8, 2, page_size, seed=1)
    windows = (None, WINDOW)
    for window in windows:
        layer = _layer(8, 2, 64, window)
        got, _ = _run("flashinfer", case, layer, mode, page_size, windows=windows)
        want, _ = _run("torch_native", case, layer, mode, page_size)
        torch.testing.assert_close(got, want, atol=2e-2, rtol=1e-2, msg=f"window {window}")


@pytest.mark.parametrize("cap", [None, CAP], ids=["plain", "soft-capped"])
@pytest.mark.parametrize("in_graph", [False, True], ids=["ids-at-replay", "ids-in-graph"])
def test_graph_replay_of_a_windowed_model(fake_flashinfer, cap, in_graph):
    page_size, bs = 16, 4
    case = _case([100, 37, 250, 3, 16, 64], [1] * 6, 8, 2, page_size, seed=3)
    pad_row = case.req_to_token.shape[0]
    case.req_to_token = torch.cat([case.req_to_token, torch.zeros_like(case.req_to_token[:1])])
    layers = [_layer(8, 2, 64, w, cap=cap) for w in (None, WINDOW)]
    pool = _pool(case, layers[0], torch.bfloat16, page_size)
    backend = _flashinfer(layers[0], pool, page_size, windows=(None, WINDOW))
    backend.init_cuda_graph_state(max_bs=8, max_context_len=case.req_to_token.shape[1])
    graph_page_ids(backend, in_graph)
    fb = _graph_batch(case, pool, backend, bs, pad_row)
    backend.init_forward_metadata_capture_cuda_graph(fb)
    static_qkv = [torch.zeros(bs, x.shape[1] * x.shape[2], dtype=torch.bfloat16)
                  for x in (case.q, case.k, case.v)]  # fmt: skip
    captured = (backend.metadata.wrapper, backend.metadata.window_wrapper)
    assert captured[1] is not None and captured[1].graph
    for rows in ([0, 1, 2], [5, 3, 4, 2]):
        _fill(fb, case, rows, pad_row)
        for static, x in zip(static_qkv, (case.q, case.k, case.v), strict=True):
            static.zero_()[: len(rows)] = x[rows].flatten(1)
        replay_page_ids(backend, fb, in_graph)
        assert (backend.metadata.wrapper, backend.metadata.window_wrapper) == captured
        for layer in layers:
            got = backend.forward(*static_qkv, layer, fb)[: len(rows)].float()  # "replay"
            want, _ = _run("torch_native", case, layer, ForwardMode.DECODE, page_size, rows)
            torch.testing.assert_close(got, want, atol=2e-2, rtol=1e-2)


def test_two_windows_in_one_model_fail_at_construction(fake_flashinfer):
    layer = _layer(4, 4, 64)
    pool = _pool(make_paged_case([3], [1], 4, 4, 64), layer, torch.bfloat16, 1)
    with pytest.raises(ValueError, match="one sliding window"):
        _flashinfer(layer, pool, 1, windows=(8, 16))


@pytest.mark.parametrize("prefix_lens,extend_lens,mode,page_size", CASES)
@pytest.mark.parametrize("windows", [(None,), (None, WINDOW)], ids=["full", "gemma2"])
def test_soft_capped_layers_match_torch_native(fake_flashinfer, prefix_lens, extend_lens, mode,
                                               page_size, windows):  # fmt: skip
    """Gemma 2: full and windowed layers, all capped; every plan and forward carries the cap
    (the stand-in refuses a forward whose cap differs from its plan's)."""
    case = _case(prefix_lens, extend_lens, 8, 2, page_size, seed=5)
    first_call = len(fake_flashinfer)
    for window in windows:
        layer = _layer(8, 2, 64, window, cap=CAP)
        got, _ = _run("flashinfer", case, layer, mode, page_size, windows=windows)
        want, _ = _run("torch_native", case, layer, mode, page_size)
        torch.testing.assert_close(got, want, atol=2e-2, rtol=1e-2, msg=f"window {window}")
        plain, _ = _run("torch_native", case, _layer(8, 2, 64, window), mode, page_size)
        assert (plain - want).abs().max() > 0.1  # the cap changed the answer
    plans = [kwargs for _, name, _, kwargs in fake_flashinfer[first_call:] if name == "plan"]
    assert plans and all(kwargs["logits_soft_cap"] == CAP for kwargs in plans)


def test_a_layer_whose_cap_was_not_planned_is_refused(fake_flashinfer):
    case = _case([3, 5], [1, 1], 4, 4, 1)
    layer, capped = _layer(4, 4, 64), _layer(4, 4, 64, cap=CAP)
    pool = _pool(case, layer, torch.bfloat16, 1)
    backend = _flashinfer(layer, pool, 1)  # a model without a cap
    fb = paged_case_batch(case, ForwardMode.DECODE, pool, backend)
    backend.init_forward_metadata(fb)
    q, k, v = (x.to(torch.bfloat16).flatten(1) for x in (case.q, case.k, case.v))
    backend.forward(q, k, v, layer, fb)
    with pytest.raises(AssertionError, match="logit cap"):
        backend.forward(q, k, v, capped, fb)


def test_window_calls_bind_to_the_real_flashinfer_signatures(fake_flashinfer):
    import inspect

    real = pytest.importorskip("flashinfer")
    test_full_and_windowed_layers_of_one_model(fake_flashinfer, *CASES[1])
    test_full_and_windowed_layers_of_one_model(fake_flashinfer, *CASES[3])
    test_graph_replay_of_a_windowed_model(fake_flashinfer, None, True)  # (a GPU's way)
    test_soft_capped_layers_match_torch_native(fake_flashinfer, *CASES[1], (None, WINDOW))
    test_graph_replay_of_a_windowed_model(fake_flashinfer, CAP, False)
    windowed = [c for c in fake_flashinfer if c[3].get("window_left", -1) >= 0]
    assert {(cls, name) for cls, name, _, _ in windowed} == {
        ("BatchPrefillWithPagedKVCacheWrapper", "plan"),
        ("BatchPrefillWithPagedKVCacheWrapper", "forward"),
        ("BatchDecodeWithPagedKVCacheWrapper", "plan"),
        ("BatchDecodeWithPagedKVCacheWrapper", "forward"),
    }
    for cls, name, args, kwargs in fake_flashinfer:
        if not cls:
            continue
        real_cls = getattr(real, cls)
        func = getattr(real_cls, "_plan_impl", None) if name == "plan" else None
        inspect.signature(func or getattr(real_cls, name)).bind(None, *args, **kwargs)

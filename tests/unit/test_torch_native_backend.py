"""The torch_native backend (the CPU default) against the per-request reference
(`kernels.reference.extend_attention_ref`) on extend batches of every layout it plans
differently: prompts only, one-token rows only (planned as decode), and mixed batches, whose
one-token rows (running requests' decode steps, `--enable-mixed-chunk`) are attended apart;
and sliding-window layers (plain and soft-capped), which gather only their window's keys."""

from __future__ import annotations

import pytest
import torch

from engine.attention.base import create_attention_backend
from engine.attention.torch_native_plan import MixedPlan, Plan
from engine.forward_batch import ForwardMode
from engine.mem_cache.kv_pool import KVPool
from kernels.reference import extend_attention_ref
from kernels.testing import make_paged_case
from tests.factories import paged_case_batch


class _Layer:
    layer_id = 0
    num_heads, num_kv_heads, head_dim = 4, 2, 32
    scaling = 32**-0.5


def _run(case, layer) -> tuple[torch.Tensor, object, torch.Tensor]:
    """One layer over the case's EXTEND batch: its output, the backend's plan, and the
    per-request reference's output (`window_left` and `logit_cap` from the layer)."""
    pool = KVPool(case.k_buffer.shape[0], 1, 2, 32, torch.float32, "cpu")
    pool.k_buffer[0].copy_(case.k_buffer)
    pool.v_buffer[0].copy_(case.v_buffer)
    backend = create_attention_backend("torch_native", device="cpu")
    fb = paged_case_batch(case, ForwardMode.EXTEND, pool, backend)
    backend.init_forward_metadata(fb)
    q, k, v = (x.reshape(x.shape[0], -1) for x in (case.q, case.k, case.v))
    got = backend.forward(q, k, v, layer, fb).view_as(case.q)
    case.store_new_kv()  # the reference reads the pool with the new K/V in place
    window = getattr(layer, "sliding_window", None)
    want = extend_attention_ref(
        case.q, case.k, case.v, case.k_buffer, case.v_buffer, case.req_to_token,
        case.req_pool_indices, case.prefix_lens, case.extend_lens, case.extend_start_loc,
        case.scale, window_left=-1 if window is None else window - 1,
        logit_cap=getattr(layer, "logit_cap", None) or 0.0,
    )  # fmt: skip
    return got, backend.metadata, want


@pytest.mark.parametrize(
    "prefix_lens,extend_lens,page_size,planned",
    [
        ([0, 12, 30], [9, 4, 17], 1, "extend"),
        ([0, 12, 30], [1, 1, 1], 16, "decode"),
        ([40, 0, 7, 63, 5], [1, 20, 1, 1, 33], 1, "mixed"),  # decode rows around prompts
        ([16, 3, 0], [48, 1, 1], 16, "mixed"),
    ],
)
def test_extend_batches_match_the_reference(prefix_lens, extend_lens, page_size, planned):
    case = make_paged_case(prefix_lens, extend_lens, 4, 2, 32, page_size, seed=3)
    got, md, want = _run(case, _Layer())
    kind = "mixed" if isinstance(md, MixedPlan) else ("decode" if md.decode else "extend")
    assert kind == planned
    if isinstance(md, MixedPlan):
        assert all(isinstance(p.md, Plan) for p in md.parts)
        assert md.parts[1].md.max_q_len == max(extend_lens)  # decode rows are not padded
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


class _WindowedLayer(_Layer):
    sliding_window = 6
    logit_cap: float | None = None


def _plans(md: Plan | MixedPlan) -> list[Plan]:
    return [p.md for p in md.parts] if isinstance(md, MixedPlan) else [md]


@pytest.mark.parametrize("cap", [None, 0.5], ids=["plain", "soft-capped"])
@pytest.mark.parametrize(
    "prefix_lens,extend_lens,page_size",
    [
        ([0, 12, 30], [9, 4, 17], 1),  # prompts beside chunks with a cached prefix
        ([0, 12, 30, 3], [1, 1, 1, 1], 16),  # decode: some requests shorter than the window
        ([40, 0, 7, 63, 5], [1, 20, 1, 1, 33], 1),  # mixed: decode rows around prompts
        ([16, 3, 0], [48, 1, 1], 16),
        ([0, 0], [30, 11], 1),  # no prefix: the chunk spans the whole gather (masked only)
    ],
)
def test_windowed_layers_gather_only_the_window(prefix_lens, extend_lens, page_size, cap):
    """A sliding-window layer against the reference, and its gather: each request's keys
    from its first query's window on (at most `window` for decode rows), not its whole
    context."""
    layer = _WindowedLayer()
    layer.logit_cap = cap
    window = layer.sliding_window
    case = make_paged_case(prefix_lens, extend_lens, 4, 2, 32, page_size, seed=5)
    got, plan, want = _run(case, layer)
    for md in _plans(plan):
        if md.max_seq_len <= window:
            assert not md.windows  # nothing to hide: the plain plan
            continue
        spans = [n - max(0, p - window + 1) for n, p in zip(md.seq_lens, md.first_q_pos)]
        assert md.windows[window].length == min(max(spans), md.max_seq_len)
        if md.decode:
            assert md.windows[window].length <= window < md.max_seq_len
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

"""TritonAttnBackend (in the Triton interpreter on CPU, compiled on CUDA): against
TorchNativeAttnBackend on one layer of hand-built batches, and end to end through the Engine
on a tiny model (the logits of every step equal the torch_native run's)."""

from __future__ import annotations

import pytest
import torch

from kernels.testing import PagedCase, make_paged_case, triton_test_device

DEVICE, SKIP_REASON = triton_test_device()  # before anything imports triton
if SKIP_REASON:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from engine.attention.base import create_attention_backend  # noqa: E402
from engine.forward_batch import ForwardMode  # noqa: E402
from engine.mem_cache.kv_pool import KVPool  # noqa: E402
from tests.factories import paged_case_batch  # noqa: E402


class _Layer:
    layer_id = 1
    num_heads, num_kv_heads, head_dim = 4, 2, 64
    scaling = 0.125
    sliding_window: int | None = None
    logit_cap: float | None = None


def _forward(
    name: str,
    case: PagedCase,
    mode: ForwardMode,
    window: int | None = None,
    cap: float | None = None,
) -> tuple[torch.Tensor, KVPool]:
    layer = _Layer()
    layer.sliding_window, layer.logit_cap = window, cap
    num_slots = case.k_buffer.shape[0]
    pool = KVPool(num_slots, 2, layer.num_kv_heads, layer.head_dim, torch.float32, DEVICE)
    pool.k_buffer[1].copy_(case.k_buffer)
    pool.v_buffer[1].copy_(case.v_buffer)
    backend = create_attention_backend(name, device=DEVICE)
    fb = paged_case_batch(case, mode, pool, backend)
    backend.init_forward_metadata(fb)
    q, k, v = (x.reshape(x.shape[0], -1) for x in (case.q, case.k, case.v))
    return backend.forward(q, k, v, layer, fb), pool


@pytest.mark.parametrize(
    "window,cap", [(None, None), (9, None), (9, 0.5)], ids=["full", "sliding9", "sliding9-cap"]
)
@pytest.mark.parametrize(
    "prefix_lens,extend_lens,mode,page_size",
    [
        ([0, 21, 40], [7, 3, 1], ForwardMode.EXTEND, 1),
        ([16, 5], [20, 2], ForwardMode.EXTEND, 16),
        ([0, 33, 70], [1, 1, 1], ForwardMode.DECODE, 16),
    ],
)
def test_backend_matches_torch_native(prefix_lens, extend_lens, mode, page_size, window, cap):
    case = make_paged_case(prefix_lens, extend_lens, 4, 2, 64, page_size, device=DEVICE)
    got, got_pool = _forward("triton", case, mode, window, cap)
    want, want_pool = _forward("torch_native", case, mode, window, cap)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    assert torch.equal(got_pool.k_buffer[1], want_pool.k_buffer[1])  # K/V stored first
    assert torch.equal(got_pool.v_buffer[1], want_pool.v_buffer[1])


def _engine_logits(
    path: str, backend: str, page_size: int, check: object = None, **kwargs: object
) -> list[torch.Tensor]:
    """Greedy generation in two rounds (the second hits the radix cache); the logits of
    every forward step, in order. `check(runner)` runs on the model runner first."""
    from engine.engine import Engine

    engine = Engine(
        model_path=path,
        device=DEVICE,
        attention_backend=backend,
        page_size=page_size,
        max_total_tokens=1024,
        disable_overlap_schedule=True,
        skip_tokenizer_init=True,
        **kwargs,
    )
    runner = engine.scheduler.model_runner
    if check is not None:
        check(runner)
    steps: list[torch.Tensor] = []
    forward = runner.forward
    runner.forward = lambda fb: steps.append(forward(fb).clone()) or steps[-1]
    first = list(range(20, 41))  # 21 tokens: one full page is cached after round one
    sp = {"max_new_tokens": 4, "temperature": 0}
    engine.generate(input_ids=[first, [7, 8, 9]], sampling_params=sp)
    out = engine.generate(input_ids=[first[:18] + [50, 51]], sampling_params=sp)
    assert out[0]["meta_info"]["cached_tokens"] >= 16
    engine.shutdown()
    return steps


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma2", "deepseek_v3"])
def test_engine_logits_match_torch_native(arch):
    from tests.factories import tiny_model

    # 2 layers, 4 query heads over 2 KV heads, head_dim 16 (mistral: each layer sees its last
    # 8 keys, fewer than the 21-token prompt and its cached 16; gemma2: layer 0 too, both
    # soft-capped at 50; deepseek_v3: 4 heads over one latent K/V head of 48, not a power of
    # two, in the shared pool)
    windowed = arch in ("mistral", "gemma2")
    path = tiny_model(arch, sliding_window=8) if windowed else tiny_model(arch)
    got = _engine_logits(path, "triton", page_size=16)
    want = _engine_logits(path, "torch_native", page_size=16)
    assert len(got) == len(want) > 2
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4, msg=f"step {step}")


def test_engine_with_the_merge_kernel_matches_torch_native():
    """--triton-decode-merge kernel (the split merge as a second launch) gives torch_native's
    logits too, and the fused default leaves its counts at zero after every step."""
    from tests.factories import tiny_model

    path = tiny_model("llama")
    backends = []
    fused = _engine_logits(path, "triton", 16, check=lambda r: backends.append(r.attn_backend))
    assert backends[0].fused_merge and not backends[0]._merge_counts.any()
    kernel = _engine_logits(path, "triton", 16, triton_decode_merge="kernel")
    want = _engine_logits(path, "torch_native", 16)
    for step, (f, k, w) in enumerate(zip(fused, kernel, want, strict=True)):
        torch.testing.assert_close(k, w, atol=1e-4, rtol=1e-4, msg=f"step {step}")
        torch.testing.assert_close(f, k, atol=1e-5, rtol=1e-5, msg=f"step {step}")


def test_fused_merge_counts_stay_where_graphs_captured_them():
    """The counts' buffer is sized for the largest captured batch before any capture, so every
    captured size uses the same one; a larger eager batch gets a new buffer and the old one is
    kept alive (graphs replay into it)."""
    import types

    mc = types.SimpleNamespace(num_heads=4, num_kv_heads=2, head_dim=16)
    backend = create_attention_backend("triton", device=DEVICE, model_config=mc)
    backend.init_cuda_graph_state(max_bs=8, max_context_len=64)
    captured = backend._merge_counts
    assert captured.numel() == 8 * 2 and not captured.any()
    for bs in (1, 2, 8):
        assert backend.merge_counts(bs * 2).data_ptr() == captured.data_ptr()
    bigger = backend.merge_counts(40 * 2)
    assert bigger.numel() == 80 and bigger.data_ptr() != captured.data_ptr()
    assert backend._retired_counts == [captured]


@pytest.mark.parametrize("hybrid_swa", [False, True], ids=["one-pool", "hybrid-swa-memory"])
@pytest.mark.parametrize("prefill,decode", [("torch_native", "triton"), ("triton", "torch_native")])
def test_engine_with_one_backend_per_phase_matches_torch_native(prefill, decode, hybrid_swa):
    """--prefill-attention-backend / --decode-attention-backend: each batch goes to its
    phase's backend over the shared pool (a request prefilled by one decodes with the other),
    and the logits are the single backend's."""
    from engine.attention.hybrid_attn import HybridAttnBackend
    from tests.factories import tiny_model

    path = tiny_model("mistral", sliding_window=8)
    memory = dict(hybrid_swa_memory=True, chunked_prefill_size=64, swa_full_tokens_ratio=0.5)
    memory = memory if hybrid_swa else {}
    calls: dict[str, list[str]] = {"prefill": [], "decode": []}

    def spy(runner) -> None:
        hybrid = runner.attn_backend
        if hybrid_swa:  # (every layer of the tiny Mistral is windowed: its swa backend)
            assert hybrid.full is None
            hybrid = hybrid.swa
        assert isinstance(hybrid, HybridAttnBackend)
        triton = hybrid.decode if decode == "triton" else hybrid.prefill
        assert triton.num_kv_splits == 3  # --triton-attention-num-kv-splits
        for phase in calls:
            backend = getattr(hybrid, phase)
            plan = backend.init_forward_metadata

            def spied(fb, plan=plan, phase=phase):
                calls[phase].append(fb.forward_mode.name)
                return plan(fb)

            backend.init_forward_metadata = spied

    got = _engine_logits(path, "torch_native", 16, spy, prefill_attention_backend=prefill,
                         decode_attention_backend=decode, triton_attention_num_kv_splits=3,
                         **memory)  # fmt: skip
    want = _engine_logits(path, "torch_native", page_size=16, **memory)
    assert set(calls["prefill"]) == {"EXTEND"} and set(calls["decode"]) == {"DECODE"}
    assert len(got) == len(want) == len(calls["prefill"]) + len(calls["decode"])
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4, msg=f"step {step}")


def test_split_count_flag_or_by_batch_size():
    """--triton-attention-num-kv-splits fixes the count; without it the count follows the
    batch size (on CPU from a pretend GPU of 4 SMs, 1-4 splits, so the graph tests see it
    change between captured sizes). Each captured size decodes into a contiguous view of one
    graph scratch that holds the largest of them."""
    import types

    fixed = create_attention_backend("triton", device=DEVICE, num_kv_splits=3)
    assert {fixed.kv_splits(bs, 2) for bs in (1, 2, 64)} == {3}
    mc = types.SimpleNamespace(num_heads=4, num_kv_heads=2, head_dim=16)
    auto = create_attention_backend("triton", device=DEVICE, model_config=mc)
    if DEVICE != "cpu":
        assert auto.kv_splits(1, 8) == 32 and auto.kv_splits(64, 8) == 8
        return
    assert [auto.kv_splits(bs, 2) for bs in (1, 2, 3, 4, 8)] == [4, 2, 1, 1, 1]
    auto.init_cuda_graph_state(max_bs=8, max_context_len=64)
    mid_o, mid_lse = auto._graph_scratch
    assert mid_o.numel() == 8 * 4 * 16 and mid_lse.numel() == 8 * 4  # 8 x 1 > 1 x 4 = 2 x 2
    for bs, splits in ((1, 4), (2, 2), (8, 1)):
        auto.init_forward_metadata_capture_cuda_graph(
            types.SimpleNamespace(forward_mode=ForwardMode.DECODE, batch_size=bs)
        )
        md = auto.metadata
        assert md.num_splits == splits
        assert md.scratch[0].shape == (bs, 4, splits, 16) and md.scratch[0].is_contiguous()
        assert md.scratch[1].shape == (bs, 4, splits)
        assert md.scratch[0].data_ptr() == mid_o.data_ptr()


@pytest.mark.parametrize(
    "arch,memory",
    [("llama", {}), ("gemma2", {}),
     ("mistral", dict(hybrid_swa_memory=True, chunked_prefill_size=64, swa_full_tokens_ratio=0.5))],
    ids=["llama", "gemma2", "mistral-hybrid-swa-memory"],
)  # fmt: skip
def test_rotary_kernel_stores_the_kv_for_the_triton_backend(monkeypatch, arch, memory):
    """With the layers on their kernels (as on CUDA; here the interpreter), every layer's K/V
    go into the pool from the rotary kernel (`kv_store_target`, the window pool's slots for a
    windowed layer over hybrid memory) and the backend's own store never runs; with
    --disable-layer-kernels the layers run their torch code and the backend stores: the store
    kernel in extend steps, the decode kernel itself in decode steps. The logits are
    torch_native's either way."""
    import engine.attention.triton_backend as tb
    import engine.layers.rotary as rotary
    import kernels.jit
    from tests.factories import tiny_model

    path = tiny_model(arch, sliding_window=8) if arch != "llama" else tiny_model(arch)
    want = _engine_logits(path, "torch_native", page_size=16, **memory)
    real_rotary, real_store = rotary.apply_rotary, tb.store_kv
    monkeypatch.setattr(kernels.jit, "compiled_on", lambda x: True)  # (what CUDA tensors get)
    monkeypatch.setattr(kernels.jit, "_LAYER_KERNELS", [True])  # (the engines set it)
    fused: list[bool] = []
    stores: list[int] = []
    monkeypatch.setattr(
        rotary, "apply_rotary", lambda *a: fused.append(len(a) == 5) or real_rotary(*a)
    )
    monkeypatch.setattr(tb, "store_kv", lambda *a: stores.append(1) or real_store(*a))
    decodes: list[bool] = []  # per forward step (one Triton backend in every case here)
    real_init = tb.TritonAttnBackend.init_forward_metadata
    monkeypatch.setattr(
        tb.TritonAttnBackend, "init_forward_metadata",
        lambda self, fb: decodes.append(fb.forward_mode.is_decode()) or real_init(self, fb),
    )  # fmt: skip
    for disabled in (False, True):
        fused.clear()
        stores.clear()
        decodes.clear()
        got = _engine_logits(path, "triton", 16, disable_layer_kernels=disabled, **memory)
        assert len(got) == len(want) > 2
        for step, (g, w) in enumerate(zip(got, want, strict=True)):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4, msg=f"step {step}")
        if disabled:  # torch's rotary, the store kernel in the 2 layers of extend steps
            assert len(decodes) == len(got) and 0 < sum(decodes) < len(got)
            assert not fused and len(stores) == 2 * (len(got) - sum(decodes))
        else:
            assert fused and all(fused) and not stores
            assert len(fused) == 2 * len(got)


def test_disable_layer_kernels_flag():
    import argparse

    from engine.config import EngineArgs
    from services.engine_args import add_engine_args, engine_args_from

    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    args = engine_args_from(ap.parse_args(["--model-path", "m", "--disable-layer-kernels"]))
    assert args.disable_layer_kernels
    assert not EngineArgs.from_kwargs(model_path="m").disable_layer_kernels

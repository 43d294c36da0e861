"""HybridAttnBackend (engine/attention/hybrid_attn.py): which backend each batch and each
CUDA-graph hook goes to, and the engine arguments that ask for it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.attention.base import AttentionBackend
from engine.attention.hybrid_attn import HybridAttnBackend
from engine.config import EngineArgs
from engine.forward_batch import ForwardMode
from services.engine_args import add_engine_args, engine_args_from


class _Recorder(AttentionBackend):
    def __init__(self, name: str, graphs: bool, fill: int) -> None:
        self.name, self.calls = name, []
        self.supports_cuda_graph, self.cuda_graph_seq_len_fill_value = graphs, fill

    def init_forward_metadata(self, fb) -> None:
        self.calls.append("plan")
        self.metadata = (self.name, fb.forward_mode)

    def init_cuda_graph_state(self, max_bs: int, max_context_len: int) -> None:
        self.calls.append(("state", max_bs, max_context_len))

    def init_forward_metadata_capture_cuda_graph(self, fb) -> None:
        self.calls.append("capture")
        self.metadata = (self.name, "capture")

    def init_forward_metadata_replay_cuda_graph(self, fb) -> None:
        self.calls.append("replay")
        self.metadata = (self.name, "replay")

    def init_verify_cuda_graph_state(self, max_bs: int, width: int, max_context_len: int) -> None:
        self.calls.append(("verify state", max_bs, width, max_context_len))

    def cuda_graph_prologue(self, fb) -> None:
        self.calls.append("prologue")

    def forward(self, q, k, v, layer, fb, kv_stored=False) -> torch.Tensor:
        self.calls.append("forward (stored)" if kv_stored else "forward")
        return q + (1 if self.name == "decode" else 2)

    def kv_store_target(self, layer, fb):
        return (self.name,)

    def _attend(self, *args):  # pragma: no cover
        raise NotImplementedError


def _pair() -> tuple[_Recorder, _Recorder, HybridAttnBackend]:
    prefill, decode = _Recorder("prefill", False, 1), _Recorder("decode", True, 3)
    return prefill, decode, HybridAttnBackend(prefill, decode)


def _batch(mode: ForwardMode) -> SimpleNamespace:
    return SimpleNamespace(forward_mode=mode)


def test_each_batch_goes_to_its_phase_backend() -> None:
    prefill, decode, hybrid = _pair()
    q = torch.zeros(2)
    for mode, want, add in ((ForwardMode.EXTEND, prefill, 2), (ForwardMode.DECODE, decode, 1)):
        fb = _batch(mode)
        hybrid.init_forward_metadata(fb)
        assert hybrid.metadata == (want.name, mode)
        assert torch.equal(hybrid.forward(q, q, q, None, fb), q + add)
        assert hybrid.kv_store_target(None, fb) == (want.name,)  # the phase's store target
        hybrid.forward(q, q, q, None, fb, kv_stored=True)
    assert prefill.calls == ["plan", "forward", "forward (stored)"]
    assert decode.calls == ["plan", "forward", "forward (stored)"]


def test_a_batch_other_than_the_planned_one_is_refused() -> None:
    _, _, hybrid = _pair()
    q = torch.zeros(1)
    with pytest.raises(AssertionError, match="init_forward_metadata"):
        hybrid.forward(q, q, q, None, _batch(ForwardMode.DECODE))
    hybrid.init_forward_metadata(_batch(ForwardMode.EXTEND))
    with pytest.raises(AssertionError, match="not the one planned"):
        hybrid.forward(q, q, q, None, _batch(ForwardMode.DECODE))


def test_cuda_graphs_are_the_decode_backends() -> None:
    prefill, decode, hybrid = _pair()
    assert hybrid.supports_cuda_graph and hybrid.cuda_graph_seq_len_fill_value == 3
    fb = _batch(ForwardMode.DECODE)
    hybrid.init_cuda_graph_state(8, 64)
    hybrid.init_forward_metadata(_batch(ForwardMode.EXTEND))  # a prefill in between
    hybrid.init_forward_metadata_capture_cuda_graph(fb)
    hybrid.cuda_graph_prologue(fb)
    assert hybrid.metadata == ("decode", "capture")
    hybrid.forward(torch.zeros(1), None, None, None, fb)
    hybrid.init_forward_metadata_replay_cuda_graph(fb)
    assert hybrid.metadata == ("decode", "replay")
    assert decode.calls == [("state", 8, 64), "capture", "prologue", "forward", "replay"]
    assert prefill.calls == ["plan"]
    no_graphs = HybridAttnBackend(decode, prefill)  # decode on a backend without graphs
    assert not no_graphs.supports_cuda_graph


def test_verify_graphs_are_the_prefill_backends() -> None:
    """Speculative verify steps are EXTEND batches: their graphs (engine/speculative/
    verify_graphs.py) are the prefill backend's, beside the decode backend's decode graphs."""
    prefill, decode, hybrid = _pair()
    assert not hybrid.supports_verify_cuda_graph  # (the recorder's default: none)
    prefill.supports_verify_cuda_graph = True
    hybrid = HybridAttnBackend(prefill, decode)
    assert hybrid.supports_verify_cuda_graph
    verify, step = _batch(ForwardMode.EXTEND), _batch(ForwardMode.DECODE)
    hybrid.init_cuda_graph_state(8, 64)
    hybrid.init_verify_cuda_graph_state(4, 5, 64)
    hybrid.init_forward_metadata_capture_cuda_graph(verify)
    hybrid.cuda_graph_prologue(verify)
    assert hybrid.metadata == ("prefill", "capture")
    hybrid.forward(torch.zeros(1), None, None, None, verify)
    hybrid.init_forward_metadata_replay_cuda_graph(step)  # a decode replay in between
    hybrid.init_forward_metadata_replay_cuda_graph(verify)
    assert hybrid.metadata == ("prefill", "replay")
    assert prefill.calls == [("verify state", 4, 5, 64), "capture", "prologue", "forward",
                             "replay"]  # fmt: skip
    assert decode.calls == [("state", 8, 64), "replay"]


def test_engine_args_and_flags() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    ns = ap.parse_args(["--model-path", "m", "--prefill-attention-backend", "flashinfer",
                        "--decode-attention-backend", "triton"])  # fmt: skip
    args = engine_args_from(ns)
    assert (args.prefill_attention_backend, args.decode_attention_backend) == (
        "flashinfer", "triton")
    with pytest.raises(SystemExit):
        ap.parse_args(["--model-path", "m", "--decode-attention-backend", "fa3"])
    with pytest.raises(ValueError, match="decode_attention_backend: 'fa3'"):
        EngineArgs.from_kwargs(model_path="m", decode_attention_backend="fa3")
    splits = ap.parse_args(["--model-path", "m", "--triton-attention-num-kv-splits", "16"])
    assert engine_args_from(splits).triton_attention_num_kv_splits == 16
    with pytest.raises(ValueError, match="triton_attention_num_kv_splits: 0"):
        EngineArgs.from_kwargs(model_path="m", triton_attention_num_kv_splits=0)


def test_hybrid_swa_store_target_is_the_window_pools_slots() -> None:
    """Over hybrid window memory a windowed layer's rotary-kernel store goes where its
    attention reads: the swa backend's pool at the new tokens' slots translated through
    `full_to_swa`; a full-attention layer's to the full backend's, untranslated."""
    from engine.attention.base import triton_store_target
    from engine.attention.hybrid_swa import HybridSWABackend
    from engine.forward_batch import ForwardBatch

    class Target(_Recorder):
        def kv_store_target(self, layer, fb):
            return triton_store_target(layer, fb)

    full_pool = SimpleNamespace(quantized=False, get_kv_buffer=lambda i: ("full k", "full v"))
    full_to_swa = torch.tensor([0, 7, 5, 9, 3, 2, 8, 6, 4, 1])  # not the identity
    fb = ForwardBatch(
        forward_mode=ForwardMode.DECODE, batch_size=2, input_ids=torch.tensor([1, 2]),
        positions=torch.tensor([3, 4]), out_cache_loc=torch.tensor([4, 6]),
        req_pool_indices=torch.tensor([0, 1]), seq_lens=torch.tensor([4, 5]),
        seq_lens_cpu=[4, 5], req_to_token=torch.arange(20, dtype=torch.int32).view(2, 10) % 10,
        kv_pool=full_pool, attn_backend=None,
    )  # fmt: skip
    full, swa = Target("full", False, 1), Target("swa", False, 1)
    hybrid = HybridSWABackend(full, swa, SimpleNamespace(full_to_swa=full_to_swa))
    hybrid.init_forward_metadata(fb)
    windowed = SimpleNamespace(layer_id=1, sliding_window=4)
    k_buf, v_buf, loc = hybrid.kv_store_target(windowed, fb)
    assert torch.equal(loc, torch.tensor([3, 8]))  # full_to_swa[[4, 6]]
    assert hybrid.kv_store_target(SimpleNamespace(layer_id=0), fb)[2] is fb.out_cache_loc

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

    def cuda_graph_prologue(self, fb) -> None:
        self.calls.append("prologue")

    def forward(self, q, k, v, layer, fb) -> torch.Tensor:
        self.calls.append("forward")
        return q + (1 if self.name == "decode" else 2)

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
    assert prefill.calls == ["plan", "forward"] and decode.calls == ["plan", "forward"]


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

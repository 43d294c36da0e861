"""The Triton launches of one Llama decode step, by kernel, with the layers on their kernels
(as on CUDA; here the interpreter, counting every launch): the fusions stay fused. A layer is
the input norm (with the residual add), the rotary kernel that also writes the K/V, the decode
kernel (its last split program of each request and KV head merges the splits), the
post-attention norm and the SiLU-and-mul (the GEMMs are torch's); with --gemv-backend triton,
the norms and the activation go inside the GEMVs: qkv with its norm, rotary, decode, o,
gate_up with its norm, down with the activation. GPT-2's layer: its two LayerNorms with the
residual adds, the decode kernel (which also writes the new K/V: no rotary kernel to do it),
gelu_new (on CUDA the GELU goes into c_fc's cuBLASLt epilogue instead, which the interpreter
cannot run: CPU tensors keep the kernel, tests/gpu/test_fused_kernels_gpu.py checks the CUDA
side)."""

from __future__ import annotations

import pytest

from kernels.testing import triton_test_device

DEVICE, SKIP_REASON = triton_test_device()  # before anything imports triton
if SKIP_REASON or DEVICE != "cpu":
    pytest.skip(SKIP_REASON or "counts the interpreter's launches", allow_module_level=True)

from tests.unit.test_kernels_backend import _engine_logits  # noqa: E402

ATTENTION = ["_rotary_kernel", "_decode_split_kernel"]


def _decode_launches(monkeypatch, arch: str = "llama", **engine_args) -> list[list[str]]:
    """The kernel names each decode step launched (one list per decode forward)."""
    from triton.runtime.interpreter import InterpretedFunction

    import kernels.jit
    from engine.forward_batch import ForwardMode
    from engine.model_runner import ModelRunner
    from tests.factories import tiny_model

    launches: list[str] = []
    steps: list[list[str]] = []
    run = InterpretedFunction.run

    def counted(self, *args, **kwargs):
        launches.append(self.__name__)
        return run(self, *args, **kwargs)

    forward = ModelRunner.forward

    def per_step(self, fb, *args, **kwargs):
        launches.clear()
        out = forward(self, fb, *args, **kwargs)
        if fb.forward_mode == ForwardMode.DECODE:
            steps.append(list(launches))
        return out

    monkeypatch.setattr(InterpretedFunction, "run", counted)
    monkeypatch.setattr(ModelRunner, "forward", per_step)
    monkeypatch.setattr(kernels.jit, "compiled_on", lambda x: True)  # (what CUDA tensors get)
    monkeypatch.setattr(kernels.jit, "_LAYER_KERNELS", [True])
    _engine_logits(tiny_model(arch), "triton", 16, **engine_args)
    assert steps
    return steps


def test_a_decode_layer_is_five_triton_launches_beside_the_gemms(monkeypatch):
    layer = ["_norm_kernel", *ATTENTION, "_norm_kernel", "_silu_and_mul_kernel"]
    for step in _decode_launches(monkeypatch):
        assert step == layer * 2 + ["_norm_kernel"]  # 2 layers, the final norm


def test_with_the_triton_gemv_a_decode_layer_is_six_launches_in_all(monkeypatch):
    layer = ["_gemv_kernel", *ATTENTION, "_gemv_kernel", "_gemv_kernel", "_gemv_kernel"]
    for step in _decode_launches(monkeypatch, gemv_backend="triton", gemv_max_rows=2):
        assert step == layer * 2 + ["_norm_kernel", "_gemv_kernel"]  # final norm, lm_head


def test_the_merge_kernel_flag_brings_back_the_second_attention_launch(monkeypatch):
    layer = ["_norm_kernel", *ATTENTION, "_decode_merge_kernel", "_norm_kernel",
             "_silu_and_mul_kernel"]  # fmt: skip
    for step in _decode_launches(monkeypatch, triton_decode_merge="kernel"):
        assert step == layer * 2 + ["_norm_kernel"]


def test_without_layer_kernels_only_attention_is_triton(monkeypatch):
    """(the decode kernel writes the new K/V the rotary kernel no longer writes)"""
    for step in _decode_launches(monkeypatch, disable_layer_kernels=True):
        assert step == ATTENTION[1:] * 2


def test_gpt2_adds_its_residuals_inside_the_layernorms(monkeypatch):
    """GPT-2: the embedding sum and every residual add inside a LayerNorm launch (no add
    kernels); no rotary, so the decode kernel stores the new K/V (no store launch)."""
    layer = ["_norm_kernel", *ATTENTION[1:], "_norm_kernel", "_gelu_new_kernel"]
    for step in _decode_launches(monkeypatch, "gpt2"):
        assert step == layer * 2 + ["_norm_kernel"]

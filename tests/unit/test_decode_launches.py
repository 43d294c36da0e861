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
side). With --enable-pdl: every launch of a run carries PDL and each of its programs waits
(griddepcontrol.wait, noted here since the interpreter has none) before it touches memory."""

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



def _pdl_launches(
    monkeypatch, arch: str, enable_pdl: bool | None = True, supported: bool = True,
    **engine_args,
) -> list[tuple[str, bool, list[str]]]:
    """Every Triton launch of an engine run, with the device taken as `supported` for PDL (an
    H100 by default): (kernel, its PDL constexpr, what its programs did in order: "program"
    where one starts, "wait" and "launch" for griddepcontrol.wait / launch_dependents, "mem"
    for a load, store or atomic)."""
    from triton.runtime.interpreter import InterpretedFunction, InterpreterBuilder

    import engine.model_runner
    import kernels.jit
    from tests.factories import tiny_model

    if not kernels.jit.HAS_GDC:
        pytest.skip("this Triton has no grid dependency control (before 3.3)")
    events: list[str] = []
    launches: list[tuple[str, bool, list[str]]] = []
    run = InterpretedFunction.run

    def recorded(self, *args, **kwargs):
        events.clear()
        out = run(self, *args, **kwargs)
        launches.append((self.__name__, kwargs.get("PDL"), list(events)))
        return out

    def note(event: str, method):  # noqa: ANN001, ANN202
        def call(self, *args, **kwargs):
            events.append(event)
            return method(self, *args, **kwargs)

        return call

    # the interpreter has no grid dependency control: pdl_prologue's calls are noted instead
    monkeypatch.setattr(kernels.jit, "gdc_wait", lambda: events.append("wait"))
    monkeypatch.setattr(kernels.jit, "gdc_launch_dependents", lambda: events.append("launch"))
    builder = InterpreterBuilder
    monkeypatch.setattr(builder, "set_grid_idx", note("program", builder.set_grid_idx))
    for name in dir(builder):
        if name.startswith("create_") and any(op in name for op in ("load", "store", "atomic")):
            monkeypatch.setattr(builder, name, note("mem", getattr(builder, name)))
    monkeypatch.setattr(InterpretedFunction, "run", recorded)
    monkeypatch.setattr(engine.model_runner, "pdl_supported", lambda device: supported)
    monkeypatch.setattr(kernels.jit, "_PDL", [False])  # (restored after the test)
    monkeypatch.setattr(kernels.jit, "compiled_on", lambda x: True)  # (what CUDA tensors get)
    monkeypatch.setattr(kernels.jit, "_LAYER_KERNELS", [True])
    _engine_logits(tiny_model(arch), "triton", 16, enable_pdl=enable_pdl, **engine_args)
    assert launches
    return launches


GEMV = {"gemv_backend": "triton", "gemv_max_rows": 2}


@pytest.mark.parametrize("arch, engine_args", [("llama", {}), ("llama", GEMV), ("gpt2", {})])
def test_with_pdl_every_program_waits_before_it_touches_memory(monkeypatch, arch, engine_args):
    """--enable-pdl: every Triton launch of the run (prefill and decode: the layers' kernels,
    attention, the GEMV, argmax) carries PDL, and each of its programs starts with
    griddepcontrol.wait, then launch_dependents, before any load, store or atomic: the rule
    that makes a kernel that may start early safe (kernels.jit.pdl_prologue)."""
    launches = _pdl_launches(monkeypatch, arch, **engine_args)
    names = {name for name, _, _ in launches}
    assert {"_decode_split_kernel", "_extend_kernel", "_norm_kernel"} <= names
    assert ("_gemv_kernel" in names) == bool(engine_args)
    for name, pdl, events in launches:
        assert pdl is True, f"{name} launched without PDL"
        programs = " ".join(events).split("program")[1:]
        assert programs and all("mem" in p for p in programs), name  # (all recorded)
        for i, program in enumerate(programs):
            assert program.split()[:2] == ["wait", "launch"], (name, i, program.split()[:4])
            assert program.split().count("wait") == 1, (name, i)


@pytest.mark.parametrize("enable_pdl, supported", [(False, True), (True, False)])
def test_no_pdl_when_off_or_where_it_cannot_run(monkeypatch, enable_pdl, supported):
    """The flag off, or on where PDL cannot run (the engine asks
    `pdl_supported`: compiled Triton on compute capability 9.0+), no launch carries PDL and
    no program executes griddepcontrol."""
    launches = _pdl_launches(monkeypatch, "llama", enable_pdl, supported)
    for name, pdl, events in launches:
        assert pdl is False and "wait" not in events and "launch" not in events, name


@pytest.mark.parametrize("gemv", ["triton", "torch"])
def test_pdl_by_default_where_the_triton_gemv_runs(monkeypatch, gemv):
    """Neither flag (enable_pdl None): PDL where the device supports it and the linear layers
    run on the Triton GEMV (the configuration the H100 measured faster with it), not beside
    cuBLAS's GEMMs."""
    launches = _pdl_launches(monkeypatch, "llama", None, True, gemv_backend=gemv,
                             gemv_max_rows=2)  # fmt: skip
    assert ("_gemv_kernel" in {name for name, _, _ in launches}) == (gemv == "triton")
    for name, pdl, events in launches:
        assert pdl is (gemv == "triton"), name
        assert ("wait" in events) == (gemv == "triton"), name


def test_pdl_is_not_supported_on_the_cpu():
    import torch

    from kernels.jit import pdl_supported

    assert not pdl_supported(torch.device("cpu"))

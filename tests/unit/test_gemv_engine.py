"""`--gemv-backend triton` (engine.layers.linear.use_triton_gemv): which layers it routes, the
row limit, its flags, and end to end through the Engine on tiny models (in the Triton
interpreter on CPU, compiled on CUDA): the logits of every step equal the cuBLAS / torch run's,
with the decode steps' projections and lm_head on the GEMV."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from kernels.testing import triton_test_device

DEVICE, SKIP_REASON = triton_test_device()  # before anything imports triton
if SKIP_REASON:
    pytest.skip(SKIP_REASON, allow_module_level=True)

import kernels.gemv  # noqa: E402
from engine.config import EngineArgs  # noqa: E402
from engine.layers.linear import MergedLinear, use_triton_gemv  # noqa: E402
from engine.layers.logits import LogitsProcessor, lm_head_matmul  # noqa: E402
from tests.unit.test_kernels_backend import _engine_logits  # noqa: E402


@pytest.fixture
def gemv_calls(monkeypatch) -> types.SimpleNamespace:
    """The row count (`rows`), the `act` argument (`acts`) and whether a norm came with a
    residual (`norms`: None without a norm) of every Triton GEMV call."""
    calls = types.SimpleNamespace(rows=[], acts=[], norms=[])
    real = kernels.gemv.gemv

    def counted(x, *args, **kwargs):
        calls.rows.append(x.shape[0])
        calls.acts.append(kwargs.get("act"))
        norm = kwargs.get("norm")
        calls.norms.append(None if norm is None else norm.residual is not None)
        return real(x, *args, **kwargs)

    monkeypatch.setattr(kernels.gemv, "gemv", counted)
    return calls


class _Fp8Like(nn.Linear):
    """Stands for a quantized layer: a subclass of nn.Linear with its own forward."""


def test_routes_plain_linears_up_to_max_rows(gemv_calls):
    model = nn.ModuleDict({
        "qkv": MergedLinear(32, [("q", 16), ("k", 8), ("v", 8)], bias=True),
        "down": nn.Linear(32, 24, bias=False),
        "quantized": _Fp8Like(32, 8),
        "logits": LogitsProcessor(vocab_size=50),
    }).to(DEVICE)  # fmt: skip
    assert use_triton_gemv(model, max_rows=2) == 2
    assert model["logits"].gemv_max_rows == 2
    assert "forward" not in vars(model["quantized"])
    for rows, on_gemv in ((1, True), (2, True), (3, False)):
        gemv_calls.rows.clear()
        x = torch.randn(rows, 32, device=DEVICE)
        for name in ("qkv", "down"):
            layer = model[name]
            want = torch.nn.functional.linear(x, layer.weight, layer.bias)
            torch.testing.assert_close(layer(x), want, atol=1e-5, rtol=1e-5)
        assert gemv_calls.rows == ([rows, rows] if on_gemv else [])
    gemv_calls.rows.clear()
    half = model["down"].to(torch.bfloat16)
    with pytest.raises(RuntimeError):  # x float32, weight bfloat16: as nn.Linear, refused
        half(torch.randn(1, 32, device=DEVICE))
    assert gemv_calls.rows == []  # (by F.linear, not the GEMV's assertion)


def test_llama_mlp_runs_its_activation_inside_the_down_projection(gemv_calls):
    """With the row limit set, Llama's MLP sends gate_up's output to the down projection's
    GEMV with act="silu_mul" (no activation kernel); more rows, or a down projection that is
    not a plain nn.Linear (a LoRA wrapper, a quantized layer), take the unfused path."""
    from engine.models.llama import LlamaMLP

    config = types.SimpleNamespace(hidden_act="silu", hidden_size=32, intermediate_size=48)
    mlp = LlamaMLP(config).to(DEVICE)
    assert use_triton_gemv(mlp, max_rows=2) == 2 and mlp.gemv_max_rows == 2

    def unfused(x: torch.Tensor) -> torch.Tensor:
        gate, up = (x @ mlp.gate_up_proj.weight.T).chunk(2, dim=-1)
        return (torch.nn.functional.silu(gate) * up) @ mlp.down_proj.weight.T

    for rows, fused in ((1, True), (2, True), (3, False)):
        gemv_calls.rows.clear()
        gemv_calls.acts.clear()
        x = torch.randn(rows, 32, device=DEVICE)
        torch.testing.assert_close(mlp(x), unfused(x), atol=1e-5, rtol=1e-5)
        assert gemv_calls.acts == ([None, "silu_mul"] if fused else [])
    base = mlp.down_proj
    mlp.down_proj = _Fp8Like(48, 32, bias=False).to(DEVICE)  # stands for any other kind of layer
    mlp.down_proj.load_state_dict(base.state_dict())
    gemv_calls.acts.clear()
    x = torch.randn(1, 32, device=DEVICE)
    torch.testing.assert_close(mlp(x), unfused(x), atol=1e-5, rtol=1e-5)
    assert gemv_calls.acts == [None]  # gate_up's GEMV only; the activation ran on its own


def test_lm_head_rows_go_to_the_gemv_padded_or_not(gemv_calls):
    weight = torch.randn(50, 32, device=DEVICE)
    hidden = torch.randn(2, 32, device=DEVICE)
    want = hidden @ weight.T
    for pad in (False, True):
        got = lm_head_matmul(hidden, weight, pad=pad, gemv_max_rows=4)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert got.stride(0) == (64 if pad else 50)
    assert gemv_calls.rows == [2, 2]
    lm_head_matmul(hidden, weight, gemv_max_rows=1)  # more rows than allowed: torch's
    assert gemv_calls.rows == [2, 2]


def test_flags_and_validation():
    import argparse

    from services.engine_args import add_engine_args, engine_args_from

    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    ns = ap.parse_args(["--model-path", "m", "--gemv-backend", "triton", "--gemv-max-rows", "8"])
    args = engine_args_from(ns)
    assert (args.gemv_backend, args.gemv_max_rows) == ("triton", 8)
    default = engine_args_from(ap.parse_args(["--model-path", "m"]))
    assert (default.gemv_backend, default.gemv_max_rows, default.enable_pdl) == ("auto", 1, None)
    kwargs = EngineArgs.from_kwargs(model_path="m")
    assert (kwargs.gemv_backend, kwargs.gemv_max_rows, kwargs.enable_pdl) == ("auto", 1, None)
    for flag, want in (("--enable-pdl", True), ("--disable-pdl", False)):
        assert engine_args_from(ap.parse_args(["--model-path", "m", flag])).enable_pdl is want
    with pytest.raises(ValueError, match="gemv_backend: 'cublas'"):
        EngineArgs.from_kwargs(model_path="m", gemv_backend="cublas")
    with pytest.raises(ValueError, match="gemv_max_rows: 17 not in 1..16"):
        EngineArgs.from_kwargs(model_path="m", gemv_max_rows=kernels.gemv.MAX_M + 1)
    with pytest.raises(SystemExit):
        ap.parse_args(["--model-path", "m", "--gemv-backend", "cutlass"])


@pytest.mark.parametrize("device, dtype, interpreting, want", [
    ("cuda", torch.bfloat16, False, "triton"),
    ("cuda", torch.float16, False, "triton"),
    ("cuda", torch.float32, False, "torch"),  # (measured in 16 bits only)
    ("cpu", torch.bfloat16, False, "torch"),
    ("cpu", torch.float32, True, "torch"),  # (the interpreter: a second a token)
])  # fmt: skip
def test_auto_is_the_gemv_for_16_bit_models_on_cuda(monkeypatch, device, dtype, interpreting,
                                                    want):  # fmt: skip
    import kernels.jit
    from engine.layers.linear import resolve_gemv_backend

    monkeypatch.setattr(kernels.jit, "interpreting", lambda: interpreting)
    monkeypatch.setattr(kernels.jit, "HAS_TRITON", True)
    assert resolve_gemv_backend("auto", torch.device(device), dtype) == want
    for named in ("torch", "triton"):  # a named backend is kept
        assert resolve_gemv_backend(named, torch.device(device), dtype) == named


def test_refused_where_triton_cannot_run(monkeypatch):
    """On CPU without the interpreter the engine says so at start, not at the first decode."""
    import kernels.jit
    from engine.model_runner import ModelRunner

    monkeypatch.setattr(kernels.jit, "interpreting", lambda: False)
    runner = types.SimpleNamespace(device=torch.device("cpu"), args=None, model=None)
    with pytest.raises(RuntimeError, match="gemv_backend='triton' runs on CUDA"):
        ModelRunner._use_triton_gemv(runner)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: the qkv projection's bias
def test_engine_logits_match_torch(arch, gemv_calls):
    from tests.factories import tiny_model

    path = tiny_model(arch)

    layers: list[int] = []

    def on_gemv(runner) -> None:
        assert "forward" in vars(runner.model.model.layers[0].mlp.gate_up_proj)
        layers.append(len(runner.model.model.layers))

    got = _engine_logits(path, "torch_native", 16, on_gemv, gemv_backend="triton",
                         gemv_max_rows=2)  # fmt: skip
    want = _engine_logits(path, "torch_native", page_size=16)
    assert len(got) == len(want) > 2
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4, msg=f"step {step}")
    # decode steps of two requests, then of one: every projection (qkv and gate_up with the
    # norm before them inside, o, down with the MLP's activation inside) and the lm_head; the
    # two prefills' many rows went to torch, their lm_head rows (one per request) to the GEMV
    decode_steps = len(got) - 2
    assert set(gemv_calls.rows) == {1, 2}
    assert len(gemv_calls.rows) == decode_steps * (4 * layers[0] + 1) + 2
    assert gemv_calls.acts.count("silu_mul") == decode_steps * layers[0]
    # each layer's two norms inside the qkv and gate_up GEMVs, all with the residual add but
    # the first layer's input norm
    assert gemv_calls.norms.count(True) == decode_steps * (2 * layers[0] - 1)
    assert gemv_calls.norms.count(False) == decode_steps


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_engine_logits_match_torch_with_qk_norms_and_experts(arch, gemv_calls):
    """Qwen3's per-head q/k norms after the qkv GEMV with the input norm inside it; the MoE
    block (no gate_up projection of its own) keeps its post-attention norm apart."""
    from tests.factories import tiny_model

    path = tiny_model(arch)
    got = _engine_logits(path, "torch_native", 16, gemv_backend="triton", gemv_max_rows=2)
    want = _engine_logits(path, "torch_native", page_size=16)
    assert len(got) == len(want) > 2
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4, msg=f"step {step}")
    normed = [n for n in gemv_calls.norms if n is not None]
    steps = len(got) - 2
    assert len(normed) == steps * (2 if arch == "qwen3" else 1) * 2  # (2 layers)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["phi3", "glm4", "granite", "olmo2", "gemma2", "gpt2",
                                  "deepseek_v3"])  # fmt: skip
def test_every_family_decodes_alike_on_the_gemv(arch, gemv_calls):
    """The GEMV is the default for 16-bit models on CUDA, so every architecture's one-row
    decode steps take it: partial rotary (Phi-3), sandwich norms (GLM-4), multipliers
    (Granite), post norms (OLMo 2), Gemma's norms and GELU MLP, GPT-2, DeepSeek's MLA
    projections. The logits of every step equal the cuBLAS / torch run's."""
    from tests.factories import tiny_model

    path = tiny_model(arch)
    got = _engine_logits(path, "torch_native", 16, gemv_backend="triton", gemv_max_rows=1)
    want = _engine_logits(path, "torch_native", 16, gemv_backend="torch")
    assert len(got) == len(want) > 2
    assert 1 in gemv_calls.rows  # the decode steps of one request went to the GEMV
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4, msg=f"{arch} step {step}")


def test_lora_adapters_keep_their_layers_off_the_fused_prologues():
    """LoRA wraps qkv_proj / down_proj (no `weight` of its own): the decoder layer and the MLP
    see a projection that is not a plain one and take the unfused path for it; the greedy
    tokens of adapter and base requests equal those of the cuBLAS run."""
    from engine.engine import Engine
    from tests.factories import tiny_lora, tiny_model

    path = tiny_model("llama")
    lora = tiny_lora(path, 1, 8, targets=("q_proj", "v_proj", "down_proj"))
    prompts = [[5, 6, 7, 8, 9], [20, 21, 22]]
    sp = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    outs = []
    for backend in ("triton", "torch"):
        engine = Engine(model_path=path, lora_paths=(f"a={lora}",), gemv_backend=backend,
                        device=DEVICE, max_total_tokens=1024, disable_overlap_schedule=True,
                        skip_tokenizer_init=True)  # fmt: skip
        try:
            got = engine.generate(input_ids=prompts, sampling_params=sp, lora_path=["a", None])
        finally:
            engine.shutdown()
        outs.append([o["output_ids"] for o in got])
    assert outs[0] == outs[1]


def test_fp8_engine_decodes_one_row_on_the_float8_gemv(monkeypatch):
    """`--quantization fp8` with the Triton GEMV: decode steps of one request run every
    projection on `fp8_gemv` (the lm_head, not quantized, on the 16-bit GEMV), with the
    logits of the engine without it; batches of two rows keep the float8 GEMM."""
    import engine.layers.fp8 as fp8_layer
    from tests.factories import tiny_model

    path = tiny_model("llama")
    rows: list[int] = []
    real = fp8_layer.fp8_gemv
    monkeypatch.setattr(fp8_layer, "fp8_gemv", lambda a_q, *a: rows.append(a_q.shape[0])
                        or real(a_q, *a))  # fmt: skip
    layers: list[int] = []
    got = _engine_logits(path, "torch_native", 16, lambda r: layers.append(
        len(r.model.model.layers)), quantization="fp8", gemv_backend="triton")  # fmt: skip
    want = _engine_logits(path, "torch_native", 16, quantization="fp8", gemv_backend="torch")
    assert len(got) == len(want) > 2
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4, msg=f"step {step}")
    # round one decodes two requests (3 steps of 2 rows, then none of one row: both finish
    # together), round two one request (3 steps of 1 row): 4 quantized projections a layer
    assert rows and set(rows) == {1}
    assert len(rows) == 3 * 4 * layers[0]

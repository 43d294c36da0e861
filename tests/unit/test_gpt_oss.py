"""gpt-oss through the whole engine (the float64 layer-by-layer parity is in test_models.py):
greedy generation against transformers' with the prefix cache, chunked prefill and a batch
whose requests cross the sliding window; the Triton backend's sinks against torch_native's,
flashinfer refused; MXFP4 experts (the published checkpoints) dequantized as they load."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.factories import assert_greedy_match, hf_greedy
from tests.unit.test_models import save_random_model


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("gpt_oss"))
    save_random_model("gpt_oss", path)
    return path


def _engine(path: str, **kwargs: object):
    from engine.engine import Engine

    return Engine(model_path=path, max_total_tokens=2048, skip_tokenizer_init=True,
                  **kwargs)  # fmt: skip


def test_greedy_matches_transformers(gpt_oss):
    prompts = [list(range(3, 20)), [7, 8, 9], list(range(30, 42)) * 2]
    sp = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    engine = _engine(gpt_oss, chunked_prefill_size=16)
    try:
        first = engine.generate(input_ids=prompts, sampling_params=sp)
        again = engine.generate(input_ids=prompts[:1], sampling_params=sp)  # cached prefix
    finally:
        engine.shutdown()
    assert again[0]["meta_info"]["cached_tokens"] > 0
    assert again[0]["output_ids"] == first[0]["output_ids"]
    for prompt, out in zip(prompts, first, strict=True):
        want = hf_greedy(gpt_oss, prompt, 12)
        assert_greedy_match(gpt_oss, prompt, out["output_ids"], want)


def test_triton_backend_computes_the_sinks(gpt_oss):
    """The Triton kernels (interpreted here) against torch_native: every forward step's
    logits, prefill with a cached prefix and decode, the windowed layer crossing its window."""
    from tests.unit.test_kernels_backend import _engine_logits

    got = _engine_logits(gpt_oss, "triton", 16)
    want = _engine_logits(gpt_oss, "torch_native", 16)
    assert len(got) == len(want) > 2
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4, msg=f"step {step}")


@pytest.mark.parametrize("flags", [{"attention_backend": "flashinfer"},
                                   {"decode_attention_backend": "flashinfer"}])
def test_flashinfer_is_refused(gpt_oss, flags):
    # (a RuntimeError where the runner starts in the CPU's device process, with the reason)
    with pytest.raises((ValueError, RuntimeError), match="not flashinfer"):
        _engine(gpt_oss, **flags)


def test_mxfp4_only_for_gpt_oss_and_not_requantized():
    """MXFP4 is gpt-oss's experts' format (dequantized as they load): on another model it is
    still refused with the reason, and `--quantization fp8` on top of it too."""
    from types import SimpleNamespace

    from engine.quantization import resolve_quantization

    mxfp4 = {"quant_method": "mxfp4"}
    assert resolve_quantization(None, SimpleNamespace(model_type="gpt_oss",
                                                      quantization_config=mxfp4)) is None
    with pytest.raises(ValueError, match="quantized with 'mxfp4', which sluice does not run"):
        resolve_quantization(None, SimpleNamespace(model_type="llama", quantization_config=mxfp4))
    with pytest.raises(ValueError, match="--quantization fp8 on an MXFP4 checkpoint"):
        resolve_quantization("fp8", SimpleNamespace(model_type="gpt_oss",
                                                    quantization_config=mxfp4))


def test_make_tiny_model_builds_a_servable_gpt_oss():
    """`sluice make-tiny-model --arch gpt_oss`: random sinks and expert biases (transformers
    starts the biases at zero), windowed and full layers; served greedy past the window
    equals transformers'."""
    from safetensors.torch import load_file

    from tests.factories import tiny_model

    path = tiny_model("gpt_oss")
    weights = load_file(os.path.join(path, "model.safetensors"))
    for name in ("self_attn.sinks", "mlp.experts.gate_up_proj_bias", "mlp.router.bias"):
        assert weights[f"model.layers.0.{name}"].abs().max() > 0, name
    config = json.load(open(os.path.join(path, "config.json")))
    assert config["layer_types"] == ["sliding_attention", "full_attention"]
    prompt = list(range(40, 80))  # longer than the window of 32
    engine = _engine(path)
    try:
        out = engine.generate(input_ids=[prompt], sampling_params={
            "max_new_tokens": 10, "temperature": 0, "ignore_eos": True})[0]  # fmt: skip
    finally:
        engine.shutdown()
    assert_greedy_match(path, prompt, out["output_ids"], hf_greedy(path, prompt, 10))


def test_dense_experts_equal_the_routed_loop():
    """The graph-safe path (every expert on every row, a dense routing matrix) computes what
    the per-expert loop does, in float64."""
    import transformers

    from engine.models.gpt_oss import GptOssMoE

    config = transformers.GptOssConfig(hidden_size=32, intermediate_size=24, num_local_experts=6,
                                       num_experts_per_tok=2, swiglu_limit=1.0)  # fmt: skip
    torch.manual_seed(0)
    moe = GptOssMoE(config).double()
    for p in moe.parameters():
        p.data.normal_(0.0, 0.5)
    x = torch.randn(40, 32, dtype=torch.float64)
    top, experts = torch.topk(moe.router(x), 2, dim=-1)
    weights = torch.softmax(top, dim=-1)
    routed = moe.experts(x, experts, weights)  # 40 rows: the loop
    assert x.shape[0] > moe.experts.DENSE_ROWS
    torch.testing.assert_close(moe.experts.dense(x, experts, weights), routed)
    torch.testing.assert_close(moe(x[:3]), routed[:3])  # 3 rows: the dense path


@pytest.mark.parametrize("rows", [3, 40])  # 16-row blocks (decode), 64-row blocks
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_experts_equal_the_routed_loop(rows, dtype):
    """The GPU's path (the Triton grouped GEMMs with the experts' biases, the clamped SwiGLU
    between them, and the transposed [E, in, out] weights; the interpreter on CPU) computes
    what the per-expert loop does."""
    import transformers

    from engine.models.gpt_oss import GptOssMoE
    from kernels.testing import triton_test_device

    device, skip = triton_test_device()
    if skip:
        pytest.skip(skip)
    config = transformers.GptOssConfig(hidden_size=32, intermediate_size=24, num_local_experts=6,
                                       num_experts_per_tok=2, swiglu_limit=1.0)  # fmt: skip
    torch.manual_seed(1)
    moe = GptOssMoE(config)
    for p in moe.parameters():
        p.data.normal_(0.0, 0.5)
    x = torch.randn(rows, 32)
    top, experts = torch.topk(moe.router(x), 2, dim=-1)
    weights = torch.softmax(top, dim=-1)
    want = moe.double().experts.dense(x.double(), experts, weights.double())
    moe = moe.to(device, dtype)
    got = moe.experts.fused(x.to(device, dtype), experts.to(device), weights.to(device, dtype))
    assert got.dtype == dtype and got.shape == x.shape
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got.double().cpu(), want, atol=tol, rtol=tol)


def test_mxfp4_dequantization_is_transformers():
    """`dequantize_mxfp4` against transformers' own conversion of the published format."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from engine.models.gpt_oss import dequantize_mxfp4

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 2, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(118, 136, (3, 8, 2), generator=g, dtype=torch.uint8)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    got = dequantize_mxfp4(blocks, scales, torch.float32)
    assert got.shape == (3, 64, 8)
    assert torch.equal(got, want)


def _to_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, in, out] -> MXFP4 (blocks [E, out, in / 32, 16], scales [E, out, in / 32]): each
    group of 32 scaled by a power of two into e2m1's range, each value to its nearest code."""
    from engine.models.gpt_oss import FP4_E2M1

    w = weight.transpose(1, 2).float()
    groups = w.reshape(*w.shape[:2], -1, 32)
    top = groups.abs().amax(-1).clamp(min=2.0**-100)
    exponent = torch.ceil(torch.log2(top / 6.0))
    scaled = groups / torch.exp2(exponent)[..., None]
    magnitudes = torch.tensor(FP4_E2M1)
    index = (scaled.abs()[..., None] - magnitudes).abs().argmin(-1)
    codes = (index | ((scaled < 0).long() << 3)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + 127).to(torch.uint8)


def test_mxfp4_checkpoints_load_dequantized(gpt_oss, tmp_path):
    """A gpt-oss checkpoint with MXFP4 experts (the published format, its config's
    quantization_config) serves exactly as the float32 checkpoint of the same values."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from tests.unit.test_kernels_backend import _engine_logits

    weights = load_file(os.path.join(gpt_oss, "model.safetensors"))
    packed, plain = dict(weights), dict(weights)
    for name in [n for n in weights if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = _to_mxfp4(weights[name])
        del packed[name]
        packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
        plain[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    config = json.load(open(os.path.join(gpt_oss, "config.json")))
    folders = {}
    for kind, tensors in (("mxfp4", packed), ("plain", plain)):
        folder = tmp_path / kind
        folder.mkdir()
        for name in os.listdir(gpt_oss):
            if name not in ("model.safetensors", "config.json"):
                os.symlink(os.path.join(gpt_oss, name), folder / name)
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        quant = {"quant_method": "mxfp4"} if kind == "mxfp4" else None
        (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quant}
                                                       if quant else config))  # fmt: skip
        folders[kind] = str(folder)
    got = _engine_logits(folders["mxfp4"], "torch_native", 16)
    want = _engine_logits(folders["plain"], "torch_native", 16)
    assert len(got) == len(want) > 2
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    broken = tmp_path / "broken"  # a blocks tensor without its scales: refused with the names
    broken.mkdir()
    for name in os.listdir(folders["mxfp4"]):
        if name != "model.safetensors":
            os.symlink(os.path.join(folders["mxfp4"], name), broken / name)
    gone = "layers.0.mlp.experts.down_proj_scales"
    half = {n: t for n, t in packed.items() if not n.endswith(gone)}
    save_file(half, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises((ValueError, RuntimeError), match="down_proj_blocks"):
        _engine(str(broken))

"""References for FP8 tests: an FP8 checkpoint with its weights multiplied out, and
transformers computing W8A8 arithmetic (its quantized layers' inputs rounded to float8 and
back, their weights too for `--quantization fp8`), which is what `Fp8Linear` computes."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch

from engine.quantization import Fp8Config, quantized_linear_names
from kernels.fp8_gemm import FP8_DTYPE, dequantize_groups, quantize_groups


def dequantized_copy(fp8_path: str) -> str:
    """The FP8 checkpoint with its float8 weights multiplied out (float32, no
    quantization_config): what transformers loads as the reference's weights."""
    from safetensors.torch import load_file, save_file

    out = fp8_path + "-dequantized"
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    shutil.copytree(fp8_path, out + ".tmp", dirs_exist_ok=True)
    with open(os.path.join(fp8_path, "config.json")) as f:
        config = json.load(f)
    qc = config.pop("quantization_config")
    block = qc.get("weight_block_size")
    tensors = load_file(os.path.join(fp8_path, "model.safetensors"))
    plain = {}
    for name, tensor in tensors.items():
        if name.endswith((".weight_scale_inv", ".weight_scale", ".input_scale")):
            continue
        if tensor.dtype == FP8_DTYPE:
            base = name.removesuffix(".weight")
            if block:
                plain[name] = dequantize_groups(tensor, tensors[base + ".weight_scale_inv"], block)
            else:
                plain[name] = dequantize_groups(tensor, tensors[base + ".weight_scale"])
        else:
            plain[name] = tensor
    save_file(plain, os.path.join(out + ".tmp", "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out + ".tmp", "config.json"), "w") as f:
        json.dump(config, f)
    os.replace(out + ".tmp", out)
    return out


def hf_w8a8_logits(
    path: str,
    seqs: Any,
    group_cols: int | None,
    quantize_weights: bool = False,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> list:
    """transformers' logits (float32, on the CPU) at every position of `seqs` with the
    blocks' projections fed float8-rounded inputs (`group_cols` columns per scale; None: per
    token) and, with `quantize_weights`, their weights rounded per output channel too
    (--quantization fp8's arithmetic)."""
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {}
    with open(os.path.join(path, "config.json")) as f:
        quant = json.load(f).get("quantization_config") or {}
    if quant.get("quant_method") == "fp8":
        from transformers import FineGrainedFP8Config

        # dequantized as it loads, as transformers does unasked on a machine without a GPU:
        # with one, it keeps float8 weights and their scales apart, and `.to(dtype)` below
        # would cast those weights to `dtype` without their scales (on the H100 the
        # reference's logits were then garbage: agreement 0.004)
        kwargs["quantization_config"] = FineGrainedFP8Config(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs).to(device, dtype).eval()
    assert all(p.dtype == dtype for p in model.parameters())
    names = quantized_linear_names(model, Fp8Config(checkpoint=True))
    # GPT-2's projections are Conv1D layers in transformers: weight [in, out]
    names += [n for n, m in model.named_modules() if type(m).__name__ == "Conv1D"]
    for name in names:
        linear = model.get_submodule(name)
        transposed = type(linear).__name__ == "Conv1D"
        cols = group_cols or linear.weight.shape[0 if transposed else 1]
        if quantize_weights:
            with torch.no_grad():
                w = linear.weight.T if transposed else linear.weight
                q, s = quantize_groups(w, 1, w.shape[1])
                w.copy_(dequantize_groups(q, s))

        def fake_quant(module, args, cols=cols):
            x = args[0].reshape(-1, args[0].shape[-1])
            q, s = quantize_groups(x, 1, cols)
            return (dequantize_groups(q, s, (1, cols), args[0].dtype).view_as(args[0]),)

        linear.register_forward_pre_hook(fake_quant)
    with torch.inference_mode():
        return [model(torch.tensor([s], device=device)).logits[0].float().cpu() for s in seqs]

"""References for FP8 tests: an FP8 checkpoint with its weights multiplied out, and
transformers computing W8A8 arithmetic (its quantized layers' inputs rounded to float8 and
back, their weights too for `--quantization fp8`), which is what `Fp8Linear` computes."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch

from engine.config import MLA_MODEL_TYPES
from engine.quantization import Fp8Config, quantized_linear_names
from kernels.fp8_gemm import FP8_DTYPE, dequantize_groups, quantize_groups
from tests.teacher_forcing import BF16_SHAPE, bf16_sequences, runner_teacher_forced


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
    split: int = 1,
    int8: bool = False,
) -> list:
    """transformers' logits (float32, on the CPU) at every position of `seqs` with the
    blocks' projections fed float8-rounded inputs (`group_cols` columns per scale; None: per
    token) and, with `quantize_weights`, their weights rounded per output channel too
    (--quantization fp8's arithmetic). `split` (tensor parallelism over that many ranks): the
    row-parallel projections (o_proj, down_proj) see their input in `split` column parts,
    each its own per-token scale (and, with `quantize_weights`, weight scale per row).
    `int8`: the inputs rounded to int8 per token instead (W8A8 int: `engine.layers.int8`),
    over the checkpoint's weights as they load (a dequantized copy's)."""
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
    if model.config.model_type in MLA_MODEL_TYPES:  # (as the engine's DeepSeek models)
        model.unquantized_linears = ("kv_b_proj",)
    names = quantized_linear_names(model, Fp8Config(checkpoint=True))
    # GPT-2's projections are Conv1D layers in transformers: weight [in, out]
    names += [n for n, m in model.named_modules() if type(m).__name__ == "Conv1D"]
    for name in names:
        linear = model.get_submodule(name)
        transposed = type(linear).__name__ == "Conv1D"
        parts = split if name.rsplit(".", 1)[-1] in ("o_proj", "down_proj") else 1
        cols = group_cols or linear.weight.shape[0 if transposed else 1] // parts
        if quantize_weights:
            with torch.no_grad():
                w = linear.weight.T if transposed else linear.weight
                q, s = quantize_groups(w, 1, w.shape[1] // parts)
                w.copy_(dequantize_groups(q, s, (1, w.shape[1] // parts)))

        def fake_quant(module, args, cols=cols):
            x = args[0].reshape(-1, args[0].shape[-1])
            if int8:  # (vLLM's scaled_int8_quant: largest magnitude / 127, round to even;
                g = x.float().reshape(x.shape[0], -1, cols)  # per token or split part)
                s = g.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 127.0
                q = torch.round(g / s).clamp(-128, 127)
                return ((q * s).to(args[0].dtype).view_as(args[0]),)
            q, s = quantize_groups(x, 1, cols)
            return (dequantize_groups(q, s, (1, cols), args[0].dtype).view_as(args[0]),)

        linear.register_forward_pre_hook(fake_quant)
    with torch.inference_mode():
        return [model(torch.tensor([s], device=device)).logits[0].float().cpu() for s in seqs]


# -- the W8A8 teacher-forcing comparison (tests/gpu/test_fp8_gpu.py, benchmarks/fp8_noise.py) --
FP8_SHAPE = {**BF16_SHAPE, "num_kv_heads": 4, "head_dim": 64}  # the bf16 parity shape, GQA
FP8_BLOCK = 128  # the checkpoints' weight blocks (128 x 128, as Qwen3-*-FP8's)


def fp8_models(root: str, arch: str, qk_scale: float) -> tuple[str, str]:
    """(a float32 model of FP8_SHAPE, the same as a block FP8 checkpoint) under `root`, built
    once. float32: transformers dequantizes an FP8 checkpoint into the checkpoint's dtype, so
    from a bf16 one its float32 reference would carry bf16-rounded weights."""
    from services.tiny_fp8 import quantize_checkpoint
    from services.tiny_model import make_tiny_model

    full = os.path.join(root, f"{arch}-qk{qk_scale:g}")
    fp8 = full + "-fp8"
    if not os.path.exists(os.path.join(fp8, "config.json")):
        make_tiny_model(full, arch=arch, dtype="float32", qk_scale=qk_scale, **FP8_SHAPE)
        shutil.copytree(full, fp8 + ".tmp")
        quantize_checkpoint(fp8 + ".tmp", FP8_BLOCK)
        os.replace(fp8 + ".tmp", fp8)
    return full, fp8


def fp8_sequences(seed: int) -> tuple[list[list[int]], list[int]]:
    """The bf16 parity test's sequences with 24 decode steps each, and their prompt lengths."""
    return bf16_sequences(seed, decode=24)


def w8a8_ours(models: tuple[str, str], kind: str, seed: int, device: str, backend: str,
              dtype: str) -> list:  # fmt: skip
    """sluice's teacher-forced logits: the FP8 checkpoint (`kind` "checkpoint") or the model
    quantized as it loads (`--quantization fp8`, "online")."""
    full, fp8 = models
    seqs, prompt_lens = fp8_sequences(seed)
    if kind == "checkpoint":
        return runner_teacher_forced(fp8, seqs, prompt_lens, device, backend, dtype)
    return runner_teacher_forced(full, seqs, prompt_lens, device, backend, dtype,
                                 quantization="fp8")  # fmt: skip


def w8a8_reference(models: tuple[str, str], kind: str, seed: int, device: str,
                   dtype: str) -> list:  # fmt: skip
    """transformers' W8A8 logits for `w8a8_ours`' sequences: the checkpoint's blocks, or
    per-channel weights and per-token activations ("online")."""
    full, fp8 = models
    seqs, _ = fp8_sequences(seed)
    if kind == "checkpoint":
        return hf_w8a8_logits(fp8, seqs, FP8_BLOCK, device=device, dtype=getattr(torch, dtype))
    return hf_w8a8_logits(full, seqs, None, True, device=device, dtype=getattr(torch, dtype))

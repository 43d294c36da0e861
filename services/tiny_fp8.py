"""An FP8 checkpoint made from a model folder, laid out as the FP8 checkpoints on the Hub.

`sluice make-tiny-model DIR --quantization fp8 [--weight-block-size N]` writes a tiny model
and then this: every projection weight of the transformer blocks (`*_proj.weight`, experts'
included) becomes float8_e4m3fn with

* `--weight-block-size N` (default 16; Qwen3-*-FP8 and DeepSeek-V3 use 128): one scale per
  N x N block, `<name>.weight_scale_inv` [cdiv(out, N), cdiv(in, N)] (the multiplier, despite
  its name), config `quantization_config = {"quant_method": "fp8", "activation_scheme":
  "dynamic", "weight_block_size": [N, N]}`, as transformers' FineGrainedFP8 writes it;
* `--weight-block-size 0`: one scale per tensor, `<name>.weight_scale` [] plus a static
  `<name>.input_scale` (AutoFP8's older layout, `"activation_scheme": "static"`).

The other tensors (embeddings, norms, the LM head, MoE routers) keep their dtype.
"""

from __future__ import annotations

import json
import os
import re

import torch

from engine.loader import iter_safetensors, safetensors_files
from kernels.fp8_gemm import FP8_MAX, quantize_groups

# the blocks' projections (DeepSeek's kv_a_proj_with_mqa too)
_QUANTIZED = re.compile(r"\.(layers|h)\.\d+\..*_proj(_with_mqa)?\.weight$")


def quantize_checkpoint(path: str, block_size: int = 16) -> int:
    """Rewrite the folder's weights as an FP8 checkpoint in place; returns how many weights
    were quantized."""
    from safetensors.torch import save_file

    files = safetensors_files(path)
    out: dict[str, torch.Tensor] = {}
    count = 0
    for name, tensor in iter_safetensors(path):
        if not _QUANTIZED.search(name):
            out[name] = tensor
            continue
        count += 1
        base = name.removesuffix(".weight")
        if block_size:
            q, scale = quantize_groups(tensor, block_size, block_size)
            out[name], out[base + ".weight_scale_inv"] = q, scale
        else:
            q, scale = quantize_groups(tensor, tensor.shape[0], tensor.shape[1])
            out[name], out[base + ".weight_scale"] = q, scale.reshape(())
            out[base + ".input_scale"] = torch.tensor(1.0 / FP8_MAX)  # unused: dynamic
    for file in files:
        os.remove(file)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        os.remove(index)
    save_file(out, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic" if block_size else "static",
        **({"weight_block_size": [block_size, block_size]} if block_size else {}),
    }
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)
    return count


def add_args(parser) -> None:  # noqa: ANN001 - an argparse parser
    parser.add_argument(
        "--quantization", choices=("fp8", "w4a16", "w8a16", "w8a8", "awq", "gptq", "gptq-int8"),
        default=None,
        help="write an FP8 checkpoint (the blocks' projection weights in float8), a "
        "compressed-tensors W4A16 / W8A16 / W8A8 (int8) one, an AutoAWQ one or a GPTQ one "
        "(4- or 8-bit; services/tiny_int_weight.py)",
    )  # fmt: skip
    parser.add_argument(
        "--weight-block-size", type=int, default=16,
        help="with --quantization fp8: one scale per N x N block (0: one per tensor)",
    )  # fmt: skip


def apply(args, path: str) -> None:  # noqa: ANN001 - the parsed arguments
    if args.quantization == "fp8":
        if args.arch in ("bert", "xlm-roberta"):
            raise SystemExit("--quantization fp8: decoder models only")
        if args.weight_block_size < 0:
            raise SystemExit("--weight-block-size must be >= 0")
        quantize_checkpoint(path, args.weight_block_size)

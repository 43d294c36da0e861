"""``sluice make-tiny-lora``: a random LoRA adapter for a model folder, saved as PEFT saves one.

The folder (``adapter_config.json``, ``adapter_model.safetensors``) loads in PEFT
(``PeftModel.from_pretrained``) and in sluice (``--lora-paths``). The matrices are random, A
with unit-gain rows and B scaled so that the adapted projections differ from the base
model's by about ``strength`` of their own size: enough to change what a tiny model
generates, as a fine-tune would.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Phi-3's checkpoint fuses q/k/v and gate/up, and its PEFT adapters target the fused modules
PHI3_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def make_tiny_lora(
    model_dir: str,
    out_dir: str,
    rank: int = 8,
    alpha: float | None = None,
    targets: tuple[str, ...] = LLAMA_TARGETS + PHI3_TARGETS,
    seed: int = 0,
    strength: float = 0.5,
    use_rslora: bool = False,
    rank_pattern: dict[str, int] | tuple[tuple[str, int], ...] = (),
    alpha_pattern: dict[str, float] | tuple[tuple[str, float], ...] = (),
) -> str:
    """Write a random rank-``rank`` adapter of ``targets`` for the model in ``model_dir``
    (PEFT's `rank_pattern` / `alpha_pattern`, as dicts or (key, value) pairs: some modules'
    own ranks and alphas)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from engine.lora.adapter import pattern_value

    alpha = float(alpha if alpha is not None else 2 * rank)
    rank_pattern, alpha_pattern = dict(rank_pattern), dict(alpha_pattern)
    weights = _model_weights(model_dir)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(weights):
        module = name.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] not in targets or not name.endswith(".weight"):
            continue
        with safe_open(weights[name], framework="pt") as f:
            w = f.get_tensor(name).float()
        out_f, in_f = w.shape
        r = int(pattern_value(rank_pattern, module, rank))
        a_m = float(pattern_value(alpha_pattern, module, alpha))
        scaling = a_m / r**0.5 if use_rslora else a_m / r
        a = torch.randn(r, in_f, generator=gen) / in_f**0.5
        # B @ A @ x has about |B| * |x| per output; a row of w gives |w_row| * |x|
        row_norm = float(w.norm(dim=1).mean())
        b = torch.randn(out_f, r, generator=gen) * (strength * row_norm / r**0.5 / scaling)
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.contiguous()
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.contiguous()
    if not tensors:
        raise ValueError(f"{model_dir}: no weights of the modules {list(targets)}")
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": os.path.abspath(model_dir),
        "r": rank,
        "lora_alpha": alpha,
        "use_rslora": use_rslora,
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
        "target_modules": sorted({k.split(".")[-3] for k in tensors}),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return out_dir


def _model_weights(model_dir: str) -> dict[str, str]:
    """Tensor name -> the safetensors file holding it."""
    from safetensors import safe_open

    from engine.loader import safetensors_files

    out = {}
    for file in safetensors_files(model_dir):
        with safe_open(file, framework="pt") as f:
            out.update(dict.fromkeys(f.keys(), file))
    return out


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "make-tiny-lora", help="write a random LoRA adapter (PEFT folder) for a model folder"
    )
    parser.add_argument("model_dir", metavar="MODEL_DIR")
    parser.add_argument("out_dir", metavar="DIR")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=None, help="default: 2 x rank")
    parser.add_argument("--targets", nargs="+", default=list(LLAMA_TARGETS + PHI3_TARGETS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--strength", type=float, default=0.5)
    parser.add_argument("--use-rslora", action="store_true")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    out = make_tiny_lora(
        args.model_dir, args.out_dir, args.rank, args.alpha, tuple(args.targets), args.seed,
        args.strength, args.use_rslora,
    )  # fmt: skip
    print(out)
    return 0

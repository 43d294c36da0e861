"""FP8 weights against the full-precision model, side by side in one run: weight memory,
teacher-forced agreement, decode and prefill speed.

    python benchmarks/fp8.py [--preset small] [--device cpu] [--dtype float32]
    python benchmarks/fp8.py --preset llama-3.2-1b --device cuda --dtype bfloat16 --name gpu_fp8

Arms on one random model (`--preset`, saved in float32), run in `--dtype`: the model as it is
(`full`), `--quantization fp8` on it (`online`: per-channel weight scales), and the same
weights written as a block-scaled FP8 checkpoint (`checkpoint`: 128 x 128 blocks, as
Qwen3-*-FP8), both W8A8 with activations scaled per token (and 128 columns for the checkpoint).
Two more, scored only: the model in float32 (the reference every arm is scored against) and
in bfloat16 (one of them is `full`).

* memory: bytes of the transformer blocks' linear weights (and scales) and of all weights;
  with `--arch` a MoE (qwen3_moe...), of its experts too (float8 in both FP8 arms);
* agreement: each arm's prompt logprobs (`logprob_start_len=0`, `top_logprobs_num=1`) on
  `--prompts` random prompts against float32's: how often its top token is float32's, and
  |delta logprob| of the prompt's tokens. Random weights make a model that amplifies any
  rounding layer after layer (bfloat16 rounding alone moves its top token at some positions),
  so the bfloat16 row is the scale to read the FP8 rows by; a trained model loses far less;
* speed: decode ms per token at batch 1 (`--decode-tokens` after a 16-token prompt) and
  prefill tokens/s (`--prefill-prompts` x 512 tokens, one output token each), through the
  engine with its defaults (CUDA graphs and the overlap loop on a GPU).

On a CPU the FP8 layers dequantize their weights on every forward (there are no float8
matmuls): slower than full precision there, which this reports as measured; the speed the
format is for is the GPU's, where decode reads half the bytes of bfloat16 weights.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.common import (  # noqa: E402
    add_weight_format_args,
    against_full,
    decode_and_prefill_speed,
    expert_bytes,
    print_table,
    prompt_agreement,
    random_prompts,
    score_prompts,
    write_result,
)

ARMS = ("full", "online", "checkpoint")  # timed; "float32" and "bfloat16" are scored only


def make_models(preset: str, root: str, block: int, arch: str | None = None) -> dict[str, str]:
    from services.tiny_fp8 import quantize_checkpoint
    from services.tiny_model import make_tiny_model

    full = make_tiny_model(os.path.join(root, "full"), arch=arch, preset=preset)
    fp8 = os.path.join(root, "fp8")
    shutil.copytree(full, fp8)
    quantize_checkpoint(fp8, block)
    return {"full": full, "online": full, "checkpoint": fp8, "float32": full, "bfloat16": full}


def weight_bytes(engine: Any) -> dict[str, int]:
    model = engine.scheduler.model_runner.model
    if model is None:  # the CPU overlap loop's device process holds it
        return {}
    from engine.layers.fp8 import Fp8Linear
    from engine.quantization import Fp8Config, quantized_linear_names

    linears = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    if not linears:
        names = quantized_linear_names(model, Fp8Config(checkpoint=False))
        linears = [model.get_submodule(n) for n in names]
    block = sum(m.weight.nbytes + getattr(m, "weight_scale", m.weight[:0]).nbytes for m in linears)
    total = sum(p.nbytes for p in model.parameters()) + sum(b.nbytes for b in model.buffers())
    return {"block_linear_bytes": block, "all_weight_bytes": total, **expert_bytes(model)}


def run_arm(path: str, arm: str, args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    from engine.engine import Engine

    kwargs: dict[str, Any] = {"quantization": "fp8"} if arm == "online" else {}
    dtype = arm if arm in ("float32", "bfloat16") else args.dtype
    with Engine(
        model_path=path, device=args.device, dtype=dtype, skip_tokenizer_init=True,
        disable_overlap_schedule=args.device == "cpu", max_total_tokens=args.kv_tokens,
        gemv_backend=args.gemv_backend, **kwargs,
    ) as engine:  # fmt: skip
        out: dict[str, Any] = {"arm": arm, **weight_bytes(engine), **score_prompts(engine, prompts)}
        if arm not in ARMS:
            return out
        out.update(decode_and_prefill_speed(engine, prompts, args))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_weight_format_args(p, "fp8")
    p.add_argument("--block", type=int, default=128, help="the checkpoint's weight_block_size")
    p.add_argument("--gemv-backend", default="auto",
                   help="every arm's: auto (on CUDA the Triton GEMVs at batch 1, the float8 one "
                        "for the FP8 arms) or torch (cuBLAS; the float8 GEMM)")  # fmt: skip
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="sluice-fp8-") as root:
        paths = make_models(args.preset, root, args.block, args.arch)
        prompts = random_prompts(paths["full"], args.prompts, args.prompt_len)
        arms = {arm: run_arm(paths[arm], arm, args, prompts) for arm in ARMS}
        for arm in ("float32", "bfloat16"):
            arms[arm] = (
                arms["full"] if args.dtype == arm else run_arm(paths[arm], arm, args, prompts)
            )
    full, reference = arms["full"], arms["float32"]
    rows = []
    shown = ARMS if args.dtype == "bfloat16" else (*ARMS, "bfloat16")
    for arm in shown:
        out = arms[arm]
        row = {k: v for k, v in out.items() if not k.startswith("prompt_")}
        row["arm"] = arm if arm in ARMS or args.dtype == arm else f"{arm} (scored only)"
        if arm == "full":
            row["arm"] = f"full ({args.dtype})"
        if out is not reference:
            row.update(prompt_agreement(out, reference))
        if arm in ("online", "checkpoint"):
            against_full(row, out, full)
        rows.append(row)
    print_table(rows, ["arm", "block_linear_bytes", "all_weight_bytes", "expert_bytes",
                       "top1_agreement",
                       "mean_abs_dlogprob", "decode_ms_per_token", "prefill_tok_s",
                       "decode_speedup", "prefill_speedup"])  # fmt: skip
    by_arm = dict(zip(shown, rows))
    summary = {
        "bf16_top1_agreement": prompt_agreement(arms["bfloat16"], reference)["top1_agreement"],
        "fp8_block_linear_bytes_ratio": by_arm["online"].get("block_linear_bytes_ratio"),
        "fp8_online_top1_agreement": by_arm["online"]["top1_agreement"],
        "fp8_checkpoint_top1_agreement": by_arm["checkpoint"]["top1_agreement"],
        "fp8_online_decode_speedup": by_arm["online"]["decode_speedup"],
        "fp8_checkpoint_decode_speedup": by_arm["checkpoint"]["decode_speedup"],
        "fp8_checkpoint_prefill_speedup": by_arm["checkpoint"]["prefill_speedup"],
    }
    if "expert_bytes_ratio" in by_arm["checkpoint"]:  # (a MoE)
        summary["fp8_checkpoint_expert_bytes_ratio"] = by_arm["checkpoint"]["expert_bytes_ratio"]
        summary["fp8_online_expert_bytes_ratio"] = by_arm["online"]["expert_bytes_ratio"]
    config = {k: v for k, v in vars(args).items()}
    print(write_result(args.name, rows, summary, config=config))


if __name__ == "__main__":
    main()

"""Integer weights (compressed-tensors W4A16 / W8A16 / W8A8, GPTQ) against the full-precision
model, side by side in one run: weight memory, teacher-forced agreement, decode and prefill speed.

    python benchmarks/int_weight.py [--preset small] [--device cpu] [--dtype float32]
    python benchmarks/int_weight.py --arch qwen3_moe --name int_weight_moe
    python benchmarks/int_weight.py --preset llama-3.2-1b --device cuda --dtype bfloat16 \\
        --name gpu_int_weight

Arms on one random model (`--preset`, saved in float32), run in `--dtype`: the model as it
is (`full`), and its weights written by compressed-tensors' compressor
(services/tiny_int_weight.py) as `w4a16` (4 bits, a scale per 128 input columns: the
`*-quantized.w4a16` checkpoints' scheme), `w8a16` (8 bits, a scale per output channel) and
`gptq-act-order` (w4a16's scheme over each layer's columns in a permuted order, rewritten as
a GPTQ checkpoint with desc_act: the engine permutes each layer's input before its GEMM) and
`w8a8` (int8 weights per channel and int8 activations per token).
The model in float32 is the reference the arms are scored against. `--arch qwen3_moe` (a
MoE, its experts 768 features wide as Qwen3-30B-A3B's) quantizes the experts alike in every
arm (W8A8's int8, run as W8A16) and adds their bytes (`expert_bytes`).

* memory: bytes of the transformer blocks' linear weights (with scales) and of all weights;
* agreement: each arm's prompt logprobs on `--prompts` random prompts against float32's:
  how often its top token is float32's, and |delta logprob| of the prompt's tokens (random
  weights amplify any rounding layer after layer: read the rows against each other);
* speed: decode ms per token at batch 1 and prefill tokens/s through the engine with its
  defaults (CUDA graphs and the overlap loop on a GPU).

On a CPU the integer layers dequantize their weights on every forward: slower than full
precision there, which this reports as measured; the speed the format is for is a GPU's,
where decode reads a quarter (4 bits) or half (8 bits) of bf16's weight bytes.

On a GPU a second table times the kernels at one row (decode at batch 1) on Llama 3.2 1B's
projections: bf16 `F.linear` (cuBLAS), and the W4A16 (groups of 128) and W8A16 (per
channel) weights through the one-row GEMV kernel and through the GEMM (16-row tiles),
microseconds per call and the HBM bandwidth that is (each timing a CUDA graph cycling over
copies of the weight past the L2, as benchmarks/gpu_gemv.py times them); and the fused MoE
at Qwen3-30B-A3B's shape, bf16 experts against W4A16 (also with GPTQ's activation ordering)
and W8A16 ones, at 1 and 64 tokens.
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

# bits, group (None: per channel), and how: weight-only, a GPTQ rewrite with activation
# ordering, or int8 activations too (W8A8, engine/layers/int8.py)
ARMS = {"full": None, "w4a16": (4, 128, None), "w8a16": (8, None, None),
        "gptq-act-order": (4, 128, "gptq"), "w8a8": (8, None, "w8a8")}  # fmt: skip


def make_models(preset: str, root: str, arch: str | None = None) -> dict[str, str]:
    """The full model and each arm's checkpoint; a MoE's experts (768 features, Qwen3-30B-A3B's:
    whole groups of 128) quantized alike (`quantize_experts`; W8A8's int8 per channel)."""
    from services.tiny_int_weight import quantize_checkpoint, quantize_experts, to_gptq
    from services.tiny_model import MOE_ARCHS, make_tiny_model

    moe = arch in MOE_ARCHS
    sizes = {"moe_intermediate_size": 768} if moe else {}
    full = make_tiny_model(os.path.join(root, "full"), arch=arch, preset=preset, **sizes)
    paths = {"full": full, "float32": full}
    for arm, scheme in ARMS.items():
        if scheme is not None:
            bits, group, kind = scheme
            paths[arm] = os.path.join(root, arm)
            shutil.copytree(full, paths[arm])
            quantize_checkpoint(paths[arm], bits, group, act_order=kind == "gptq",
                                activations=kind == "w8a8")  # fmt: skip
            if moe:
                quantize_experts(paths[arm], bits, group, act_order=kind == "gptq",
                                 int8=kind == "w8a8")  # fmt: skip
            if kind == "gptq":
                to_gptq(paths[arm], act_order=True)
    return paths


def weight_bytes(engine: Any) -> dict[str, int]:
    model = engine.scheduler.model_runner.model
    if model is None:  # the CPU overlap loop's device process holds it
        return {}
    from engine.layers.int8 import Int8Linear
    from engine.layers.int_weight import IntWeightLinear
    from engine.quantization import IntWeightConfig, quantized_linear_names

    linears = [m for m in model.modules() if isinstance(m, IntWeightLinear | Int8Linear)]
    if not linears:
        names = quantized_linear_names(model, IntWeightConfig(4, None, True))
        linears = [model.get_submodule(n) for n in names]
    block = sum(sum(t.nbytes for t in m.buffers()) + m.weight.nbytes for m in linears)
    total = sum(p.nbytes for p in model.parameters()) + sum(b.nbytes for b in model.buffers())
    return {"block_linear_bytes": block, "all_weight_bytes": total, **expert_bytes(model)}


def run_arm(path: str, arm: str, args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    from engine.engine import Engine

    dtype = "float32" if arm == "float32" else args.dtype
    with Engine(
        model_path=path, device=args.device, dtype=dtype, skip_tokenizer_init=True,
        disable_overlap_schedule=args.device == "cpu", max_total_tokens=args.kv_tokens,
    ) as engine:  # fmt: skip
        out: dict[str, Any] = {"arm": arm, **weight_bytes(engine), **score_prompts(engine, prompts)}
        if arm not in ARMS:
            return out
        out.update(decode_and_prefill_speed(engine, prompts, args))
    return out


KERNEL_SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048),
                 "down": (2048, 8192)}  # fmt: skip


def _cycle_us(call: Any, weights: list) -> float:
    """Microseconds per `call(w)`, w cycling over `weights` (a CUDA graph's calls)."""
    import itertools

    from benchmarks.gpu_fused_kernels import graph_us

    turn = itertools.cycle(weights)
    return graph_us(lambda: call(next(turn)))


def _int_call(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bits: int, group: int,
              gemv: bool) -> torch.Tensor:  # fmt: skip
    from kernels.int_gemm import int_gemm

    return int_gemm(x, w, scale, None, bits, group, gemv=gemv)


def kernel_rows() -> list[dict[str, Any]]:
    """One row through each projection: bf16 F.linear, each weight-only format's GEMV and
    GEMM, and W8A8 int8 (its activation quantization and the int8 GEMV, or torch._int_mm;
    microseconds; GB/s of the weight bytes, scales and zero points included)."""
    import functools

    import torch.nn.functional as F

    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in KERNEL_SHAPES.items():
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        copies = max(1, -(-(256 << 20) // (n * k * 2)))
        dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
                 for _ in range(copies)]  # fmt: skip
        us = _cycle_us(functools.partial(F.linear, x), dense)
        rows.append({"shape": name, "format": "bf16", "kernel": "cublas", "us": us,
                     "gb_s": n * k * 2 / us / 1e3})  # fmt: skip
        dense.clear()
        for fmt, bits, group in (("w4a16 g128", 4, 128), ("w8a16 channel", 8, k)):
            words = [torch.randint(-(2**31), 2**31 - 1, (n, k * bits // 32), dtype=torch.int32,
                                   device="cuda", generator=gen) for _ in range(copies)]
            scale = torch.rand(n, k // group, device="cuda", generator=gen).bfloat16() * 0.01
            nbytes = words[0].nbytes + scale.nbytes
            for gemv in (True, False):
                call = functools.partial(_int_call, x, scale=scale, bits=bits, group=group,
                                         gemv=gemv)  # fmt: skip

                us = _cycle_us(call, words)
                rows.append({"shape": name, "format": fmt, "kernel": "gemv" if gemv else "gemm",
                             "us": us, "gb_s": nbytes / us / 1e3})  # fmt: skip
            words.clear()
        int8 = [torch.randint(-128, 128, (n, k), dtype=torch.int8, device="cuda", generator=gen)
                for _ in range(copies)]  # fmt: skip
        scale = torch.rand(n, device="cuda", generator=gen) * 1e-3
        for kernel, call in (("gemv", _w8a8_call), ("int_mm", _w8a8_int_mm)):
            us = _cycle_us(functools.partial(call, x, scale=scale), int8)
            rows.append({"shape": name, "format": "w8a8", "kernel": kernel, "us": us,
                         "gb_s": (n * k + scale.nbytes) / us / 1e3})  # fmt: skip
        int8.clear()
        torch.cuda.empty_cache()
    return rows + moe_rows()


def _w8a8_call(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """W8A8 as the layer runs it (one row: the int8 GEMV, `fp8_gemv`'s int8 mode)."""
    from engine.layers.int8 import int8_linear

    return int8_linear(x, w, scale)


def _w8a8_int_mm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """W8A8 of one row through torch._int_mm, the row padded to 17 (the GEMV's peer)."""
    import torch.nn.functional as F

    from kernels.fp8_gemm import quantize_rows_int8_triton

    q, s = quantize_rows_int8_triton(x)
    acc = torch._int_mm(F.pad(q, (0, 0, 0, 16)), w.t())[:1].float()
    return (acc * s[:, None] * scale[None, :]).to(x.dtype)


def moe_rows() -> list[dict[str, Any]]:
    """The fused MoE at Qwen3-30B-A3B's shape (128 experts, top 8, 2048 wide, 768 inner) at 1
    and 64 tokens: bf16 experts against W4A16 ones (groups of 128), W8A16 ones per channel
    (how a W8A8 checkpoint's int8 experts run) and W4A16 ones with GPTQ's activation ordering
    (each expert's input columns gathered in its own order) through the same grouped GEMMs;
    GB/s of all the experts' bytes (at 64 tokens nearly every expert runs)."""
    import dataclasses
    import functools

    from benchmarks.gpu_fused_kernels import graph_us
    from engine.layers.int_experts import IntExperts
    from engine.layers.moe import select_experts
    from kernels.fused_moe import fused_experts_triton

    experts, top_k, hidden, inter = 128, 8, 2048, 768
    gen = torch.Generator(device="cuda").manual_seed(1)

    def dense(n: int, k: int) -> torch.Tensor:
        return torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16, generator=gen)

    def packed(n: int, k: int, bits: int = 4, group: int = 128) -> IntExperts:
        words = torch.randint(-(2**31), 2**31 - 1, (experts, n, k * bits // 32),
                              dtype=torch.int32, device="cuda", generator=gen)  # fmt: skip
        scale = torch.rand(experts, n, k // group, device="cuda", generator=gen).bfloat16() * 0.01
        return IntExperts(words, scale, None, bits, group, k)

    def per_channel(n: int, k: int) -> IntExperts:  # (a W8A8 checkpoint's int8 experts)
        return packed(n, k, 8, k)

    def act_order(n: int, k: int) -> IntExperts:  # (GPTQ's desc_act: each expert's order)
        perm = torch.stack([torch.randperm(k, device="cuda", generator=gen)
                            for _ in range(experts)]).to(torch.int32)  # fmt: skip
        return dataclasses.replace(packed(n, k), perm=perm)

    rows = []
    formats = (("bf16", dense), ("w4a16 g128", packed), ("w8a16 channel", per_channel),
               ("w4a16 g128 act order", act_order))  # fmt: skip
    for fmt, make in formats:
        w13, w2 = make(2 * inter, hidden), make(hidden, inter)
        nbytes = sum(t.nbytes for w in (w13, w2)
                     for t in ((w,) if isinstance(w, torch.Tensor) else (w.packed, w.scale)))
        nbytes += sum(w.perm.nbytes for w in (w13, w2) if getattr(w, "perm", None) is not None)
        for tokens in (1, 64):
            x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
            logits = torch.randn(tokens, experts, device="cuda", generator=gen)
            weights, ids = select_experts(logits, top_k, True)
            call = functools.partial(fused_experts_triton, x, w13, w2, weights, ids)
            us = graph_us(call)
            rows.append({"shape": f"moe T{tokens}", "format": fmt, "kernel": "grouped gemm",
                         "us": us, "gb_s": nbytes / us / 1e3})  # fmt: skip
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_weight_format_args(p, "int_weight")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="sluice-int-weight-") as root:
        paths = make_models(args.preset, root, args.arch)
        prompts = random_prompts(paths["full"], args.prompts, args.prompt_len)
        arms = {arm: run_arm(paths[arm], arm, args, prompts) for arm in ARMS}
        arms["float32"] = (
            arms["full"] if args.dtype == "float32"
            else run_arm(paths["float32"], "float32", args, prompts)
        )  # fmt: skip
    full, reference = arms["full"], arms["float32"]
    rows = []
    for arm in ARMS:
        out = arms[arm]
        row = {k: v for k, v in out.items() if not k.startswith("prompt_")}
        row["arm"] = f"full ({args.dtype})" if arm == "full" else arm
        if out is not reference:
            row.update(prompt_agreement(out, reference))
        if arm != "full":
            against_full(row, out, full)
        rows.append(row)
    print_table(rows, ["arm", "block_linear_bytes", "all_weight_bytes", "expert_bytes",
                       "top1_agreement",
                       "mean_abs_dlogprob", "decode_ms_per_token", "prefill_tok_s",
                       "decode_speedup", "prefill_speedup"])  # fmt: skip
    by_arm = dict(zip(ARMS, rows))
    summary = {
        f"{arm}_{key}": by_arm[arm].get(key)
        for arm in ("w4a16", "w8a16", "gptq-act-order", "w8a8")
        for key in ("block_linear_bytes_ratio", "expert_bytes_ratio", "top1_agreement",
                    "decode_speedup", "prefill_speedup")
        if key != "expert_bytes_ratio" or "expert_bytes" in full  # (a MoE)
    }  # fmt: skip
    extra = {}
    if args.device == "cuda":
        kernels = kernel_rows()
        print_table(kernels, ["shape", "format", "kernel", "us", "gb_s"])
        extra["kernels"] = kernels
        per_format = {}
        for r in kernels:
            per_format.setdefault((r["format"], r["kernel"]), 0.0)
            per_format[(r["format"], r["kernel"])] += r["us"]
        for fmt in ("w4a16 g128", "w8a16 channel"):  # (one layer's four projections)
            key = fmt.split()[0]
            summary[f"{key}_gemv_vs_gemm_one_row"] = (
                per_format[(fmt, "gemm")] / per_format[(fmt, "gemv")]
            )
            summary[f"{key}_gemv_vs_bf16_one_row"] = (
                per_format[("bf16", "cublas")] / per_format[(fmt, "gemv")]
            )
        summary["w8a8_gemv_vs_int_mm_one_row"] = (
            per_format[("w8a8", "int_mm")] / per_format[("w8a8", "gemv")]
        )
        summary["w8a8_gemv_vs_bf16_one_row"] = (
            per_format[("bf16", "cublas")] / per_format[("w8a8", "gemv")]
        )
        moe = {(r["shape"], r["format"]): r["us"] for r in kernels if r["shape"].startswith("moe")}
        for tokens in (1, 64):  # (bf16 time over the integer one: > 1 is faster)
            for fmt, key in (("w4a16 g128", "w4a16"), ("w8a16 channel", "w8a16"),
                             ("w4a16 g128 act order", "w4a16_act_order")):  # fmt: skip
                summary[f"moe_{key}_vs_bf16_T{tokens}"] = (
                    moe[(f"moe T{tokens}", "bf16")] / moe[(f"moe T{tokens}", fmt)]
                )
    print(write_result(args.name, rows, summary, config=dict(vars(args)), **extra))


if __name__ == "__main__":
    main()

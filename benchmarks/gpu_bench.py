"""GPU benchmarks: seed-shape offline throughput, decode at batch 1 against the HBM roofline,
and the overlap scheduler on vs off with the GPU's idle time per decode step.

    python benchmarks/gpu_bench.py {seed-shape,decode-bs1,overlap,all} [--profile]
    python benchmarks/gpu_bench.py all --device cpu --quick     # the code paths, in seconds

* seed-shape: a GPT-2 (124M) shaped random model, 128 prompts x 256 input / 64 output tokens,
  ignore_eos: output tokens/s of sluice and of transformers' continuous batching (its GPU
  defaults, and with CUDA graphs forced on: the faster one is the baseline), one after the
  other in this process on the same GPU and weights, each after a warm-up wave of the same
  shape; the median of three timed waves. Anchor: SGLang 15,538 output tok/s, vLLM 9,024
  on this workload. Their `dtype=auto` runs GPT-2's float32 checkpoint in float16; we run
  bfloat16 (the same tensor-core rate and bytes per weight on Hopper; `--dtype float16`
  reproduces theirs).
* decode-bs1: one request on a Llama-3.2-1B shaped random model (bf16): ms per output token
  in steady decode, CUDA graphs on and off (and flashinfer's decode kernels beside the default
  Triton one), against bytes-per-token / HBM bandwidth. Bytes: the
  model's unique parameter storage (the tied embedding counted once: decode reads it whole as
  lm_head) plus the KV cache read. Bandwidth: the device's datasheet figure (named in the
  JSON; H100 SXM 3.35 TB/s) and the copy bandwidth measured in the same run.
* overlap: decode at batch 64 and 256 (GPT-2 shape by default), overlap on vs off: throughput
  of whole runs, host step time, and GPU idle time per decode step: 1 - busy / period over a
  window of steady decode steps. Busy is read off the kernel timeline (torch.profiler, CUDA
  activity only; with CPU ops too if that records no kernel): the union of kernel intervals,
  all streams, per step. The period is measured without a profiler, from CUDA events on the
  forward stream at each launch (`gpu_timeline.StepEvents`): the trace slows a host-bound
  loop's host (0.74 ms a step unprofiled, 1.17 ms traced, at batch 64 in the fourth GPU
  session), so the trace's own idle fraction overstates it; it is reported beside
  (`idle_fraction_profiled`, with its "bubbles": gaps of 20 us or more).

`--profile` also writes a torch profiler table (CPU ops and kernels) per benchmark to
results/gpu_<name>_profile.txt and a kernel-timeline summary into the JSON: where a goal is
missed, that says where the time goes. `--device cpu --quick` shrinks models and workloads so
that every path runs on a CPU in seconds (tests/unit/test_gpu_bench_smoke.py).

Results: results/gpu_<name>.json (`_quick` in quick mode), and the headline keys merged into
results/gpu_summary.json.
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # noqa: E402
from benchmarks.gpu_common import Ctx  # noqa: E402
from benchmarks.gpu_decode_bs1 import decode_bs1  # noqa: E402
from benchmarks.gpu_overlap import overlap  # noqa: E402
from benchmarks.gpu_seed_shape import seed_shape  # noqa: E402


def resolve_backend(device: str, requested: str | None) -> tuple[str | None, str | None]:
    """The backend to run and a note when the GPU default (flashinfer) is unavailable."""
    if requested or not device.startswith("cuda"):
        return requested, None
    try:
        import flashinfer  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means: not usable here
        return "triton", f"flashinfer not importable ({exc!r}); ran triton"
    return None, None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bench", choices=("seed-shape", "decode-bs1", "overlap", "all"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--quick", action="store_true", help="tiny models and workloads")
    ap.add_argument("--profile", action="store_true", help="torch profiler tables too")
    ap.add_argument("--attention-backend", default=None)
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="extra EngineArgs (python literals), e.g. cuda_graph_max_bs=160")
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument("--decode-configs", nargs="+",
                    default=["cuda_graph", "cuda_graph_cublas", "cuda_graph_flashinfer_decode",
                             "cuda_graph_cuda_core_decode", "cuda_graph_triton_gemv",
                             "cuda_graph_torch_layers", "cuda_graph_merge_kernel",
                             "cuda_graph_cublas_pdl", "no_cuda_graph"],
                    help="decode-bs1's configurations (cuda_graph, the result, always first)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--overlap-preset", default="gpt2-124m",
                    choices=("gpt2-124m", "llama-3.2-1b"))
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "sluice-gpu-bench"))
    ap.add_argument("--tag", default="",
                    help="an experiment: results into gpu_<bench>_<tag>.json, apart")
    ap.add_argument("--results-dir", default=None, help="default: benchmarks/results")
    return ap.parse_args(argv)


def _engine_args(pairs: list[str]) -> dict[str, Any]:
    out = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


BENCHES: dict[str, Callable[[Ctx, argparse.Namespace], dict[str, Any]]] = {
    "seed-shape": seed_shape, "decode-bs1": decode_bs1, "overlap": overlap}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.results_dir:
        common.RESULTS_DIR = args.results_dir
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --device cpu --quick for a smoke run")
    backend, note = resolve_backend(args.device, args.attention_backend)
    if note:
        print("note:", note)
    ctx = Ctx(device=args.device, quick=args.quick, profile=args.profile,
              dtype=args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"),
              attention_backend=backend, engine_args=_engine_args(args.engine_arg),
              model_dir=args.model_dir, tag=args.tag)
    summary: dict[str, Any] = {}
    for name in (BENCHES if args.bench == "all" else [args.bench]):
        t = time.perf_counter()
        summary.update(BENCHES[name](ctx, args))
        print(f"[{name}] {time.perf_counter() - t:.1f}s", flush=True)
    return summary


if __name__ == "__main__":
    main()

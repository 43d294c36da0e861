"""GPU benchmarks: seed-shape offline throughput, decode at batch 1 against the HBM roofline,
and the overlap scheduler on vs off with the GPU's idle time per decode step.

    python benchmarks/gpu_bench.py {seed-shape,decode-bs1,overlap,all} [--profile]
    python benchmarks/gpu_bench.py all --device cpu --quick     # the code paths, in seconds

* seed-shape: a GPT-2 (124M) shaped random model, 128 prompts x 256 input / 64 output tokens,
  ignore_eos: output tokens/s of sluice and of transformers' continuous batching (its GPU
  defaults, and with CUDA graphs forced on: the faster one is the baseline), one after the
  other in this process on the same GPU and weights, each after a warm-up wave of the same
  shape. Anchor: SGLang 15,538 output tok/s, vLLM 9,024 on this workload. Their
  `dtype=auto` runs GPT-2's float32 checkpoint in float16; we run bfloat16 (the same
  tensor-core rate and bytes per weight on Hopper; `--dtype float16` reproduces theirs).
* decode-bs1: one request on a Llama-3.2-1B shaped random model (bf16): ms per output token
  in steady decode, CUDA graphs on and off, against bytes-per-token / HBM bandwidth. Bytes: the
  model's unique parameter storage (the tied embedding counted once: decode reads it whole as
  lm_head) plus the KV cache read. Bandwidth: the device's datasheet figure (named in the
  JSON; H100 SXM 3.35 TB/s) and the copy bandwidth measured in the same run.
* overlap: decode at batch 64 and 256 (GPT-2 shape by default), overlap on vs off: throughput
  of whole runs, host step time, and GPU idle time per decode step. Idle is read off the
  kernel timeline (torch.profiler, CUDA activity only, so the host is not slowed by recording
  its ops; with CPU ops too if that records no kernel): over a window of steady decode
  steps, idle = window - union of kernel intervals, all streams. Every gap counts, the ~2 us
  between kernels of a graph included; gaps of 20 us or more ("bubbles", the host stalls
  overlap exists to hide) are reported apart.

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
import dataclasses
import gc
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # noqa: E402
from benchmarks.common import print_table, run_transformers_cb  # noqa: E402

ANCHORS = {"sglang_output_tok_s": 15538, "vllm_output_tok_s": 9024,
           "anchor_dtype": "float16 (SGLang/vLLM dtype=auto turns a float32 checkpoint into fp16)"}
# Datasheet HBM bandwidth, first match on the device name (bytes/s).
DATASHEET_BW = [("H200", 4.8e12, "H200 SXM datasheet 4.8 TB/s"),
                ("H100 NVL", 3.9e12, "H100 NVL datasheet 3.9 TB/s"),
                ("H100 PCIe", 2.0e12, "H100 PCIe datasheet 2.0 TB/s"),
                ("H100", 3.35e12, "H100 SXM5 80GB HBM3 datasheet 3.35 TB/s")]
BUBBLE_US = 20.0
# Quick mode: the presets' code paths (GPT-2 / Llama-3 rope, tied embeddings) at tiny sizes.
QUICK_SHAPES = {
    "gpt2-124m": dict(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=256,
                      vocab_size=1536),
    "llama-3.2-1b": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                         intermediate_size=128, vocab_size=1536, max_position_embeddings=16384),
}


@dataclasses.dataclass(frozen=True)
class Ctx:
    device: str
    dtype: str
    quick: bool
    profile: bool
    attention_backend: str | None
    engine_args: dict[str, Any]
    model_dir: str
    seed: int = 0

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    def name(self, base: str) -> str:
        return f"gpu_{base}_quick" if self.quick else f"gpu_{base}"


# -- setup ------------------------------------------------------------------------------------
def build_model(ctx: Ctx, preset: str) -> str:
    """A random `preset` model folder (cached by preset, dtype and quick)."""
    from services.tiny_model import make_tiny_model

    tag = f"{preset}-{'float32' if ctx.quick else ctx.dtype}{'-quick' if ctx.quick else ''}"
    path = os.path.join(ctx.model_dir, tag)
    if not os.path.exists(os.path.join(path, "config.json")):
        t = time.perf_counter()
        shape = QUICK_SHAPES[preset] if ctx.quick else {}
        make_tiny_model(path, preset=preset, seed=ctx.seed,
                        dtype="float32" if ctx.quick else ctx.dtype, **shape)
        print(f"built {path} in {time.perf_counter() - t:.1f}s", flush=True)
    return path


def resolve_backend(device: str, requested: str | None) -> tuple[str | None, str | None]:
    """The backend to run and a note when the GPU default (flashinfer) is unavailable."""
    if requested or not device.startswith("cuda"):
        return requested, None
    try:
        import flashinfer  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means: not usable here
        return "triton", f"flashinfer not importable ({exc!r}); ran triton"
    return None, None


def device_info(device: str) -> dict[str, Any]:
    if not device.startswith("cuda"):
        return {"type": "cpu", "name": common.machine_info()["cpu_model"]}
    p = torch.cuda.get_device_properties(0)
    return {"type": "cuda", "name": p.name, "capability": f"{p.major}.{p.minor}",
            "memory_gib": round(p.total_memory / 2**30, 1),
            "multiprocessors": p.multi_processor_count, "torch_cuda": torch.version.cuda}


def sync(ctx: Ctx) -> None:
    if ctx.cuda:
        torch.cuda.synchronize()


def release(ctx: Ctx) -> None:
    gc.collect()
    if ctx.cuda:
        torch.cuda.empty_cache()


def make_engine(ctx: Ctx, path: str, **overrides: Any) -> Any:
    from engine.engine import Engine

    kw: dict[str, Any] = dict(model_path=path, device=ctx.device, dtype=ctx.dtype)
    if ctx.attention_backend:
        kw["attention_backend"] = ctx.attention_backend
    kw.update(ctx.engine_args)
    kw.update(overrides)
    return Engine(**kw)


def random_prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


# -- kernel timeline --------------------------------------------------------------------------
def busy_union(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by a set of [start, end) intervals (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def gaps(intervals: list[tuple[float, float]]) -> list[float]:
    """The idle gaps between the merged intervals, in order."""
    out, end = [], None
    for s, e in sorted(intervals):
        if end is not None and s > end:
            out.append(s - end)
        end = e if end is None else max(end, e)
    return out


def timeline_summary(events: list[dict], num_steps: int) -> dict[str, Any]:
    """Device busy / idle over the kernels of a chrome trace (times in us)."""
    kernels = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel"]
    copies = [e["dur"] for e in events if e.get("cat") in ("gpu_memcpy", "gpu_memset")]
    if not kernels:
        cats = sorted({str(e.get("cat")) for e in events if e.get("ph") == "X"})
        return {"kernel_count": 0, "idle_fraction": None, "categories": cats}
    window = max(e for _, e in kernels) - min(s for s, _ in kernels)
    busy = busy_union(kernels)
    holes = gaps(kernels)
    bubbles = [g for g in holes if g >= BUBBLE_US]
    by_name: dict[str, float] = {}
    for e in events:
        if e.get("cat") == "kernel":
            by_name[e["name"][:90]] = by_name.get(e["name"][:90], 0.0) + e["dur"]
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:12]
    steps = max(num_steps, 1)
    return {
        "kernel_count": len(kernels), "steps": num_steps, "window_ms": window / 1e3,
        "busy_ms": busy / 1e3, "idle_ms": (window - busy) / 1e3,
        "idle_fraction": (window - busy) / window if window > 0 else None,
        "step_ms": window / steps / 1e3, "busy_ms_per_step": busy / steps / 1e3,
        "idle_ms_per_step": (window - busy) / steps / 1e3,
        "bubble_count": len(bubbles), "bubble_ms_per_step": sum(bubbles) / steps / 1e3,
        "bubble_fraction": sum(bubbles) / window if window > 0 else None,
        "max_gap_us": max(holes, default=0.0), "memcpy_memset_ms": sum(copies) / 1e3,
        "top_kernels_ms": {k: v / 1e3 for k, v in top},
    }


class Profiled:
    """torch.profiler around a region: the kernel timeline, and with `table` a key_averages
    table written to results/<table>.txt. `cpu_ops=False` records kernels only (CUPTI), so
    the host runs at nearly full speed."""

    def __init__(self, ctx: Ctx, cpu_ops: bool, table: str | None = None) -> None:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CUDA] if ctx.cuda else []
        if cpu_ops or not ctx.cuda:
            acts.append(ProfilerActivity.CPU)
        self.ctx, self.table = ctx, table
        self.prof = profile(activities=acts)
        self.started = False

    def start(self) -> None:
        if not self.started:
            self.started = True
            sync(self.ctx)  # the window starts with no earlier work queued
            self.prof.start()

    def stop(self, num_steps: int) -> dict[str, Any] | None:
        if not self.started:
            return None
        sync(self.ctx)
        self.prof.stop()
        with tempfile.TemporaryDirectory() as tmp:
            trace = os.path.join(tmp, "trace.json")
            self.prof.export_chrome_trace(trace)
            with open(trace) as f:
                events = json.load(f).get("traceEvents", [])
        summary = timeline_summary(events, num_steps)
        if self.table:
            path = os.path.join(common.RESULTS_DIR, f"{self.table}.txt")
            os.makedirs(common.RESULTS_DIR, exist_ok=True)
            with open(path, "w") as f:
                f.write(f"{' '.join(sys.argv)}\n{json.dumps(summary, indent=1)}\n\n")
                f.write(_key_table(self.prof, self.ctx.cuda))
            summary["table"] = os.path.basename(path)
        return summary


def _key_table(prof: Any, cuda: bool) -> str:
    avg = prof.key_averages()
    keys = ["self_device_time_total", "self_cuda_time_total"] if cuda else []
    for key in keys + ["self_cpu_time_total"]:
        try:
            return avg.table(sort_by=key, row_limit=40, max_name_column_width=70)
        except Exception:  # noqa: BLE001 - the key's name changed across torch versions
            continue
    return avg.table(row_limit=40)


# -- driving the scheduler --------------------------------------------------------------------
@dataclasses.dataclass
class Run:
    seconds: float
    num_tokens: int
    decode_step_s: list[float]  # wall time of each step while every request decodes
    token_times: list[float]  # arrival time of each token of the first request
    timeline: dict[str, Any] | None = None


def drive(
    engine: Any, prompts: list[list[int]], max_new: int,
    profiler: Profiled | None = None, window: tuple[int, int] = (0, 0),
) -> Run:
    """All prompts at once, steps until every request is done. With a profiler, it records
    steady decode steps window[0] .. window[0] + window[1] - 1."""
    from engine.sampling.sampling_params import SamplingParams

    sched = engine.scheduler
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    params.normalize()
    rids = [f"b{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, ids in zip(rids, prompts):
        sched.add_request(rid, ids, params)
    steps: list[float] = []
    first: list[float] = []
    tokens, tl = 0, None
    t0 = time.perf_counter()
    while sched.has_work():
        if profiler is not None and window[1] and len(steps) == window[0]:
            profiler.start()  # idempotent: until the next steady step
        w = time.perf_counter()
        events = sched.step()
        now = time.perf_counter()
        last = sched.last_batch
        if (last is not None and last.forward_mode.is_decode()
                and len(sched.running_batch) == len(prompts)):
            steps.append(now - w)
            if profiler is not None and window[1] and len(steps) == window[0] + window[1]:
                tl = profiler.stop(window[1])
        for ev in events:
            tokens += len(ev.new_token_ids)
            if ev.rid == rids[0]:
                first.extend([now] * len(ev.new_token_ids))
    seconds = time.perf_counter() - t0
    if profiler is not None and window[1] and tl is None:
        tl = profiler.stop(max(len(steps) - window[0], 1))
    return Run(seconds, tokens, steps, first, tl)


def timeline(ctx: Ctx, engine: Any, prompts: list[list[int]], max_new: int,
             window: tuple[int, int]) -> dict[str, Any]:
    """The kernel timeline of `window` steady decode steps, recording kernels only; if that
    yields no kernel (a CUPTI quirk seen elsewhere), again with CPU ops (slower host)."""
    out = drive(engine, prompts, max_new, Profiled(ctx, cpu_ops=False), window).timeline or {}
    if ctx.cuda and not out.get("kernel_count"):
        engine.flush_cache()
        out = drive(engine, prompts, max_new, Profiled(ctx, cpu_ops=True), window).timeline or {}
        out["recorded_cpu_ops"] = True
    return out


# -- seed-shape -------------------------------------------------------------------------------
def seed_shape(ctx: Ctx, args: argparse.Namespace) -> dict[str, Any]:
    path = build_model(ctx, "gpt2-124m")
    n, in_len, out_len = (8, 32, 8) if ctx.quick else (args.num_prompts, 256, 64)
    vocab = _vocab(path)
    prompts = random_prompts(vocab, n, in_len, ctx.seed)
    warm = random_prompts(vocab, n, in_len, ctx.seed + 1)
    results: dict[str, Any] = {"model": "gpt2-124m shape", "num_prompts": n, "input_len": in_len,
                               "output_len": out_len, "dtype": ctx.dtype, "anchors": ANCHORS}
    results["sluice"] = run_sluice_offline(ctx, path, prompts, warm, out_len)
    release(ctx)
    if not args.skip_hf:
        variants = results["transformers_cb_variants"] = {}
        for name, cb_kwargs in hf_cb_variants(ctx, prompts, out_len).items():
            try:  # a failure here must not lose sluice's numbers
                variants[name] = run_hf_cb(ctx, path, prompts, warm, out_len, cb_kwargs)
            except Exception as exc:  # noqa: BLE001
                variants[name] = {"error": repr(exc)}
                print(f"transformers continuous batching ({name}) failed:", repr(exc))
            release(ctx)
        ok = {k: v for k, v in variants.items() if "error" not in v}
        if ok:  # the comparison is against transformers' best configuration
            best = max(ok, key=lambda k: ok[k]["output_tok_s"])
            results["transformers_cb"] = {"variant": best, **ok[best]}
    ours = results["sluice"]["output_tok_s"]
    summary = {"gpt2_seed_shape_output_tok_s": ours,
               "gpt2_seed_shape_vs_sglang_anchor": ours / ANCHORS["sglang_output_tok_s"]}
    if "transformers_cb" in results:
        summary["vs_transformers_cb_gpu"] = ours / results["transformers_cb"]["output_tok_s"]
    rows = [{"system": k, **v} for k, v in results.items() if k in ("sluice", "transformers_cb")]
    print_table(rows, ["system", "seconds", "output_tokens", "output_tok_s", "complete"])
    return _finish(ctx, "seed_shape", results, summary)


def run_sluice_offline(
    ctx: Ctx, path: str, prompts: list[list[int]], warm: list[list[int]], out_len: int
) -> dict[str, Any]:
    params = {"max_new_tokens": out_len, "temperature": 0.0, "ignore_eos": True}
    with make_engine(ctx, path) as engine:
        engine.generate(input_ids=warm, sampling_params=params)  # graphs, kernels, allocator
        engine.flush_cache()
        sync(ctx)
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        sync(ctx)
        seconds = time.perf_counter() - t0
        gen = sum(o["meta_info"]["completion_tokens"] for o in outs)
        out = {"seconds": seconds, "output_tokens": gen, "output_tok_s": gen / seconds,
               "complete": gen == out_len * len(prompts),
               "engine_args": _args_dict(engine.args)}
        if ctx.profile:
            engine.flush_cache()
            prof = Profiled(ctx, cpu_ops=True, table=ctx.name("seed_shape_profile"))
            prof.start()
            engine.generate(input_ids=prompts, sampling_params=params)
            out["profile"] = prof.stop(out_len)
    return out


def hf_cb_variants(ctx: Ctx, prompts: list[list[int]], out_len: int) -> dict[str, dict]:
    """ContinuousBatchingConfig arguments to try. GPU: transformers' defaults (it picks paged
    sdpa, as the machine has no flash-attn package, and for that its heuristics turn CUDA
    graphs and async batching off) and the same with CUDA graphs forced on. CPU:
    offline_throughput.py's workarounds (the defaults hang or crawl there)."""
    if ctx.cuda:
        return {"defaults": {}, "cuda_graphs": {"use_cuda_graph": True}}
    blocks = 2 * sum(-(-(len(p) + out_len) // 256) for p in prompts) + 8
    return {"cpu": {"use_cuda_graph": False, "use_async_batching": False, "num_blocks": blocks,
                    "max_batch_tokens": 8192}}


def run_hf_cb(
    ctx: Ctx, path: str, prompts: list[list[int]], warm: list[list[int]], out_len: int,
    cb_kwargs: dict[str, Any],
) -> dict[str, Any]:
    """transformers' continuous batching: a warm-up wave, then the timed one."""
    from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

    dtype = getattr(torch, ctx.dtype)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(ctx.device).eval()
    gen_cfg = GenerationConfig(max_new_tokens=out_len, do_sample=False, eos_token_id=-1,
                               pad_token_id=0)
    with model.continuous_batching_context_manager(
        generation_config=gen_cfg, block=True, timeout=30, warmup=ctx.cuda,
        continuous_batching_config=ContinuousBatchingConfig(**cb_kwargs),
    ) as manager:
        _hf_wait(manager, warm, out_len)
        sync(ctx)
        t0 = time.perf_counter()
        gen = _hf_wait(manager, prompts, out_len)
        sync(ctx)
        seconds = time.perf_counter() - t0
        resolved = getattr(manager, "continuous_batching_config", None)
        attn = model.config._attn_implementation
    del model, manager
    return {"seconds": seconds, "output_tokens": gen, "output_tok_s": gen / seconds,
            "complete": gen == out_len * len(prompts), "attn_implementation": attn,
            "cb_config": _cb_config_dict(resolved)}


def _hf_wait(manager: Any, prompts: list[list[int]], out_len: int, limit_s: float = 300) -> int:
    return run_transformers_cb(manager, prompts, [out_len] * len(prompts), limit_s)


def _cb_config_dict(cfg: Any) -> dict[str, Any] | None:
    if cfg is None:
        return None
    keys = ("use_cuda_graph", "use_async_batching", "num_blocks", "max_batch_tokens",
            "max_memory_percent", "max_blocks_per_request")
    return {k: repr(getattr(cfg, k, None)) for k in keys}


# -- decode at batch 1 ------------------------------------------------------------------------
def decode_bs1(ctx: Ctx, args: argparse.Namespace) -> dict[str, Any]:
    path = build_model(ctx, "llama-3.2-1b")
    prompt_len, new = (16, 24) if ctx.quick else (128, args.decode_tokens)
    vocab = _vocab(path)
    bw_measured = measure_copy_bandwidth(ctx)
    bw_sheet, bw_name = _datasheet_bw(ctx)
    rows, results = [], {"model": "llama-3.2-1b shape", "dtype": ctx.dtype,
                         "prompt_len": prompt_len, "new_tokens": new,
                         "copy_bandwidth_measured_Bps": bw_measured,
                         "datasheet_bandwidth_Bps": bw_sheet, "datasheet_bandwidth": bw_name}
    for graphs in (True, False):
        label = "cuda_graph" if graphs else "no_cuda_graph"
        with make_engine(ctx, path, disable_cuda_graph=not graphs) as engine:
            weight_bytes = _weight_bytes(engine)
            kv_bytes = _kv_bytes_per_token(engine) * (prompt_len + new / 2)
            drive(engine, random_prompts(vocab, 1, prompt_len, ctx.seed + 7), 8)  # warm-up
            per_token = []
            for rep in range(1 if ctx.quick else 3):
                run = drive(engine, random_prompts(vocab, 1, prompt_len, ctx.seed + rep), new)
                per_token.append(_ms_per_token(run.token_times))
            ms = statistics.median(per_token)
            window = (4, 8) if ctx.quick else (16, 64)
            row = _roofline_row(label, ms, weight_bytes + kv_bytes, bw_sheet, bw_measured)
            row["ms_per_token_runs"] = per_token
            row["gpu_timeline"] = timeline(ctx, engine, random_prompts(vocab, 1, prompt_len, 99),
                                           new, window)
            if ctx.profile:
                table = Profiled(ctx, cpu_ops=True, table=ctx.name(f"decode_bs1_{label}_profile"))
                row["profile"] = drive(engine, random_prompts(vocab, 1, prompt_len, 98), new,
                                       table, window).timeline
            results["weight_bytes"], results["kv_bytes_read_per_token"] = weight_bytes, kv_bytes
        del engine  # its KV pool holds most of the GPU's memory
        release(ctx)
        results[label] = row
        rows.append(row)
    print_table(rows, ["config", "ms_per_token", "roofline_ms", "roofline_fraction",
                       "roofline_fraction_measured_bw"])
    best = results["cuda_graph"]
    summary = {"decode_bs1_ms_per_token": best["ms_per_token"],
               "decode_bs1_roofline_fraction": best["roofline_fraction"],
               "decode_bs1_roofline_fraction_measured_bw": best["roofline_fraction_measured_bw"]}
    return _finish(ctx, "decode_bs1", results, summary)


def _roofline_row(label: str, ms: float, nbytes: float, sheet: float | None,
                  measured: float) -> dict[str, Any]:
    sheet_ms = 1e3 * nbytes / sheet if sheet else None
    measured_ms = 1e3 * nbytes / measured
    return {"config": label, "ms_per_token": ms, "bytes_per_token": nbytes,
            "roofline_ms": sheet_ms, "roofline_fraction": sheet_ms / ms if sheet_ms else None,
            "roofline_ms_measured_bw": measured_ms,
            "roofline_fraction_measured_bw": measured_ms / ms}


def _ms_per_token(times: list[float]) -> float:
    """Mean inter-token time of steady decode (the first 4 intervals are left out)."""
    steady = times[4:] if len(times) > 8 else times
    return 1e3 * (steady[-1] - steady[0]) / max(len(steady) - 1, 1)


def measure_copy_bandwidth(ctx: Ctx) -> float:
    """A device-to-device copy of 1 GiB (64 MiB on a CPU): bytes read plus bytes written per
    second, over 10 copies after 3 warm-ups (CUDA events on a GPU)."""
    n = (1 << 30) if ctx.cuda else (64 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=ctx.device).random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(ctx)
    if ctx.cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            dst.copy_(src)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3 / 10
    else:
        t = time.perf_counter()
        for _ in range(10):
            dst.copy_(src)
        seconds = (time.perf_counter() - t) / 10
    del src, dst
    release(ctx)
    return 2 * n / seconds


def _datasheet_bw(ctx: Ctx) -> tuple[float | None, str | None]:
    if not ctx.cuda:
        return None, None
    name = torch.cuda.get_device_name(0)
    for key, bw, label in DATASHEET_BW:
        if key in name:
            return bw, label
    return None, None


def _weight_bytes(engine: Any) -> int:
    """Bytes of the parameters, each storage once (a tied lm_head is the embedding). From
    the loaded model, or from the checkpoint's tensors in the engine's dtype where the model
    lives in another process (CPU overlap)."""
    runner = engine.scheduler.model_runner
    if runner.model is not None:
        seen, total = set(), 0
        for t in runner.model.parameters():
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total
    import glob

    from safetensors import safe_open

    size = torch.empty((), dtype=runner.dtype).element_size()
    total = 0
    for path in glob.glob(os.path.join(engine.args.model_path, "*.safetensors")):
        with safe_open(path, "pt") as f:
            total += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    return total * size


def _kv_bytes_per_token(engine: Any) -> int:
    from engine.mem_cache.kv_pool import KVPool

    mc = engine.scheduler.model_runner.model_config
    dtype = engine.scheduler.model_runner.dtype
    return KVPool.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype)


# -- overlap on vs off ------------------------------------------------------------------------
def overlap(ctx: Ctx, args: argparse.Namespace) -> dict[str, Any]:
    path = build_model(ctx, args.overlap_preset)
    sizes = [4, 8] if ctx.quick else args.batch_sizes
    prompt_len, new = (16, 24) if ctx.quick else (128, 160)
    window = (4, 12) if ctx.quick else (16, 96)
    vocab = _vocab(path)
    rows: list[dict[str, Any]] = []
    for on in (True, False):
        with make_engine(ctx, path, disable_overlap_schedule=not on,
                         max_running_requests=max(sizes)) as engine:
            for bs in sizes:
                rows.append(_overlap_case(ctx, engine, vocab, bs, on, prompt_len, new, window))
        del engine  # its KV pool holds most of the GPU's memory
        release(ctx)
    results: dict[str, Any] = {"model": f"{args.overlap_preset} shape", "dtype": ctx.dtype,
                               "prompt_len": prompt_len, "new_tokens": new, "cases": rows}
    summary: dict[str, Any] = {}
    per_bs = {}
    for bs in sizes:
        on_row, off_row = (next(r for r in rows if r["batch"] == bs and r["overlap"] == o)
                           for o in (True, False))
        per_bs[bs] = {"throughput_on_vs_off": on_row["tok_s"] / off_row["tok_s"],
                      "idle_fraction_on": on_row["idle_fraction"],
                      "idle_fraction_off": off_row["idle_fraction"]}
    results["on_vs_off"] = per_bs
    idle = [v["idle_fraction_on"] for v in per_bs.values() if v["idle_fraction_on"] is not None]
    summary["gpu_idle_fraction_overlap"] = max(idle) if idle else None
    summary["overlap_on_vs_off_throughput"] = {
        f"bs{bs}": v["throughput_on_vs_off"] for bs, v in per_bs.items()}
    print_table(rows, ["batch", "overlap", "tok_s", "host_step_ms", "gpu_step_ms",
                       "gpu_busy_ms_per_step", "idle_fraction", "bubble_fraction"])
    return _finish(ctx, "overlap", results, summary)


def _overlap_case(ctx: Ctx, engine: Any, vocab: int, bs: int, on: bool, prompt_len: int,
                  new: int, window: tuple[int, int]) -> dict[str, Any]:
    def prompts(seed: int) -> list[list[int]]:
        return random_prompts(vocab, bs, prompt_len, seed)

    drive(engine, prompts(ctx.seed + 100 + bs), min(new, 16))  # warm-up
    engine.flush_cache()
    run = drive(engine, prompts(ctx.seed + bs), new)
    engine.flush_cache()
    tl = timeline(ctx, engine, prompts(ctx.seed + 200 + bs), new, window)
    row = {"batch": bs, "overlap": on, "tokens": run.num_tokens,
           "tok_s": run.num_tokens / run.seconds,
           "seconds": run.seconds, "host_step_ms": 1e3 * statistics.median(run.decode_step_s),
           "gpu_step_ms": tl.get("step_ms"), "gpu_busy_ms_per_step": tl.get("busy_ms_per_step"),
           "idle_ms_per_step": tl.get("idle_ms_per_step"),
           "idle_fraction": tl.get("idle_fraction"), "bubble_fraction": tl.get("bubble_fraction"),
           "gpu_timeline": tl}
    if ctx.profile:
        engine.flush_cache()
        name = ctx.name(f"overlap_bs{bs}_{'on' if on else 'off'}_profile")
        row["profile"] = drive(engine, prompts(ctx.seed + 300 + bs), new,
                               Profiled(ctx, True, name), window).timeline
    engine.flush_cache()
    return row


# -- results ----------------------------------------------------------------------------------
def _vocab(path: str) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path).vocab_size


def _args_dict(args: Any) -> dict[str, Any]:
    return {k: v if isinstance(v, (int, float, str, bool, type(None))) else repr(v)
            for k, v in dataclasses.asdict(args).items()}


def _finish(ctx: Ctx, base: str, results: dict, summary: dict) -> dict[str, Any]:
    extra = {"device": device_info(ctx.device), "attention_backend": ctx.attention_backend,
             "profile": ctx.profile, "quick": ctx.quick,
             "versions_extra": common.versions("flashinfer-python", "triton")}
    path = common.write_result(ctx.name(base), results, summary, **extra)
    print("wrote", path)
    merge_summary(ctx.name("summary"), summary, os.path.basename(path), extra["device"])
    for k, v in summary.items():
        print(f"{k}: {v}")
    return summary


def merge_summary(name: str, summary: dict[str, Any], source: str, device: dict) -> str:
    """Add `summary`'s keys to results/<name>.json, keeping the other benchmarks' keys."""
    path = os.path.join(common.RESULTS_DIR, f"{name}.json")
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        merged, sources = old.get("summary", {}), old.get("results", {}).get("sources", {})
    merged.update(summary)
    sources.update({k: source for k in summary})
    return common.write_result(name, {"sources": sources}, merged, device=device)


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
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--overlap-preset", default="gpt2-124m",
                    choices=("gpt2-124m", "llama-3.2-1b"))
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "sluice-gpu-bench"))
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
              model_dir=args.model_dir)
    summary: dict[str, Any] = {}
    for name in (BENCHES if args.bench == "all" else [args.bench]):
        t = time.perf_counter()
        summary.update(BENCHES[name](ctx, args))
        print(f"[{name}] {time.perf_counter() - t:.1f}s", flush=True)
    return summary


if __name__ == "__main__":
    main()

"""seed-shape: offline output tokens/s of sluice and of transformers' continuous batching on a
GPT-2 (124M) shaped random model, 128 prompts x 256 input / 64 output tokens, one after the
other on the same device and weights (see gpu_bench.py). Each runs a warm-up wave, then
TIMED_WAVES timed waves of the same prompts (sluice flushes its prefix cache before each);
the median wave's time is the result, every wave's is in the JSON."""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any

import torch

from benchmarks.common import print_table, run_transformers_cb
from benchmarks.gpu_common import (
    Ctx,
    build_model,
    finish,
    make_engine,
    random_prompts,
    release,
    sync,
    vocab_size,
)
from benchmarks.gpu_timeline import Profiled

TIMED_WAVES = 3  # after a warm-up wave; the median wave is the result (a first-use compile
# in one wave, e.g. a Triton specialization, moves the median little)
ANCHORS = {"sglang_output_tok_s": 15538, "vllm_output_tok_s": 9024,
           "anchor_dtype": "float16 (SGLang/vLLM dtype=auto turns a float32 checkpoint into fp16)"}


def seed_shape(ctx: Ctx, args: argparse.Namespace) -> dict[str, Any]:
    path = build_model(ctx, "gpt2-124m")
    n, in_len, out_len = (8, 32, 8) if ctx.quick else (args.num_prompts, 256, 64)
    vocab = vocab_size(path)
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
    return finish(ctx, "seed_shape", results, summary)


def run_sluice_offline(
    ctx: Ctx, path: str, prompts: list[list[int]], warm: list[list[int]], out_len: int
) -> dict[str, Any]:
    params = {"max_new_tokens": out_len, "temperature": 0.0, "ignore_eos": True}
    with make_engine(ctx, path) as engine:
        engine.generate(input_ids=warm, sampling_params=params)  # graphs, kernels, allocator
        waves, gen = [], 0
        for _ in range(TIMED_WAVES):
            engine.flush_cache()
            sync(ctx)
            t0 = time.perf_counter()
            outs = engine.generate(input_ids=prompts, sampling_params=params)
            sync(ctx)
            waves.append(time.perf_counter() - t0)
            gen = sum(o["meta_info"]["completion_tokens"] for o in outs)
        seconds = statistics.median(waves)
        out = {"seconds": seconds, "waves_s": waves, "output_tokens": gen,
               "output_tok_s": gen / seconds, "complete": gen == out_len * len(prompts),
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
        waves = []
        for _ in range(TIMED_WAVES):
            sync(ctx)
            t0 = time.perf_counter()
            gen = _hf_wait(manager, prompts, out_len)
            sync(ctx)
            waves.append(time.perf_counter() - t0)
        seconds = statistics.median(waves)
        resolved = getattr(manager, "continuous_batching_config", None)
        attn = model.config._attn_implementation
    del model, manager
    return {"seconds": seconds, "waves_s": waves, "output_tokens": gen,
            "output_tok_s": gen / seconds,
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


def _args_dict(args: Any) -> dict[str, Any]:
    return {k: v if isinstance(v, (int, float, str, bool, type(None))) else repr(v)
            for k, v in dataclasses.asdict(args).items()}

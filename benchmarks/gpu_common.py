"""What the GPU benchmarks share: the run's context, the random models they build, the engine
they make, and writing each benchmark's results with its headline keys merged into
results/gpu_summary.json."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import random
import time
from typing import Any

import torch

from benchmarks import common

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
    tag: str = ""  # an experiment's results: gpu_<base>_<tag>.json (the summary's too)

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    def name(self, base: str) -> str:
        name = f"gpu_{base}_quick" if self.quick else f"gpu_{base}"
        return f"{name}_{self.tag}" if self.tag else name


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


def vocab_size(path: str) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path).vocab_size


# -- results ----------------------------------------------------------------------------------
def finish(ctx: Ctx, base: str, results: dict, summary: dict) -> dict[str, Any]:
    """Write results/gpu_<base>.json, merge `summary` into the summary file, print it."""
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

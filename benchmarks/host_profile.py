"""Where the host's time goes in an offline run: wall time of repeated waves of the seed
shape (or any shape), then one wave under cProfile, per engine configuration.

    python benchmarks/host_profile.py --preset gpt2-124m --device cuda --dtype bfloat16 \
        --config default --config no_overlap:disable_overlap_schedule=True \
        --config no_graph:disable_cuda_graph=True

Each configuration: one engine, a warm-up wave, `--repeats` timed waves (flushing the prefix
cache before each, as the seed-shape benchmark does), then a profiled wave whose top functions
by own time and by cumulative time are printed and written to
results/<name>_<config>.txt (--name, default host_profile); the wave times to
results/<name>.json.
"""

from __future__ import annotations

import argparse
import ast
import cProfile
import gc
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # noqa: E402
from benchmarks.gpu_common import random_prompts, vocab_size  # noqa: E402


def parse_config(text: str) -> tuple[str, dict[str, Any]]:
    """`name` or `name:key=value,key=value` (values as Python literals, else strings)."""
    name, _, rest = text.partition(":")
    kwargs: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, _, raw = item.partition("=")
        try:
            kwargs[key] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            kwargs[key] = raw
    return name, kwargs


def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


SHAPE_KEYS = ("num_prompts", "input_len", "output_len")


def profile_config(args: argparse.Namespace, path: str, name: str, kw: dict) -> dict[str, Any]:
    """`kw`: engine arguments, and optionally this configuration's own workload shape
    (num_prompts, input_len, output_len)."""
    from engine.engine import Engine

    args = argparse.Namespace(**{**vars(args), **{k: kw.pop(k) for k in SHAPE_KEYS if k in kw}})
    vocab = vocab_size(path)
    params = {"max_new_tokens": args.output_len, "temperature": 0.0, "ignore_eos": True}
    waves = [random_prompts(vocab, args.num_prompts, args.input_len, seed) for seed in range(8)]
    out: dict[str, Any] = {"engine_args": {k: repr(v) for k, v in kw.items()}, "waves_s": [],
                           **{k: getattr(args, k) for k in SHAPE_KEYS}}
    t = time.perf_counter()
    with Engine(model_path=path, device=args.device, dtype=args.dtype, **kw) as engine:
        out["start_s"] = time.perf_counter() - t
        for i in range(args.repeats + 1):
            engine.flush_cache()
            sync(args.device)
            t = time.perf_counter()
            engine.generate(input_ids=waves[i % len(waves)], sampling_params=params)
            sync(args.device)
            out["waves_s"].append(time.perf_counter() - t)
            print(f"[{name}] wave {i}: {out['waves_s'][-1]:.3f}s", flush=True)
        engine.flush_cache()
        prof = cProfile.Profile()
        t = time.perf_counter()
        prof.enable()
        engine.generate(input_ids=waves[-1], sampling_params=params)
        sync(args.device)
        prof.disable()
        out["profiled_wave_s"] = time.perf_counter() - t
    tokens = args.num_prompts * args.output_len
    out["output_tok_s_best"] = tokens / min(out["waves_s"][1:] or out["waves_s"])
    common.write_profile(prof, f"{args.name}_{name}", args.top)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="gpt2-124m")
    ap.add_argument("--model", help="an existing model folder instead of --preset")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--name", default="host_profile", help="results file name")
    ap.add_argument("--config", action="append", default=None,
                    help="name[:key=value,...] engine arguments (and num_prompts, input_len, "
                         "output_len); repeatable")
    args = ap.parse_args()
    path = args.model
    if path is None:
        path = f"/tmp/sluice-host-profile/{args.preset}-{args.dtype}"
        if not os.path.exists(os.path.join(path, "config.json")):
            from services.tiny_model import make_tiny_model

            make_tiny_model(path, preset=args.preset, dtype=args.dtype)
    results: dict[str, Any] = {}
    for text in args.config or ["default"]:
        name, kw = parse_config(text)
        results[name] = profile_config(args, path, name, kw)
        gc.collect()
        if args.device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()
    rows = [{"config": k, "start_s": v["start_s"], "waves_s": " ".join(f"{w:.3f}" for w in
             v["waves_s"]), "profiled_s": v["profiled_wave_s"], "tok_s": v["output_tok_s_best"]}
            for k, v in results.items()]
    common.print_table(rows, ["config", "start_s", "waves_s", "profiled_s", "tok_s"])
    common.write_result(args.name, results, {}, args=vars(args))


if __name__ == "__main__":
    main()

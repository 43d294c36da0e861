"""What giving the memory back while idle costs and saves (SGLang's
`release_memory_occupation` / `resume_memory_occupation`, vLLM's `sleep` / `wake_up`;
engine/memory_occupation.py), against the way without it: shutting the engine down and
starting it again.

    OMP_NUM_THREADS=1 python benchmarks/memory_release.py [--layers 8] [--kv-tokens 16384] \
        [--prompt 32] [--reps 3] [--device cuda --dtype bfloat16 --name gpu_memory_release]

One engine (the small preset's Llama with `--layers` layers, a `--kv-tokens` KV pool; on the
CPU float32 and the plain loop, so that the model is in this process and its resident memory
can be read; on CUDA the defaults, graphs and the overlap loop), each rep and case after a
`--prompt`-token request has run:

* level1: `sleep(1)` (weights copied to host memory, K/V discarded), `wake_up()`;
* level2: `sleep(2)` (both discarded), `wake_up()`: the weights are read from the checkpoint
  at the first forward;
* level2_update: the RL loop's order: `sleep(2)`, `wake_up(["weights"])`,
  `update_weights_from_disk` (the same checkpoint: a step's new weights), `wake_up()`;
* restart, the peer within the process: `shutdown()` and a new `Engine` (no process start,
  no imports: a lower bound of restarting a worker);
* restart_process, the peer as a deployment meets it: `shutdown()`, and a fresh interpreter
  that imports the engine, builds it and generates the token (a worker restarted, less its
  Redis set-up).

Columns: `release_ms` (the sleep, or the shutdown), `released_mb` (the bytes the runner gave
back; the shutdown's: the weights and pool it dropped), `os_got_mb` (what the process held
before less after: on CUDA the device memory in use as the driver says it, on the CPU the
resident memory, where K/V pages never written were not resident), `wake_ms` (the wake-up
calls, the update included, or the new engine's construction), `back_ms` (from their start
to the first token of the same request: weights read again at the first forward included)
and its ratios to the two restarts'; `same` tells whether that token is the one before the
release. On the CPU the "device" memory is host memory: level 1's host copy takes what the
release gave back, and a copy back costs what a read of the checkpoint from the page cache
costs. Medians over reps; absolute times on a shared CPU are noise, the ratios are the
result.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import print_table, small_model, write_result  # noqa: E402

CASES = ("level1", "level2", "level2_update", "restart", "restart_process")
_CHILD = """
import json, sys, torch
torch.set_num_threads(1)
from engine.engine import Engine
e = Engine(**json.loads(sys.argv[1]))
prompt = [int(t) for t in sys.argv[2].split(",")]
out = e.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1, "temperature": 0.0})
print(out["output_ids"][0], flush=True)
"""


def held_mb(device: str) -> float:
    """What the process holds: on CUDA, the device memory in use (total less free, as the
    driver says it); on the CPU, the resident memory."""
    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        return (total - free) / 2**20
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def first_token(engine: Any, prompt: list[int]) -> int:
    out = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1,
                                                             "temperature": 0.0})  # fmt: skip
    return out["output_ids"][0]


def in_a_new_process(spec: dict, prompt: list[int]) -> int:
    """The first token of `prompt` from an engine built in a fresh interpreter."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(spec), ",".join(map(str, prompt))],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return int(out.stdout.split()[-1])


def one_case(engine: Any, spec: dict, case: str, prompt: list[int]) -> tuple[Any, dict]:
    """Run `case` on `engine` (idle, warm; built as `Engine(**spec)`); the engine to go on
    with and the measures."""
    from engine.engine import Engine

    want = first_token(engine, prompt)
    engine.flush_cache()
    path = engine.scheduler.weights_path
    held = sum(engine.scheduler.memory_occupied().values())
    device = spec["device"]
    before = held_mb(device)
    t = time.perf_counter()
    if case.startswith("restart"):
        engine.shutdown()
        engine = None
        released = held
    else:
        engine.sleep(1 if case == "level1" else 2)
        released = held - sum(engine.scheduler.memory_occupied().values())
    release_s = time.perf_counter() - t
    drop = before - held_mb(device)
    t = time.perf_counter()
    if case == "restart_process":
        token = in_a_new_process(spec, prompt)
        wake_s = float("nan")  # (not told apart from the first token)
    else:
        if case == "restart":
            engine = Engine(**spec)
        elif case == "level2_update":
            engine.wake_up(["weights"])
            engine.update_weights_from_disk(path)
            engine.wake_up()
        else:
            engine.wake_up()
        wake_s = time.perf_counter() - t
        token = first_token(engine, prompt)
    back_s = time.perf_counter() - t
    if engine is None:
        engine = Engine(**spec)
        first_token(engine, prompt)  # (warm again for the next case)
    return engine, {"release_ms": 1e3 * release_s, "released_mb": released / 2**20,
                    "os_got_mb": drop, "wake_ms": 1e3 * wake_s, "back_ms": 1e3 * back_s,
                    "same": token == want}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--kv-tokens", type=int, default=16384)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--name", default="memory_release")
    args = ap.parse_args()
    import torch

    from engine.engine import Engine

    torch.set_num_threads(1)
    # on the CPU, the plain loop: the model in this process, whose memory is read
    spec = {"model_path": small_model(args.layers), "max_total_tokens": args.kv_tokens,
            "device": args.device, "dtype": args.dtype,
            "disable_overlap_schedule": args.device == "cpu"}  # fmt: skip
    engine = Engine(**spec)
    vocab = engine.scheduler.model_runner.model_config.vocab_size
    rng = random.Random(0)
    prompt = [rng.randrange(10, vocab) for _ in range(args.prompt)]
    first_token(engine, prompt)  # warm-up
    held = engine.scheduler.memory_occupied()
    reps: list[dict[str, dict]] = []
    for _ in range(args.reps):
        rep = {}
        for case in CASES:
            engine, rep[case] = one_case(engine, spec, case, prompt)
        reps.append(rep)
    engine.shutdown()
    restart_back = statistics.median(r["restart"]["back_ms"] for r in reps)
    process_back = statistics.median(r["restart_process"]["back_ms"] for r in reps)
    rows = []
    for case in CASES:
        row: dict[str, Any] = {"case": case}
        for col in ("release_ms", "released_mb", "os_got_mb", "wake_ms", "back_ms"):
            row[col] = statistics.median(r[case][col] for r in reps)
        row["back_vs_restart"] = row["back_ms"] / restart_back
        row["back_vs_process"] = row["back_ms"] / process_back
        row["same"] = f"{sum(r[case]['same'] for r in reps)}/{len(reps)}"
        rows.append(row)
    print_table(rows, ["case", "release_ms", "released_mb", "os_got_mb", "wake_ms", "back_ms",
                       "back_vs_restart", "back_vs_process", "same"])  # fmt: skip
    med = {row["case"]: row for row in rows}
    summary = {
        "weights_mb": held["weights"] / 2**20,
        "kv_cache_mb": held["kv_cache"] / 2**20,
        "level1_back_vs_restart": med["level1"]["back_vs_restart"],
        "level2_back_vs_restart": med["level2"]["back_vs_restart"],
        "level2_update_back_vs_restart": med["level2_update"]["back_vs_restart"],
        "level1_back_vs_restart_process": med["level1"]["back_vs_process"],
        "level2_back_vs_restart_process": med["level2"]["back_vs_process"],
        "level1_released_fraction": med["level1"]["released_mb"] * 2**20 / sum(held.values()),
        "same_first_token": all(row["same"] == f"{args.reps}/{args.reps}" for row in rows),
    }
    print(summary)
    write_result(args.name, {"rows": rows, "reps": reps}, summary, args=vars(args))


if __name__ == "__main__":
    main()

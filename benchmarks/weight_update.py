"""Updating a running engine's weights (from disk, from tensors in memory, broadcast by a
trainer process) against restarting it on the new checkpoint (what one would do without
`update_weights_from_disk`), side by side in one run.

    python benchmarks/weight_update.py [--layers 4] [--threads 2] [--repeat 3]

Two random Llamas of the `small` preset's shape (hidden 1024, GQA 16/4, intermediate 2816)
with `--layers` layers, seeds 0 and 1, float32 safetensors. Arms, alternating, `--repeat`
rounds (the fastest of each counts), the engine with its defaults (the overlap loop, on CPU
its device process):

* update: `Engine.update_weights_from_disk` to the other checkpoint (the dry run on the meta
  device, then the tensors copied in place, the prefix cache emptied), then one request;
* tensors: `Engine.update_weights_from_tensor` with the other checkpoint's tensors, already in
  memory (as a trainer holds them), in 4 buckets, then one request (on CPU the device
  process gets them pickled through its pipe);
* broadcast: `Engine.update_weights_from_distributed`, the other checkpoint's tensors
  broadcast in 4 buckets by a trainer process (tests/rl_trainer.py, rank 0 of a gloo group
  built as RL trainers build theirs, over loopback TCP; it holds both checkpoints in memory),
  then one request; a second engine, in the group for the whole run as in an RL loop (on
  CPU its device process receives them). Its first update after joining (the same
  weights, untimed in the arm) opens the group's connections and is reported apart;
* broadcast flat: the same with each bucket flattened into one uint8 tensor (SGLang's
  load_format "flattened_bucket": one collective per bucket, not per tensor);
* dry run: the check alone (`engine.weight_update.check_config` + the meta-device load);
* restart: the engine shut down and a new one built on the other checkpoint (process, model
  load, KV pool), then one request.

The request's greedy tokens after an update must equal those of an engine started on that
checkpoint.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


from benchmarks.common import parse_arm_args, print_table, small_model, write_result  # noqa: E402

PROMPT = list(range(100, 164))
PARAMS = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def join_trainer(engine, paths: list[str], order: str) -> Any:
    """A trainer process holding the checkpoints `paths` (4 buckets each: its tensors sorted
    by name, bucket k every 4th from k), sending the buckets of `order` ("c:k"), in a gloo
    group with `engine`."""
    from tests.rl_trainer import Trainer, free_port

    port = free_port()
    places = [a for path in paths for a in ("--checkpoint", path)]
    trainer = Trainer("--port", str(port), *places, "--buckets", "4", "--order", order)
    engine.init_weights_update_group("127.0.0.1", port, 1, 2, backend="gloo")
    return trainer


def broadcast(engine, tensors: list, flattened: bool = False) -> None:
    """The 4 buckets of `tensors` (sorted by name), as the trainer broadcasts them (each
    bucket as one uint8 tensor with `flattened`)."""
    for k in range(4):
        bucket = tensors[k::4]
        engine.update_weights_from_distributed(
            [n for n, _ in bucket], [str(t.dtype) for _, t in bucket],
            [list(t.shape) for _, t in bucket],
            load_format="flattened_bucket" if flattened else None,
        )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=4)
    args = parse_arm_args(ap)
    from engine.config import ModelConfig
    from engine.engine import Engine
    from engine.loader import build_model, fill_model, iter_safetensors
    from engine.weight_update import check_config, meta_safetensors

    paths = [small_model(args.layers, seed) for seed in (0, 1)]
    size_mb = sum(
        os.path.getsize(os.path.join(paths[0], f)) for f in os.listdir(paths[0])
        if f.endswith(".safetensors")
    ) / 2**20  # fmt: skip
    kw = dict(skip_tokenizer_init=True, max_total_tokens=4096)
    times: dict[str, list[float]] = {"update": [], "tensors": [], "broadcast": [],
                                     "broadcast flat": [], "dry run": [],
                                     "restart": []}  # fmt: skip
    outs: dict[str, list] = {"update": [], "tensors": [], "broadcast": [], "broadcast flat": [],
                             "restart": []}  # fmt: skip
    in_memory = [[(n, t.clone()) for n, t in sorted(iter_safetensors(p))] for p in paths]
    engine = Engine(model_path=paths[0], **kw)
    # the broadcast arm's engine: in the trainer's group for the whole run, as in an RL loop
    # (the restarts would leave it); its first update (the same weights, untimed but
    # reported) opens the group's connections
    receiver = Engine(model_path=paths[0], **kw)
    order, target = ["0:0", "0:1", "0:2", "0:3"], 0
    for _ in range(args.repeat):  # (flattened there, plain back, plain there)
        target = 1 - target
        order += [f"{c}:{k}{f}" for c, f in ((target, "f"), (1 - target, ""), (target, ""))
                  for k in range(4)]  # fmt: skip
    trainer = join_trainer(receiver, paths, ",".join(order))
    current = 0
    try:
        engine.generate(input_ids=PROMPT, sampling_params=PARAMS)  # warm-up
        receiver.generate(input_ids=PROMPT, sampling_params=PARAMS)
        t0 = time.perf_counter()
        broadcast(receiver, in_memory[0])
        first_broadcast_s = time.perf_counter() - t0
        for i in range(args.repeat):
            target = 1 - current
            t0 = time.perf_counter()
            engine.update_weights_from_disk(paths[target])
            out = engine.generate(input_ids=PROMPT, sampling_params=PARAMS)["output_ids"]
            times["update"].append(time.perf_counter() - t0)
            outs["update"].append((target, out))

            engine.update_weights_from_disk(paths[current])  # (back, then by tensors)
            t0 = time.perf_counter()
            for k in range(4):
                engine.update_weights_from_tensor(in_memory[target][k::4])
            out = engine.generate(input_ids=PROMPT, sampling_params=PARAMS)["output_ids"]
            times["tensors"].append(time.perf_counter() - t0)
            outs["tensors"].append((target, out))

            t0 = time.perf_counter()
            broadcast(receiver, in_memory[target], flattened=True)
            out = receiver.generate(input_ids=PROMPT, sampling_params=PARAMS)["output_ids"]
            times["broadcast flat"].append(time.perf_counter() - t0)
            outs["broadcast flat"].append((target, out))
            broadcast(receiver, in_memory[current])  # (back, then one tensor at a time)
            t0 = time.perf_counter()
            broadcast(receiver, in_memory[target])
            out = receiver.generate(input_ids=PROMPT, sampling_params=PARAMS)["output_ids"]
            times["broadcast"].append(time.perf_counter() - t0)
            outs["broadcast"].append((target, out))

            config = ModelConfig.from_pretrained(paths[target])
            t0 = time.perf_counter()
            check_config(config, paths[target])
            dry = build_model(config, torch.float32, "meta")
            fill_model(dry, meta_safetensors(paths[target]), paths[target])
            times["dry run"].append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            engine.shutdown()
            engine = Engine(model_path=paths[target], **kw)
            out = engine.generate(input_ids=PROMPT, sampling_params=PARAMS)["output_ids"]
            times["restart"].append(time.perf_counter() - t0)
            outs["restart"].append((target, out))
            current = target
            print(f"round {i + 1}: " + " ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()),
                  flush=True)  # fmt: skip
        trainer.answers()
        receiver.destroy_weights_update_group()
    finally:
        engine.shutdown()
        receiver.shutdown()
        trainer.kill()
    # round by round, the same checkpoint
    same = all(v == outs["restart"] for v in outs.values())
    checked = {ckpt for ckpt, _ in outs["update"]}
    rows = [{"arm": k, "best_s": min(v), "median_s": sorted(v)[len(v) // 2]}
            for k, v in times.items()]  # fmt: skip
    print_table(rows, ["arm", "best_s", "median_s"])
    summary = {
        "checkpoint_mb": size_mb,
        "update_s": rows[0]["best_s"],
        "tensors_s": rows[1]["best_s"],
        "broadcast_s": rows[2]["best_s"],
        "broadcast_flattened_s": rows[3]["best_s"],
        "first_broadcast_after_join_s": first_broadcast_s,
        "dry_run_s": rows[4]["best_s"],
        "restart_s": rows[5]["best_s"],
        "restart_vs_update": rows[5]["best_s"] / rows[0]["best_s"],
        "restart_vs_tensors": rows[5]["best_s"] / rows[1]["best_s"],
        "restart_vs_broadcast": rows[5]["best_s"] / rows[2]["best_s"],
        "tensors_vs_update": rows[1]["best_s"] / rows[0]["best_s"],
        "broadcast_vs_update": rows[2]["best_s"] / rows[0]["best_s"],
        "broadcast_vs_flattened": rows[2]["best_s"] / rows[3]["best_s"],
        "update_tokens_equal_fresh_engine": same,
        "checkpoints_compared": sorted(checked),
    }
    print(summary)
    print("wrote", write_result("weight_update", rows, summary, config=vars(args)))
    if not same or not checked:
        raise SystemExit("an updated engine's tokens differ from a fresh engine's")


if __name__ == "__main__":
    main()

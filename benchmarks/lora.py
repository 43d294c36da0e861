"""Multi-LoRA serving: what adapters cost against the base model, side by side in one run.

    python benchmarks/lora.py [--layers 4] [--requests 32] [--rank 16] [--threads 2]
        [--device cuda --dtype bfloat16 --name gpu_lora]   (the GPU session's)

A random Llama of the `small` preset's shape (hidden 1024, GQA 16/4, intermediate 2816) with
`--layers` layers, and `--adapters` random rank-`--rank` adapters on all seven projections
(`sluice make-tiny-lora`). `--requests` prompts of `--context` tokens, `--output` greedy
tokens each (`ignore_eos`), all submitted at once, in-process, overlap off. Arms:

* base: no adapters loaded;
* served, unused: the adapters loaded, every request on the base model (the price of
  enabling LoRA for requests that do not use it);
* one adapter: every request on adapter 1;
* mixed: requests round-robin over all adapters, `--adapters` slots (every batch mixes them);
* mixed, 1 slot: the same requests with one device slot (batches hold one adapter's
  requests at a time: the cost of too few slots);
* on a GPU, mixed, eager: the mixed arm with CUDA graphs off (what the decode graphs, which
  record the adapters' layers over every slot, save with adapters).

The arms' engines stay open and their timed runs interleave, `--repeat` rounds (drift on
this shared machine then hits every arm). Reported per arm (its fastest run): wall time,
output tokens/s, the largest decode batch, and the ratio of its throughput to the base
arm's. The two mixed arms must generate the same tokens.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


from benchmarks.common import parse_arm_args, print_table, small_model, write_result  # noqa: E402


class Arm:
    """One engine of the comparison, kept open so that the arms' timed runs interleave."""

    def __init__(
        self, path: str, loras: list, names: list, slots: int, args: Any, graphs: bool = True
    ) -> None:
        from engine.engine import Engine

        self.names, self.args = names, args
        self.engine = Engine(
            model_path=path, disable_overlap_schedule=True, skip_tokenizer_init=True,
            max_total_tokens=args.requests * (args.context + args.output) + 256,
            lora_paths=tuple(f"a{i}={p}" for i, p in enumerate(loras, start=1)),
            max_loras_per_batch=slots, device=args.device, dtype=args.dtype,
            disable_cuda_graph=not graphs,
        )  # fmt: skip
        self.batch_sizes: list[int] = []
        self.walls: list[float] = []
        run_batch = self.engine.scheduler.run_batch

        def counted(batch: Any) -> Any:
            if batch.forward_mode.is_decode():
                self.batch_sizes.append(len(batch.reqs))
            return run_batch(batch)

        self.engine.scheduler.run_batch = counted

    def run(self, prompts: list) -> list:
        """One timed run of all prompts (the prefix cache flushed first)."""
        params = {"max_new_tokens": self.args.output, "temperature": 0.0, "ignore_eos": True}
        self.engine.flush_cache()
        t0 = time.perf_counter()
        outs = self.engine.generate(input_ids=prompts, sampling_params=params, lora_path=self.names)
        self.walls.append(time.perf_counter() - t0)
        return [o["output_ids"] for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--context", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--output", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    args = parse_arm_args(ap, "lora")
    from services.tiny_lora import make_tiny_lora

    path = small_model(args.layers, args.seed)
    loras = [
        make_tiny_lora(path, f"{path}-lora{i}-r{args.rank}", rank=args.rank, seed=i)
        for i in range(1, args.adapters + 1)
    ]
    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(3, 30000) for _ in range(args.context)] for _ in range(args.requests)
    ]
    n, k = args.requests, args.adapters
    mixed = [f"a{1 + i % k}" for i in range(n)]
    arms = [  # (name, adapters loaded, request adapters, slots, CUDA graphs)
        ("base", [], [None] * n, 1, True),
        ("served, unused", loras, [None] * n, k, True),
        ("one adapter", loras, ["a1"] * n, k, True),
        (f"mixed, {k} slots", loras, mixed, k, True),
        ("mixed, 1 slot", loras, mixed, 1, True),
    ]
    if args.device.startswith("cuda"):  # what the decode graphs save with adapters
        arms.append((f"mixed, {k} slots, eager", loras, mixed, k, False))
    engines = [Arm(path, loaded, names, slots, args, graphs)
               for _, loaded, names, slots, graphs in arms]
    tokens: list[list] = [[] for _ in engines]
    for engine in engines:  # a warm-up run each: first-call costs out of the timing
        engine.run(prompts)
        engine.walls.clear()
        engine.batch_sizes.clear()
    for i in range(args.repeat):  # rounds over all arms: drift on this shared machine hits all
        for engine, out in zip(engines, tokens):
            out[:] = engine.run(prompts)
        print(f"round {i + 1}: " + " ".join(f"{e.walls[-1]:.2f}" for e in engines), flush=True)
    rows = []
    for (name, *_), engine, out in zip(arms, engines, tokens):
        wall = min(engine.walls)
        rows.append({
            "arm": name, "wall_s": wall,
            "output_tok_s": sum(map(len, out)) / wall,
            "max_decode_batch": max(engine.batch_sizes, default=0), "tokens": out,
        })  # fmt: skip
        engine.engine.shutdown()
    base = rows[0]["output_tok_s"]
    for r in rows:
        r["vs_base"] = r["output_tok_s"] / base
    table = [{k: v for k, v in r.items() if k != "tokens"} for r in rows]
    print_table(table, ["arm", "wall_s", "output_tok_s", "max_decode_batch", "vs_base"])
    summary = {
        "served_unused_vs_base": rows[1]["vs_base"],
        "one_adapter_vs_base": rows[2]["vs_base"],
        "mixed_vs_base": rows[3]["vs_base"],
        "mixed_one_slot_vs_base": rows[4]["vs_base"],
        "mixed_arms_same_tokens": rows[3]["tokens"] == rows[4]["tokens"],
        **({"mixed_graphs_vs_eager": rows[3]["output_tok_s"] / rows[5]["output_tok_s"],
            "mixed_graphs_same_tokens_as_eager": rows[3]["tokens"] == rows[5]["tokens"]}
           if len(rows) > 5 else {}),
        "adapters_change_output": rows[2]["tokens"] != rows[0]["tokens"],
    }
    print(summary)
    print("wrote", write_result(args.name, table, summary, config=vars(args)))
    if not summary["mixed_arms_same_tokens"]:
        raise SystemExit("the two mixed arms generated different tokens")


if __name__ == "__main__":
    main()

"""What compiling a new grammar costs the requests already running: grammars compiled on the
scheduler's thread (`grammar_compile_threads=0`) vs in the background (the default, 2 threads),
side by side on the same model, prompts and arrivals (CPU).

    OMP_NUM_THREADS=1 python benchmarks/grammar_compile.py [--model DIR] [--reps 3]

The model has a Qwen2-sized vocabulary (151,936 tokens; built at --model if missing), since
what a grammar costs to compile grows with the vocabulary. `--free` requests decode
`--out` tokens each (ignore_eos); from step 10, a request with a JSON schema never seen
before (a tool-like object of 12 typed fields, some of them strings with a length bound;
`--schemas` of them) arrives every `--every` steps and asks for 8 tokens. Each way starts
from a fresh engine whose grammar backend (xgrammar's tokenizer info over the vocabulary) is
built before the timed part, so only compilations are compared; a build's cost is reported
apart.

Reported per way and rep, over the free requests' inter-token latencies (ITL: time between
two steps that gave a request a token): p50, p99 and max, and the schema requests' time to
first token (median). Summary: medians over reps of sync/background for ITL max and p99, and
background/sync for the schema requests' TTFT; what one backend build and one compile cost,
measured alone.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import print_table, write_result  # noqa: E402

VOCAB = 151_936
WAYS = {"sync": 0, "background": 2}
# Field types; a string with a length bound is the one slow to compile (~80 ms on this vocab)
ITEM = {"type": "object", "properties": {"code": {"type": "string", "pattern": "[A-Z]{2}-[0-9]+"},
                                         "weight": {"type": "number"}}}
TYPES = [{"type": "string", "pattern": "[a-z]{3,12}"}, {"type": ["integer", "string"]},
         {"type": "array", "items": ITEM}, {"enum": ["low", "mid", "high"]},
         {"type": "string", "minLength": 1, "maxLength": 32}, {"type": "number"}]  # fmt: skip


def schema(i: int) -> str:
    """A distinct tool-argument-like schema for each i."""
    rng = random.Random(i)
    props = {f"field_{i}_{j}": rng.choice(TYPES) for j in range(12)}
    return json.dumps({"type": "object", "properties": props, "required": list(props)[:6],
                       "additionalProperties": False})  # fmt: skip


def ensure_model(path: str) -> str:
    if not os.path.exists(os.path.join(path, "config.json")):
        from services.tiny_model import make_tiny_model

        make_tiny_model(path, arch="qwen2", vocab_size=VOCAB, hidden_size=256, num_layers=4,
                        num_heads=4, num_kv_heads=2, intermediate_size=768)  # fmt: skip
    return path


def one_way(model: str, threads: int, args: argparse.Namespace, rep: int) -> dict[str, Any]:
    from engine import Engine
    from engine.sampling.sampling_params import SamplingParams

    rng = random.Random(rep)
    engine = Engine(model_path=model, random_seed=0, grammar_compile_threads=threads)
    sched = engine.scheduler
    sched.grammar_queue.backend()  # built before the timed part, in both ways
    try:
        for i in range(args.free):
            prompt = [rng.randrange(300, 20_000) for _ in range(32)]
            params = SamplingParams(max_new_tokens=args.out, ignore_eos=True).normalize()
            sched.add_request(f"free-{i}", prompt, params)
        last: dict[str, float] = {}
        itls: list[float] = []
        submitted: dict[str, float] = {}
        ttft: dict[str, float] = {}
        step, injected, start = 0, 0, time.perf_counter()
        while sched.has_work():
            if step >= 10 and (step - 10) % args.every == 0 and injected < args.schemas:
                rid = f"schema-{injected}"
                params = SamplingParams(max_new_tokens=8, json_schema=schema(rep * 1000 + injected))
                prompt = [rng.randrange(300, 20_000) for _ in range(16)]
                submitted[rid] = time.perf_counter()
                sched.add_request(rid, prompt, params.normalize())
                injected += 1
            events = sched.step()
            now = time.perf_counter()
            step += 1
            for e in events:
                if not e.new_token_ids:
                    continue
                if e.rid.startswith("free"):
                    if e.rid in last:
                        itls.append(now - last[e.rid])
                    last[e.rid] = now
                elif e.rid not in ttft:
                    ttft[e.rid] = now - submitted[e.rid]
        seconds = time.perf_counter() - start
        assert sched.take_rejected() == [] and len(ttft) == args.schemas, "a request failed"
    finally:
        engine.shutdown()
    itls.sort()
    return {"itl_p50_ms": 1e3 * itls[len(itls) // 2],
            "itl_p99_ms": 1e3 * itls[int(0.99 * (len(itls) - 1))],
            "itl_max_ms": 1e3 * itls[-1],
            "schema_ttft_ms": 1e3 * statistics.median(ttft.values()),
            "seconds": seconds, "steps": step}  # fmt: skip


def compile_costs(model: str) -> dict[str, float]:
    """One backend build and one compile of a new schema, alone."""
    from engine.sampling.grammar import GrammarBackend
    from engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model)
    t0 = time.perf_counter()
    backend = GrammarBackend(tokenizer, VOCAB, [tokenizer.eos_token_id])
    build = time.perf_counter() - t0
    times = []
    for i in range(5):
        t0 = time.perf_counter()
        backend.compile(("json_schema", schema(-1 - i)))
        times.append(time.perf_counter() - t0)
    return {"backend_build_ms": 1e3 * build, "compile_ms_median": 1e3 * statistics.median(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="/tmp/sluice-bench-qwen2-152k")
    ap.add_argument("--free", type=int, default=16, help="requests decoding throughout")
    ap.add_argument("--out", type=int, default=160, help="tokens per free request")
    ap.add_argument("--schemas", type=int, default=6, help="new-schema requests arriving")
    ap.add_argument("--every", type=int, default=16, help="steps between their arrivals")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = ensure_model(args.model)
    rows: list[dict[str, Any]] = []
    for rep in range(args.reps):
        ways = list(WAYS.items())
        for way, threads in ways if rep % 2 == 0 else ways[::-1]:
            rows.append({"rep": rep, "way": way, **one_way(model, threads, args, rep)})
    print_table(rows, ["rep", "way", "itl_p50_ms", "itl_p99_ms", "itl_max_ms",
                       "schema_ttft_ms", "seconds"])  # fmt: skip

    def ratio(key: str, num: str, den: str) -> float:
        def get(rep: int, way: str) -> float:
            return next(r[key] for r in rows if (r["rep"], r["way"]) == (rep, way))

        return statistics.median(get(rep, num) / get(rep, den) for rep in range(args.reps))

    summary = {
        "itl_max_sync_vs_background": ratio("itl_max_ms", "sync", "background"),
        "itl_p99_sync_vs_background": ratio("itl_p99_ms", "sync", "background"),
        "schema_ttft_background_vs_sync": ratio("schema_ttft_ms", "background", "sync"),
        "itl_p50_background_vs_sync": ratio("itl_p50_ms", "background", "sync"),
        **compile_costs(model),
        "vocab_size": VOCAB,
        "cores": os.cpu_count(),
        "note": "xgrammar releases the GIL while compiling; what is left of the stall in the "
        "background way is the CPU the compile thread takes from the forward and the scheduler",
    }
    print(json.dumps(summary, indent=1))
    from importlib.metadata import version

    path = write_result("grammar_compile", rows, summary, model=model, args=vars(args),
                        xgrammar=version("xgrammar"))  # fmt: skip
    print("wrote", path)


if __name__ == "__main__":
    main()

"""What the worker's Redis I/O costs its scheduler, per decode step (why it is a process).

    python benchmarks/worker_io_probe.py --model DIR [--batch 64] [--reps 4] [--engine-core 0]

One scheduler (the plain loop, one torch thread, pinned to `--engine-core`) decodes
`--batch` requests; after every step, the step's output goes to Redis (an embedded
redis-server) by one of:

* `thread`:  the I/O in a thread of the scheduler's process (how the worker did it
  before): the scheduler queues the row records, the thread builds the `StepOutputMsg`
  and publishes it (pinned to the other cores);
* `inline`:  the scheduler thread builds and publishes it itself;
* `process`: the worker's design: the row records go down a pipe to the I/O process
  (`services.worker_link.IoLink`), which builds and publishes.

Steps get longer as sequences grow, so each variant runs in blocks of 10 steps alternated
with blocks that send nothing (`off`), and a block's cost is its mean step minus the mean
of the two `off` blocks beside it; medians over all blocks. The model should be the
serving benchmark's (`bench_serving.py` docstring), where a decode step at batch 64 takes
~20 ms on one core.

Writes `benchmarks/results/worker_io_probe.json` (summary: `added_ms_per_step_<variant>`).
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import sys
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import print_table, write_result  # noqa: E402

VARIANTS = ("thread", "inline", "process")
BLOCK = 10  # steps per block
BLOCKS = 24  # blocks per repetition (half of them `off`)


class StepSink:
    """The step output of the scheduler, sent to Redis in one of the VARIANTS."""

    def __init__(self, redis_url: str, prefix: str, others: set[int]) -> None:
        from services.worker_link import IoLink
        from services.worker_load import WorkerFacts
        from services.worker_requests import ReqInfo, Windows
        from shared.bus import Bus

        self.bus = Bus.from_url(redis_url, prefix, maxlen=10_000)
        self.info = ReqInfo("router-probe", True, True, 64)
        self.infos: dict[str, Any] = {}
        self.windows = Windows()
        self.stream = f"{prefix}:detok"
        self.outbox: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._drain, daemon=True)
        self.thread.start()
        facts = WorkerFacts("probe", "probe", 1, 1, 1, os.getpid())
        hello = {
            "redis_url": redis_url,
            "prefix": prefix,
            "stream_maxlen": 10_000,
            "worker_id": "probe",
            "batch_size": 64,
            "block_ms": 5,
            "heartbeat_ttl_s": 5.0,
            "log_level": "warning",
            "facts": list(facts),
        }
        self.link = IoLink(hello)
        for tid in map(int, os.listdir(f"/proc/{os.getpid()}/task")):
            if tid != os.getpid():  # the sender thread (and any other) off the engine core
                os.sched_setaffinity(tid, others)
        os.sched_setaffinity(self.link.proc.pid, others)

    def start(self, rid: str) -> None:
        self.infos[rid] = self.info
        self.link.start(rid, self.info)

    def _message(self, step: int, records: list, plain: list) -> Any:
        from services.worker_requests import step_message

        # the I/O process's work
        return step_message(records, self.infos, "probe", step, plain, self.windows)

    def _drain(self) -> None:
        while True:
            step, records, plain = self.outbox.get()
            self.bus.publish_many([(self.stream, self._message(step, records, plain))])

    def send(self, variant: str, step: int, events: list) -> None:
        from services.worker_requests import step_records

        records, plain, _ = step_records(events, self.infos)  # the worker's
        if variant == "thread":
            self.outbox.put((step, records, plain))
        elif variant == "inline":
            self.bus.publish_many([(self.stream, self._message(step, records, plain))])
        else:
            self.link.step(step, records, plain)

    def close(self) -> None:
        self.link.close()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from benchmarks.serving_disagg import make_engine
    from engine.sampling.sampling_params import SamplingParams
    from shared.redis_server import EmbeddedRedis

    torch.set_num_threads(1)
    flags = ["--max-total-tokens", "40000", "--max-running-requests", str(args.batch)]
    engine = make_engine(args.model, [*flags, "--disable-overlap-schedule"])
    sched = engine.scheduler
    engine_cores = {args.engine_core}
    others = set(os.sched_getaffinity(0)) - engine_cores or engine_cores
    with EmbeddedRedis() as server:
        sink = StepSink(server.url, "probe", others)
        os.sched_setaffinity(0, engine_cores)
        blocks: dict[str, list[float]] = {v: [] for v in ("off", *VARIANTS)}
        costs: dict[str, list[float]] = {v: [] for v in VARIANTS}
        step = 0
        for rep in range(args.reps):
            rids = [f"p{rep}-{i}" for i in range(args.batch)]
            for i, rid in enumerate(rids):
                p = SamplingParams.from_dict(
                    {"max_new_tokens": 2000, "temperature": 0.0, "ignore_eos": True}
                )
                p.verify()
                sched.add_request(rid, [(7 * i + j) % 4000 + 10 for j in range(64)], p.normalize())
                sink.start(rid)
            while len(sched.step()) < args.batch or sched.stats.num_waiting:
                pass  # prefill until every request decodes
            seq: list[tuple[str, float]] = []
            for b in range(BLOCKS):
                variant = "off" if (b + rep) % 2 == 0 else VARIANTS[(b // 2) % len(VARIANTS)]
                times = []
                for _ in range(BLOCK):
                    t0 = time.perf_counter()
                    events = sched.step()
                    step += 1
                    if variant != "off":
                        sink.send(variant, step, events)
                    times.append(time.perf_counter() - t0)
                seq.append((variant, statistics.mean(times[1:]) * 1e3))  # first: spill-over
            for i in range(1, len(seq) - 1):
                variant, ms = seq[i]
                blocks[variant].append(ms)
                if variant != "off":
                    costs[variant].append(ms - (seq[i - 1][1] + seq[i + 1][1]) / 2)
            for rid in rids:
                sched.abort_request(rid)
            while sched.has_work():
                sched.step()
        sink.close()
    step_ms = statistics.median(blocks["off"])
    rows = [
        {
            "variant": v,
            "added_ms_per_step": statistics.median(costs[v]),
            "added_fraction": statistics.median(costs[v]) / step_ms,
            "blocks": len(costs[v]),
        }
        for v in VARIANTS
    ]
    return {"step_ms_off": step_ms, "rows": rows, "costs_ms": costs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--engine-core", type=int, default=0)
    args = ap.parse_args()
    res = measure(args)
    print(f"decode step at batch {args.batch}, nothing sent: {res['step_ms_off']:.2f} ms")
    print_table(res["rows"], ["variant", "added_ms_per_step", "added_fraction", "blocks"])
    summary = {f"added_ms_per_step_{r['variant']}": r["added_ms_per_step"] for r in res["rows"]}
    summary["step_ms_off"] = res["step_ms_off"]
    print("wrote", write_result("worker_io_probe", res, summary, batch=args.batch))


if __name__ == "__main__":
    main()

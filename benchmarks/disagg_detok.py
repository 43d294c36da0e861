"""Detokenizer throughput and scaling, the third part of `--measure-disaggregation`.

A private Redis, N detokenizer processes, synthetic `StepOutputMsg`s (`--detok-batch`
requests per step, one token each, with their windows) written into `{p}:detok` in one burst;
tokens/s is tokens over the time until every row reached the router stream (best of 3
bursts), and tokens per CPU-second of the detokenizers (their capacity per core, which a busy
machine does not distort). For each N in `--detok-scaling`; `plot_scaling` draws tokens/s
against N beside the linear line.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import msgpack
import numpy as np
import psutil
import redis

from shared.heartbeat import list_live
from shared.keys import DETOKENIZER_KIND, detok_stream, router_out_stream
from shared.messages import FinishReason, StepOutputMsg, StepRow
from shared.redis_clients import connect
from shared.redis_server import EmbeddedRedis

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def synthetic_steps(pool: np.ndarray, steps: int, batch: int, seed: int) -> list[bytes]:
    """Encoded step messages: `batch` requests advancing one token per step for `steps`."""
    rng = np.random.default_rng(seed)
    ids = rng.choice(pool, size=(batch, steps)).tolist()
    msgs = []
    for s in range(steps):
        final = FinishReason("length") if s == steps - 1 else None
        rows = [
            StepRow(
                f"r{j}", "bench", s, [ids[j][s]], ids[j][max(0, s - 6) : s], final, 16, s + 1, 0
            )
            for j in range(batch)
        ]
        msgs.append(StepOutputMsg.from_rows(rows, worker_id="0", step=s).to_msg())
    return msgs


def detok_throughput(
    model: str, num_detok: int, msgs: list[bytes], tokens: int, repeats: int = 3
) -> dict[str, float]:
    """Tokens/s: the best of `repeats` bursts (the least disturbed by other work on the
    machine); and tokens per CPU-second the detokenizers spent (what one would do with a
    core of its own)."""
    prefix = "bench"
    with EmbeddedRedis() as server:
        client = connect(server.url)
        cmd = [
            sys.executable,
            "-m",
            "services.cli",
            "--log-level",
            "warning",
            "detokenizer",
            "--redis-url",
            server.url,
            "--prefix",
            prefix,
            "--model",
            model,
        ]
        procs = [subprocess.Popen(cmd, cwd=REPO) for _ in range(num_detok)]
        try:
            deadline = time.monotonic() + 300
            while len(list_live(client, prefix, DETOKENIZER_KIND)) < num_detok:
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    raise RuntimeError("detokenizers did not start")
                time.sleep(0.2)
            watched = [psutil.Process(p.pid) for p in procs]
            cpu_before = sum(sum(p.cpu_times()[:2]) for p in watched)
            last_id, best = "0", 0.0
            for _ in range(repeats):
                last_id, tok_s = _time_burst(client, prefix, msgs, tokens, last_id)
                best = max(best, tok_s)
            cpu = sum(sum(p.cpu_times()[:2]) for p in watched) - cpu_before
            return {"tok_s": best, "tok_per_cpu_s": tokens * repeats / cpu}
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait()
            client.close()


def _time_burst(
    client: redis.Redis, prefix: str, msgs: list[bytes], tokens: int, last_id: str
) -> tuple[str, float]:
    """Write `msgs` into `{p}:detok` at once; time until all their tokens reached the router
    stream (read from after `last_id`). Returns the last entry id read and tokens/s."""
    out = router_out_stream(prefix, "bench")
    start = time.perf_counter()
    pipe = client.pipeline(transaction=False)
    for m in msgs:
        pipe.xadd(detok_stream(prefix), {b"m": m})
    pipe.execute()
    seen, end = 0, start
    while seen < tokens:
        reply = client.xread({out: last_id}, count=1000, block=30_000)
        if not reply:
            raise RuntimeError(f"detokenizers stalled after {seen} of {tokens} tokens")
        for entry_id, fields in reply[0][1]:
            body = msgpack.unpackb(fields[b"m"])
            seen += sum(body["ends"]) - sum(body["starts"])
            last_id = entry_id
        end = time.perf_counter()
    return last_id, tokens / (end - start)


def detok_scaling(model: str, counts: list[int], steps: int, batch: int, seed: int) -> dict:
    from engine.tokenizer import load_tokenizer as load

    tok = load(model)
    special = set(tok.all_special_ids)
    pool = np.array([t for t in range(len(tok)) if t not in special])
    msgs = synthetic_steps(pool, steps, batch, seed)
    return {n: detok_throughput(model, n, msgs, steps * batch) for n in counts}


def detok_tok_s(detok: dict[int, dict[str, float]]) -> dict[int, float]:
    return {n: v["tok_s"] for n, v in detok.items()}


def plot_scaling(detok: dict[int, float], path: str, load: float) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    counts = list(detok)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(counts, [detok[n] / 1000 for n in counts], "o-", label="measured")
    ax.plot(
        counts,
        [detok[counts[0]] * n / counts[0] / 1000 for n in counts],
        "--",
        color="gray",
        label="linear",
    )
    ax.set_xlabel("detokenizer processes")
    ax.set_ylabel("k tokens / s")
    ax.set_xticks(counts)
    ax.set_title(f"Detokenizer scaling ({os.cpu_count()} CPU cores, load avg {load:.1f})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print("wrote", path)

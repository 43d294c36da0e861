"""Listing the live services of a kind (what each router does every 0.5 s, and tokenizers
too), against how many other keys the Redis holds (stored responses, rid claims, ...).

    python benchmarks/heartbeat_listing.py [--keys 0 10000 100000] [--reps 20]

"index": `shared.heartbeat.list_live`, one script over the kind's index set and the keys it
names. "scan": what it did before, kept here as the peer: SCAN the keyspace for
`{p}:hb:{kind}:*` (COUNT 1000), then MGET the keys found. 4 workers beat; the other keys
are 200-byte strings like stored responses. Wall time per listing (median over reps) on an
embedded redis-server over loopback; the ratio is the point.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import redis

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import print_table, write_result  # noqa: E402
from shared.heartbeat import Heartbeat, list_live  # noqa: E402
from shared.keys import heartbeat_key  # noqa: E402
from shared.messages import ServiceStatusMsg, decode_message  # noqa: E402
from shared.redis_clients import connect  # noqa: E402
from shared.redis_server import EmbeddedRedis  # noqa: E402

PREFIX = "bench-hb"
COLUMNS = ["other_keys", "way", "ms_per_listing", "scan_vs_index"]


def scan_listing(client: redis.Redis, prefix: str, kind: str) -> dict:
    keys = sorted(client.scan_iter(match=f"{prefix}:hb:{kind}:*", count=1000))
    values = client.mget(keys) if keys else []
    return {k.decode().rsplit(":", 1)[1]: decode_message(v) for k, v in zip(keys, values) if v}


def timed(fn, reps: int) -> float:  # noqa: ANN001
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--keys", type=int, nargs="+", default=[0, 10_000, 100_000])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    server = EmbeddedRedis().start()
    rows = []
    try:
        client = connect(server.url)
        for i in range(4):
            msg = ServiceStatusMsg("worker", f"w{i}", "host", i, 0.0, 0.0)
            Heartbeat(client, heartbeat_key(PREFIX, "worker", f"w{i}"), 600, lambda m=msg: m).beat()
        have = 0
        for n in sorted(args.keys):
            pipe = client.pipeline(transaction=False)
            for i in range(have, n):
                pipe.set(f"{PREFIX}:response:resp_{i:08d}", b"x" * 200)
            pipe.execute()
            have = max(have, n)
            assert list_live(client, PREFIX, "worker") == scan_listing(client, PREFIX, "worker")
            index = timed(lambda: list_live(client, PREFIX, "worker"), args.reps)
            scan = timed(lambda: scan_listing(client, PREFIX, "worker"), args.reps)
            rows += [{"other_keys": n, "way": way, "ms_per_listing": 1e3 * t,
                      "scan_vs_index": scan / index if way == "scan" else None}
                     for way, t in (("index", index), ("scan", scan))]  # fmt: skip
        client.close()
    finally:
        server.stop()
    print_table(rows, COLUMNS)
    summary = {f"scan_vs_index_at_{r['other_keys']}_keys": r["scan_vs_index"]
               for r in rows if r["way"] == "scan"}  # fmt: skip
    summary |= {f"{r['way']}_ms_at_{r['other_keys']}_keys": r["ms_per_listing"] for r in rows}
    notes = ["embedded redis-server on loopback; 4 live workers; medians over reps"]
    print(write_result("heartbeat_listing", {"rows": rows}, summary, notes=notes))


if __name__ == "__main__":
    main()

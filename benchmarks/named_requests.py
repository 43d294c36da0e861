"""What naming requests (SGLang's `rid`) costs a router, and how long an abort takes when the
request is on another router (CPU, an embedded Redis on loopback).

    python benchmarks/named_requests.py [--requests 2000] [--aborts 300]

Two routers' `Broker`s (services/router_requests.py) in one process, each with its reader
task on its own stream, as two router processes would have (a heartbeat key is set for each);
no worker: nothing is submitted, so what is timed is the router's side alone.

* "open + close": a request's handles opened (`Broker.open`) and closed, without a rid
  (nothing touches Redis) and with one (its rid claimed in Redis, one EVALSHA round trip, and
  released when it closes, another, off the request's path): the wall time per request, 16 in
  flight at once (asyncio.gather), and the router's CPU time per request.
* "abort": `POST /abort_request`'s work for a rid held by the router itself (the handles
  found and cancelled) and for one held by the other router: the claim read, the
  `AbortNamedMsg` to the holder's stream, the holder's reader cancelling its handles and
  answering, and the answer read back. The wall time per abort, one at a time.

Medians over reps; absolute times on this shared machine are noise, the ratios are the point.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import print_table, write_result  # noqa: E402
from services.router_metrics import RouterMetrics  # noqa: E402
from services.router_protocol import SubRequest  # noqa: E402
from services.router_requests import Broker  # noqa: E402
from shared.async_bus import AsyncBus  # noqa: E402
from shared.keys import ROUTER_KIND, heartbeat_key  # noqa: E402
from shared.redis_server import EmbeddedRedis  # noqa: E402

COLUMNS = ["case", "named", "n", "wall_us", "cpu_us", "wall_vs_unnamed"]
PREFIX = "bench-named"
IN_FLIGHT = 16


def _sub(rid: str | None) -> SubRequest:
    return SubRequest(0, 0, {"max_new_tokens": 1}, text="x", rid=rid)


async def _broker(url: str, router_id: str) -> Broker:
    bus = AsyncBus.from_url(url, PREFIX)
    await bus.redis.set(heartbeat_key(PREFIX, ROUTER_KIND, router_id), b"", px=600_000)
    broker = Broker(bus, router_id, RouterMetrics(), check_s=3600.0)
    await broker.start()
    return broker


async def _open_close(broker: Broker, n: int, named: bool, tag: str) -> tuple[float, float]:
    """Wall and CPU seconds per request, `IN_FLIGHT` at a time."""

    async def one(i: int) -> None:
        handles = await broker.open([_sub(f"{tag}-{i}" if named else None)])
        for h in handles:
            h.close()

    cpu, wall = time.process_time(), time.perf_counter()
    for start in range(0, n, IN_FLIGHT):
        await asyncio.gather(*(one(i) for i in range(start, min(n, start + IN_FLIGHT))))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    if broker._tasks:  # the releases, off the requests' path: waited for, not timed
        await asyncio.wait(list(broker._tasks))
    return wall / n, cpu / n


async def _aborts(asker: Broker, holder: Broker, n: int, tag: str) -> tuple[float, float]:
    """Wall and CPU seconds per abort of a named request held by `holder`, asked of `asker`."""
    walls, cpu = [], 0.0
    for i in range(n):
        handles = await holder.open([_sub(f"{tag}-{i}"), _sub(f"{tag}-{i}")])
        c, w = time.process_time(), time.perf_counter()
        num = await asker.named.abort(f"{tag}-{i}", "bench")
        walls.append(time.perf_counter() - w)
        cpu += time.process_time() - c
        assert num == 2 and all(h.cancelled == "bench" for h in handles), num
        for h in handles:
            h.close()
    return statistics.median(walls), cpu / n


async def measure(url: str, requests: int, aborts: int, reps: int) -> list[dict]:
    one, two = await _broker(url, "r1"), await _broker(url, "r2")
    opened: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    aborted: dict[str, list[tuple[float, float]]] = {"here": [], "other router": []}
    try:
        for rep in range(reps + 1):  # the first rep warms up: not kept
            for named in (False, True):
                r = await _open_close(one, requests, named, f"o{rep}")
                opened[named] += [r] if rep else []
            for where, asker in (("here", one), ("other router", two)):
                r = await _aborts(asker, one, aborts, f"a{rep}{where[0]}")
                aborted[where] += [r] if rep else []
    finally:
        for b in (one, two):
            await b.stop()
            await b.bus.aclose()
    med = lambda rs, k: statistics.median(r[k] for r in rs)  # noqa: E731
    base = med(opened[False], 0)
    rows = [{"case": "open + close", "named": named, "n": requests,
             "wall_us": 1e6 * med(rs, 0), "cpu_us": 1e6 * med(rs, 1),
             "wall_vs_unnamed": med(rs, 0) / base} for named, rs in opened.items()]  # fmt: skip
    rows += [{"case": f"abort ({where})", "named": True, "n": aborts,
              "wall_us": 1e6 * med(rs, 0), "cpu_us": 1e6 * med(rs, 1),
              "wall_vs_unnamed": None} for where, rs in aborted.items()]  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--aborts", type=int, default=300)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    server = EmbeddedRedis().start()
    try:
        rows = asyncio.run(measure(server.url, args.requests, args.aborts, args.reps))
    finally:
        server.stop()
    print_table(rows, COLUMNS)
    summary = {
        "named_vs_unnamed_open_close_wall": rows[1]["wall_vs_unnamed"],
        "named_open_close_extra_us": rows[1]["wall_us"] - rows[0]["wall_us"],
        "abort_other_router_vs_here_wall": rows[3]["wall_us"] / rows[2]["wall_us"],
        "abort_other_router_us": rows[3]["wall_us"],
    }
    notes = ["two routers' brokers in one process, an embedded redis-server on loopback; "
             "no worker (nothing submitted): the router's side only; medians over reps"]
    print(write_result("named_requests", {"rows": rows}, summary, notes=notes))


if __name__ == "__main__":
    main()

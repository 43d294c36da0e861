"""What a background response costs the router, per event, against the same response streamed
straight to its client (CPU, an embedded Redis on loopback).

    python benchmarks/responses_background.py [--tokens 1000] [--reps 5]

A response of N one-token text deltas (the chat stream a router's `Formatter` yields, from
memory: no worker, no model) goes through the Responses API's `ResponseShaper.events()`, three
ways, alternated, each rep a new response; the deltas come all at once ("burst": the events of
a busy router, which the background writer pipelines together) or 1 ms apart ("paced": one
response at a time, every event its own round trip):

* "streamed": the events consumed as the router sends them to a client (the shaping only);
* "background": `BackgroundResponses`' task (services/responses_background.py): the shaping,
  then each event appended to the response's Redis stream (one XADD round trip) and parsed
  (its type and sequence number), and the record stored queued, in progress and at its end;
* "resumed": `follow()` reading all the events of a finished background response back from
  Redis, as `GET /v1/responses/{id}?stream=true` does on any router.

Reported per event (medians over reps): the router process's CPU time (`time.process_time`:
what it costs the router, the Redis server's own work not included) and the wall time (the
burst only; paced, it is the 1 ms gaps), and the CPU time's background / streamed. Absolute
times on this shared machine are noise; the ratio is the cost of keeping the events.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import AsyncIterator

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import print_table, write_result  # noqa: E402
from services.responses_api import ResponsesRequest  # noqa: E402
from services.responses_background import BackgroundResponses  # noqa: E402
from services.responses_store import ResponseStore  # noqa: E402
from services.responses_stream import ResponseShaper  # noqa: E402
from shared.redis_clients import connect_async  # noqa: E402
from shared.redis_server import EmbeddedRedis  # noqa: E402

COLUMNS = ["pace", "way", "tokens", "events", "cpu_us_per_event", "wall_us_per_event",
           "cpu_vs_streamed"]


class _Chunks:
    """A chat completion's SSE chunks, from memory: `tokens` one-word deltas, then usage."""

    def __init__(self, tokens: int, gap_s: float) -> None:
        self.gap_s = gap_s
        delta = lambda d, finish=None: {"choices": [{"index": 0, "delta": d,  # noqa: E731
                                                     "finish_reason": finish}]}  # fmt: skip
        chunks = [delta({"role": "assistant", "content": ""})]
        chunks += [delta({"content": f" w{i}"}) for i in range(tokens)]
        usage = {"prompt_tokens": 5, "completion_tokens": tokens, "total_tokens": tokens + 5}
        chunks += [delta({}, "stop"), {"choices": [], "usage": usage}]
        self._raw = [b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks]
        self._raw.append(b"data: [DONE]\n\n")

    async def chunks(self) -> AsyncIterator[bytes]:
        for raw in self._raw:
            if self.gap_s:
                await asyncio.sleep(self.gap_s)
            yield raw


def _shaper(tokens: int, gap_s: float, store: ResponseStore, background: bool) -> ResponseShaper:
    request = {"model": "m", "input": "x", "stream": True, "background": background}
    body = ResponsesRequest.parse(json.dumps(request).encode())
    save = None
    if background:
        async def save(response: dict, owner: str | None = None) -> None:
            await store.save(response, [], owner)
    return ResponseShaper(body, _Chunks(tokens, gap_s), save)  # type: ignore[arg-type]


def _clocks() -> tuple[float, float]:
    return time.process_time(), time.perf_counter()


def _since(start: tuple[float, float]) -> tuple[float, float]:
    cpu, wall = _clocks()
    return cpu - start[0], wall - start[1]


async def _streamed(shaper: ResponseShaper) -> tuple[tuple[float, float], int]:
    start, n = _clocks(), 0
    async for _ in shaper.events():
        n += 1
    return _since(start), n


async def _background(shaper: ResponseShaper, bg: BackgroundResponses) -> tuple:
    start = _clocks()
    await bg.start(shaper, lambda why: None)
    await bg._tasks[shaper.id]  # the task's whole run
    return _since(start), shaper._seq


async def _resumed(bg: BackgroundResponses, response_id: str) -> tuple:
    start, n = _clocks(), 0
    async for _ in bg.follow(response_id, -1):
        n += 1
    return _since(start), n


async def measure(url: str, tokens: int, reps: int, gap_s: float) -> list[dict]:
    client = connect_async(url)
    store = ResponseStore(client, "bench", 600.0)
    bg = BackgroundResponses(store, "bench")
    cpu: dict[str, list[float]] = {"streamed": [], "background": [], "resumed": []}
    wall: dict[str, list[float]] = {way: [] for way in cpu}
    for rep in range(reps + 1):  # the first rep warms up: not kept
        s, n = await _streamed(_shaper(tokens, gap_s, store, False))
        shaper = _shaper(tokens, gap_s, store, True)
        b, m = await _background(shaper, bg)
        r, k = await _resumed(bg, shaper.id)
        assert n == m == k, (n, m, k)  # the same events every way
        for way, (c, w) in (("streamed", s), ("background", b), ("resumed", r)) if rep else ():
            cpu[way].append(1e6 * c / n)
            wall[way].append(1e6 * w / n)
    await bg.stop()
    await client.aclose()
    base = statistics.median(cpu["streamed"])
    pace = "paced" if gap_s else "burst"
    return [{"pace": pace, "way": way, "tokens": tokens, "events": n,
             "cpu_us_per_event": statistics.median(cpu[way]),
             "wall_us_per_event": statistics.median(wall[way]) if not gap_s else None,
             "cpu_vs_streamed": statistics.median(cpu[way]) / base} for way in cpu]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    server = EmbeddedRedis().start()
    try:
        rows = []
        for gap_s in (0.0, 0.001):
            rows += asyncio.run(measure(server.url, args.tokens, args.reps, gap_s))
            print_table(rows[-3:], COLUMNS)
    finally:
        server.stop()
    print_table(rows, COLUMNS)
    summary = {f"{r['pace']}/{r['way']}_cpu_vs_streamed": r["cpu_vs_streamed"] for r in rows}
    summary |= {f"{r['pace']}/{r['way']}_cpu_us_per_event": r["cpu_us_per_event"] for r in rows}
    notes = ["one router process, an embedded redis-server on loopback; medians over reps; "
             "the events are those of one output_text delta per token"]  # fmt: skip
    print(write_result("responses_background", {"rows": rows}, summary, notes=notes))


if __name__ == "__main__":
    main()

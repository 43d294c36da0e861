"""A router's request deadlines against a real Redis, in process (services/router_requests.py):
a request times out (504) after the router's request timeout, but the time generation spends
paused (the deployment's pause record, services/router_pause.py) does not count."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from services.router_handle import RequestHandle
from services.router_metrics import RouterMetrics
from services.router_protocol import ApiError, SubRequest
from services.router_requests import Broker
from shared.async_bus import AsyncBus
from shared.keys import paused_key

pytest_plugins = ["tests.redis_fixtures"]
PREFIX = "deadlines"
TIMEOUT_S = 2.0


def timed_out(handle: RequestHandle) -> bool:
    return any(isinstance(m, ApiError) and m.status == 504 for m in handle._inbox)


async def until(check: Callable[[], bool]) -> None:
    for _ in range(200):
        if check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("never came")


def test_time_paused_does_not_count_against_the_deadline(redis_url: str) -> None:
    async def run() -> None:
        bus = AsyncBus.from_url(redis_url, PREFIX)
        broker = Broker(bus, "r1", RouterMetrics(), request_timeout_s=TIMEOUT_S, check_s=0.05)
        await broker.start()
        sub = SubRequest(0, 0, {"max_new_tokens": 1}, text="x")
        try:
            running = broker.handles["running"] = RequestHandle(broker, sub, time.perf_counter())
            await asyncio.sleep(TIMEOUT_S + 0.5)
            assert timed_out(running)  # (the clock runs while generating)
            del broker.handles["running"]
            await bus.redis.set(paused_key(PREFIX), "keep")
            await until(lambda: broker.paused == "keep")  # (from the next refresh)
            paused = broker.handles["paused"] = RequestHandle(broker, sub, time.perf_counter())
            await asyncio.sleep(TIMEOUT_S + 0.5)
            assert not timed_out(paused)
            await bus.redis.delete(paused_key(PREFIX))
            await until(lambda: broker.paused is None)
            await asyncio.sleep(0.5)
            assert not timed_out(paused)  # (most of its time left)
            await asyncio.sleep(TIMEOUT_S)
            assert timed_out(paused)
        finally:
            broker.handles.clear()
            await broker.stop()
            await bus.aclose()

    asyncio.run(run())

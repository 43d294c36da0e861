"""Cancelling a task that waits on Redis (shared/redis_clients.py, services/router_requests.py).

With a socket timeout (redis-py 8's default is 5 s), redis-py's asyncio client sends each
command through `asyncio.wait_for`, which on Python 3.11 drops a cancellation that lands once
the write is done: the task goes on. The router's loops then never ended and it ignored
SIGTERM until it was killed (CI: `test_compose_commands_start_serve_and_stop`, router -9).
The services' clients have no socket timeout; and a router's stop ends even over a client
that swallows cancellations."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from services.router_metrics import RouterMetrics
from services.router_requests import LOOP_STOP_S, Broker
from shared.async_bus import AsyncBus
from shared.redis_clients import connect_async

pytest_plugins = ["tests.redis_fixtures"]
TRIES = 30


async def cancellations_kept(client: aioredis.Redis) -> int:
    """How many of TRIES tasks, each cancelled while its GET is in flight, end cancelled."""
    await client.get("x")  # (connected)
    kept = 0
    for _ in range(TRIES):
        task = asyncio.create_task(client.get("x"))
        await asyncio.sleep(0)  # the command is being sent
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            kept += 1
    return kept


def test_a_cancelled_command_ends_its_task(redis_url: str) -> None:
    async def run() -> int:
        client = connect_async(redis_url)
        try:
            return await cancellations_kept(client)
        finally:
            await client.aclose()

    assert asyncio.run(run()) == TRIES


@pytest.mark.parametrize("socket_timeout", [None, 5.0])
def test_a_router_stop_ends_even_when_cancellations_are_lost(
    redis_url: str, socket_timeout: float | None
) -> None:
    """With a 5 s socket timeout cancellations are lost (checked: where none is, the case
    cannot test what it claims and is skipped), yet every stop ends within the loops' bound."""

    async def run() -> tuple[int, float]:
        client = aioredis.Redis.from_url(redis_url, socket_timeout=socket_timeout)
        lost = TRIES - await cancellations_kept(client)
        worst = 0.0
        for i in range(8):
            broker = Broker(AsyncBus(client, "cancel"), "r1", RouterMetrics(), check_s=0.01)
            await broker.start()
            await asyncio.sleep(0.02 * i)
            start = time.perf_counter()
            await asyncio.wait_for(broker.stop(), 2 * LOOP_STOP_S)
            worst = max(worst, time.perf_counter() - start)
        await client.aclose()
        return lost, worst

    lost, worst = asyncio.run(run())
    assert worst < LOOP_STOP_S + 1.0
    if socket_timeout is None:
        assert lost == 0
    elif lost == 0:
        pytest.skip("this redis-py and Python keep cancellations with a socket timeout")

"""A router's named requests against a real Redis, in process (services/router_named.py):
what is left held when a claim is interrupted, and the claim's life with its request."""

from __future__ import annotations

import asyncio

import pytest

from services.router_metrics import RouterMetrics
from services.router_protocol import SubRequest
from services.router_requests import Broker
from shared.async_bus import AsyncBus
from shared.keys import named_request_key

pytest_plugins = ["tests.redis_fixtures"]
PREFIX = "named"


def _sub(rid: str) -> SubRequest:
    return SubRequest(0, 0, {"max_new_tokens": 1}, text="x", rid=rid)


def test_a_claim_interrupted_by_the_client_leaves_nothing_held(redis_url: str) -> None:
    """The client goes while the claim's round trip is on its way: before Redis ran it, or
    after (its answer not read yet). Neither the router nor Redis keeps the rid held."""

    async def run() -> None:
        bus = AsyncBus.from_url(redis_url, PREFIX)
        broker = Broker(bus, "r1", RouterMetrics())
        key = named_request_key(PREFIX, "job")
        claim = broker.named._claim
        try:
            for made in (False, True):
                async def slow(*args: object, made: bool = made, **kwargs: object) -> object:
                    if made:
                        await claim(*args, **kwargs)  # Redis holds the claim; its answer lags
                    await asyncio.sleep(10)

                broker.named._claim = slow
                task = asyncio.create_task(broker.open([_sub("job")]))
                await asyncio.sleep(0.2)
                assert await bus.redis.exists(key) == made
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                assert broker.named.get("job") == []
                if broker._tasks:  # the release of the claim that was made
                    await asyncio.wait(list(broker._tasks))
                assert not await bus.redis.exists(key)
            broker.named._claim = claim
            handles = await broker.open([_sub("job"), _sub("job")])  # named again (n=2)
            assert (await bus.redis.get(key)).startswith(b"r1:")
            assert broker.named.get("job") == handles
            handles[0].close()
            assert await bus.redis.exists(key)  # one of its choices still runs
            handles[1].close()
            await asyncio.wait(list(broker._tasks))
            assert not await bus.redis.exists(key)
        finally:
            await bus.aclose()

    asyncio.run(run())

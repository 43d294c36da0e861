"""The router's view of the deployment (weight version, pause, memory released): its own
change is not undone by a refresh that read Redis before it (the race that let an abort
after `/update_weight_version` carry the old version)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from services.router_metrics import RouterMetrics
from services.router_requests import Broker


class _SlowRedis:
    """mget answers with what Redis held when it was asked, once `answer` is set."""

    def __init__(self) -> None:
        self.held = [b"step-2", None, None]
        self.answer = asyncio.Event()

    def register_script(self, script: str) -> None:  # (the broker's scripts: unused here)
        return None

    async def mget(self, *keys: str) -> list:
        held = list(self.held)
        await self.answer.wait()
        return held


def test_a_refresh_read_before_the_routers_own_change_is_dropped() -> None:
    async def run() -> None:
        redis = _SlowRedis()
        broker = Broker(SimpleNamespace(redis=redis, prefix="t"), "r0", RouterMetrics())
        refresh = asyncio.create_task(broker.read_deployment())
        await asyncio.sleep(0)  # (the refresh's read is on its way, with step-2)
        redis.held[0] = b"step-3"  # (what set_weight_version records, then:)
        broker.set_deployment(weight_version="step-3")
        redis.answer.set()
        await refresh
        assert broker.weight_version == "step-3"
        await broker.read_deployment()  # a read after the change takes what Redis holds
        assert broker.weight_version == "step-3"
        redis.held[0] = b"step-4"  # (another router's change: seen at the next refresh)
        await broker.read_deployment()
        assert broker.weight_version == "step-4"

    asyncio.run(run())

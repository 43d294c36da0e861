"""The requests of routers that are gone: a worker aborts them.

A router that dies (killed, out of memory, its host lost) cannot abort what it sent, and
nobody would read the output: without this, its requests would run on to their `max_tokens`,
taking the batch's room from everyone else's. The worker's I/O process (services/worker_io.py)
knows the router of every running request (its `ReqInfo`); its receiver thread calls
`RouterWatch.aborts()` between reads, which every `check_s` looks at those routers'
heartbeats (one pipelined EXISTS each) and, for a router missing at two looks in a row (its
heartbeat expired, and stayed so), returns an `AbortReqMsg` for each of its requests, once.
The scheduler ends them as any abort (finish_reason abort, "router ... is gone").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from services.worker_requests import ReqInfo
from shared.bus import Bus
from shared.keys import ROUTER_KIND, heartbeat_key
from shared.messages import AbortReqMsg

logger = logging.getLogger(__name__)


class RouterWatch:
    def __init__(self, bus: Bus, infos: Mapping[str, ReqInfo], check_s: float) -> None:
        """`infos`: the running requests (rid → info), kept by another thread; `check_s`
        <= 0 turns the watch off."""
        self.bus, self.infos, self.check_s = bus, infos, check_s
        self.missing: dict[str, int] = {}  # router id → looks in a row it was missing at
        self.aborted: set[str] = set()  # rids whose abort went out
        self._next = time.monotonic() + check_s

    def aborts(self) -> list[AbortReqMsg]:
        """The aborts of the requests of routers found gone (empty between looks). Raises
        Redis errors (the caller retries)."""
        now = time.monotonic()
        if self.check_s <= 0 or now < self._next:
            return []
        self._next = now + self.check_s
        by_router: dict[str, list[str]] = {}
        for rid, info in list(self.infos.items()):  # (a copy: the dict changes under us)
            by_router.setdefault(info.router_id, []).append(rid)
        self.aborted &= {rid for rids in by_router.values() for rid in rids}
        keys = {}
        for router_id in by_router:
            try:
                keys[router_id] = heartbeat_key(self.bus.prefix, ROUTER_KIND, router_id)
            except ValueError:  # not a router id a heartbeat can have: nothing to look at
                continue
        pipe = self.bus.redis.pipeline(transaction=False)
        for key in keys.values():
            pipe.exists(key)
        live = pipe.execute() if keys else []
        self.missing = {
            r: self.missing.get(r, 0) + 1 for r, alive in zip(keys, live, strict=True) if not alive
        }
        out = []
        for router_id, looks in self.missing.items():
            rids = [rid for rid in by_router[router_id] if rid not in self.aborted]
            if looks < 2 or not rids:
                continue
            logger.warning("router %s is gone: aborting its %d requests", router_id, len(rids))
            why = f"router {router_id} is gone"
            out += [AbortReqMsg(rid, why) for rid in rids]
            self.aborted.update(rids)
        return out

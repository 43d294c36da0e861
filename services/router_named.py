"""Requests their clients named, across every router: SGLang's `rid` and `/abort_request`.

A client may name a request (`rid` on /generate and the OpenAI bodies; a batch names each
prompt). A rid names one request in flight at a time in the whole deployment, not only on
the router that took it: the router claims it in Redis (`{p}:rid:{rid}`, holding
`{router id}:{claim token}`, with a TTL past the request's deadline) before sending the
request, and releases it when the request ends (only its own claim: compare and delete). A
rid held by a router whose heartbeat is gone, or by an earlier run of this router, is taken
over. A request whose rid is held elsewhere is a 400.

`POST /abort_request` may reach any router. One that holds the rid ends its requests at
their workers itself; one that does not looks the rid up and sends an `AbortNamedMsg` to the
holder's stream, whose reply (`AbortNamedRespMsg`) says how many it ended; `abort_all` goes
to every live router. An aborted request's response still comes, from the router that took
it, with what was generated and finish_reason `abort`.
"""

from __future__ import annotations

import logging
import uuid
from typing import TYPE_CHECKING

import redis

from services.router_control import Answers
from services.router_fields import RequestId, _Strict
from services.router_protocol import ApiError
from shared.heartbeat import is_live_async, list_live_async
from shared.keys import ROUTER_KIND, heartbeat_prefix, named_request_key, router_out_stream
from shared.messages import AbortNamedMsg, AbortNamedRespMsg

if TYPE_CHECKING:
    from services.router_handle import RequestHandle
    from services.router_requests import Broker

logger = logging.getLogger(__name__)

ABORT_REPLY_TIMEOUT_S = 2.0

# KEYS[1]: the rid's key; ARGV: our claim, its TTL (ms), our router id, the routers'
# heartbeat key prefix. 1 if claimed; else the holder's claim.
_CLAIM = """
local cur = redis.call('GET', KEYS[1])
if cur then
  local holder = string.match(cur, '^(.*):[^:]*$') or cur
  if holder ~= ARGV[3] and redis.call('EXISTS', ARGV[4] .. holder) == 1 then
    return cur
  end
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class AbortBody(_Strict):
    """SGLang's /abort_request: the requests with `rid`, or all of them (`abort_all`)."""

    rid: RequestId | None = None
    abort_all: bool = False


class NamedRequests:
    """The named handles of this router, and the aborts of named requests (see module doc)."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self._by_rid: dict[str, list[RequestHandle]] = {}
        self._claims: dict[str, str] = {}  # rid → our claim's value in Redis
        self._answers = Answers[int]()
        client = broker.bus.redis
        self._claim = client.register_script(_CLAIM)
        self._release = client.register_script(_RELEASE)

    @property
    def _ttl_ms(self) -> int:
        return int((self.broker.request_timeout_s + 60.0) * 1000)

    def _key(self, rid: str) -> str:
        return named_request_key(self.broker.bus.prefix, rid)

    async def add(self, handles: list[RequestHandle]) -> None:
        """Name the handles of a new request; 400 if a rid of it names a request in flight
        (here or on another router), 503 if Redis cannot be reached."""
        rids = list(dict.fromkeys(h.sub.rid for h in handles if h.sub.rid is not None))
        if not rids:
            return
        taken = [rid for rid in rids if rid in self._by_rid]
        if taken:
            raise _in_flight(taken[0])
        for h in handles:  # reserved here first: a second request with the rid waits on none
            if h.sub.rid is not None:
                self._by_rid.setdefault(h.sub.rid, []).append(h)
        router_id = self.broker.router_id
        hb_prefix = heartbeat_prefix(self.broker.bus.prefix, ROUTER_KIND)
        claims = {rid: f"{router_id}:{uuid.uuid4().hex[:12]}" for rid in rids}
        args = [self._ttl_ms, router_id, hb_prefix]
        try:
            if len(rids) == 1:  # the usual case: one round trip, no pipeline to build
                results = [await self._claim([self._key(rids[0])], [claims[rids[0]], *args])]
            else:
                async with self.broker.bus.redis.pipeline(transaction=False) as pipe:
                    for rid, value in claims.items():
                        await self._claim([self._key(rid)], [value, *args], client=pipe)
                    results = await pipe.execute()
        except BaseException as exc:  # (a client gone mid-claim too: nothing may stay held)
            self._claims.update(claims)  # whichever were made are released (if still ours)
            self._unreserve(rids)
            if isinstance(exc, redis.RedisError):
                msg = f"message bus unavailable: {exc}"
                raise ApiError(503, msg, None, "bus_unavailable") from exc
            raise
        won = {rid for rid, r in zip(rids, results, strict=True) if r == 1}
        self._claims.update((rid, claims[rid]) for rid in won)
        if len(won) < len(rids):
            self._unreserve(rids)
            raise _in_flight(next(rid for rid in rids if rid not in won))

    def _unreserve(self, rids: list[str]) -> None:
        for rid in rids:
            self._by_rid.pop(rid, None)
            self._free(rid)

    def discard(self, handle: RequestHandle) -> None:
        rid = handle.sub.rid
        group = self._by_rid.get(rid or "")
        if rid is None or group is None or handle not in group:
            return
        group.remove(handle)
        if not group:
            del self._by_rid[rid]
            self._free(rid)

    def _free(self, rid: str) -> None:
        value = self._claims.pop(rid, None)
        if value is not None:
            self.broker.spawn(self._release([self._key(rid)], [value]))

    def get(self, rid: str) -> list[RequestHandle]:
        return list(self._by_rid.get(rid, ()))

    def _local(self, rid: str | None) -> list[RequestHandle]:
        if rid is None:
            return [h for h in self.broker.handles.values() if h.observed]
        return self.get(rid)

    async def abort(self, rid: str | None, why: str) -> int:
        """End the requests named `rid` (None: every request) wherever they run; how many."""
        local = self._local(rid)
        self.broker.cancel(local, why)
        if rid is not None and local:
            return len(local)
        try:
            routers = await self._holders(rid)
            replies = await self._ask(routers, rid, why) if routers else {}
        except redis.RedisError as exc:
            raise ApiError(503, f"message bus unavailable: {exc}", None, "bus_unavailable") from exc
        if rid is not None and routers and not replies:
            msg = f"router {routers.pop()}, which holds rid {rid!r}, did not answer the abort"
            raise ApiError(503, msg, "rid", "router_unavailable")
        return len(local) + sum(replies.values())

    async def _holders(self, rid: str | None) -> set[str]:
        """The other live routers that may hold requests named `rid` (None: any request)."""
        client, prefix, me = self.broker.bus.redis, self.broker.bus.prefix, self.broker.router_id
        if rid is None:
            return set(await list_live_async(client, prefix, ROUTER_KIND)) - {me}
        claim = await client.get(self._key(rid))
        holder = claim.decode().rsplit(":", 1)[0] if claim else me
        if holder == me or not await is_live_async(client, prefix, ROUTER_KIND, holder):
            return set()
        return {holder}

    async def _ask(self, routers: set[str], rid: str | None, why: str) -> dict[str, int]:
        request_id = uuid.uuid4().hex
        msg = AbortNamedMsg(request_id, self.broker.router_id, rid, why)
        bus = self.broker.bus
        sends = {r: (router_out_stream(bus.prefix, r), msg) for r in routers}
        replies = await self._answers.ask(bus, request_id, sends, ABORT_REPLY_TIMEOUT_S)
        if len(replies) < len(routers):
            missing = sorted(routers - replies.keys())
            logger.warning("no answer to abort %s from routers %s", request_id, missing)
        return replies

    def deliver(self, msg: AbortNamedMsg | AbortNamedRespMsg) -> None:
        """An abort another router asks of this one (answered), or an answer to ours."""
        if isinstance(msg, AbortNamedMsg):
            handles = self._local(msg.rid)
            self.broker.cancel(handles, msg.reason)
            reply = AbortNamedRespMsg(msg.request_id, self.broker.router_id, len(handles))
            stream = router_out_stream(self.broker.bus.prefix, msg.router_id)
            self.broker.spawn(self.broker.bus.publish(stream, reply))
            return
        self._answers.deliver(msg.request_id, msg.router_id, msg.num_aborted)


def _in_flight(rid: str) -> ApiError:
    return ApiError(400, f"rid {rid!r} names a request in flight", "rid", "duplicate_rid")

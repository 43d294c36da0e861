"""Liveness: each service refreshes a key with a TTL; routers list the live workers.

A heartbeat key (`shared.keys.heartbeat_key`: `{p}:hb:{kind}:{id}`) holds a msgpack
message, usually the service's load (`WorkerLoadMsg`, `ServiceStatusMsg`). It is rewritten
every `interval_s` (a third of the TTL by default) by a daemon thread, so it disappears
within `ttl_s` of the process dying or hanging. Each beat also adds the id to its kind's
index set (`{p}:hb-index:{kind}`); `list_live` reads the set and the keys it names in one
script, dropping the ids whose key has expired, so a listing costs one round trip whatever
else the Redis holds (a SCAN over a keyspace of 100k stored responses took ~130 ms).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import redis
import redis.asyncio as aioredis

from shared.keys import heartbeat_index_key, heartbeat_key, heartbeat_parts, heartbeat_prefix
from shared.messages import Message, MessageError, decode_message

logger = logging.getLogger(__name__)

# KEYS[1]: a kind's index set; ARGV[1]: the prefix of its heartbeat keys. The ids with a
# live key and their payloads, alternating; the others leave the set.
_LIST = """
local out = {}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local payload = redis.call('GET', ARGV[1] .. id)
  if payload then
    out[#out + 1] = id
    out[#out + 1] = payload
  else
    redis.call('SREM', KEYS[1], id)
  end
end
return out
"""


class Heartbeat:
    """Refreshes `key` with `payload_fn()` and a TTL of `ttl_s` on a background thread.

    Redis errors and payload errors are logged and retried at the next beat: a heartbeat
    thread never dies while its process lives. If `payload_fn` fails, the key keeps its
    last payload and only its TTL is refreshed.
    """

    def __init__(
        self,
        client: redis.Redis,
        key: str,
        ttl_s: float,
        payload_fn: Callable[[], Message | bytes],
        interval_s: float | None = None,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        self.redis = client
        self.key = key
        self.index, self.service_id = heartbeat_parts(key)
        self.ttl_ms = max(1, round(ttl_s * 1000))
        self.payload_fn = payload_fn
        self.interval_s = ttl_s / 3 if interval_s is None else interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self) -> None:
        """Refresh the key now (what the thread does every `interval_s`)."""
        pipe = self.redis.pipeline(transaction=False)
        try:
            payload = self.payload_fn()
        except Exception:
            logger.exception("heartbeat %s: payload failed; refreshing the TTL only", self.key)
            pipe.pexpire(self.key, self.ttl_ms)
        else:
            data = payload.to_msg() if isinstance(payload, Message) else bytes(payload)
            pipe.set(self.key, data, px=self.ttl_ms)
        pipe.sadd(self.index, self.service_id)  # (after the key: a listed id has had one)
        pipe.execute()

    def start(self) -> Heartbeat:
        """Beat once (so the service is visible when this returns), then keep beating."""
        if self._thread is not None:
            return self
        self.beat()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat {self.key}")
        self._thread.daemon = True
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.beat()
            except redis.RedisError as exc:
                logger.warning("heartbeat %s: %s", self.key, exc)
            except Exception:  # a heartbeat thread must outlive any bug in a payload
                logger.exception("heartbeat %s failed", self.key)

    def stop(self, delete: bool = True) -> None:
        """Stop beating; `delete` removes the key at once (a clean shutdown)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if delete:
            try:
                self.redis.pipeline(transaction=False).delete(self.key).srem(
                    self.index, self.service_id
                ).execute()
            except redis.RedisError as exc:
                logger.warning("heartbeat %s: delete failed: %s", self.key, exc)

    @property
    def running(self) -> bool:
        return self._thread is not None

    def __enter__(self) -> Heartbeat:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _decode_live(prefix: str, kind: str, flat: list[bytes]) -> dict[str, Message]:
    live: dict[str, Message] = {}
    pairs = sorted(zip(flat[::2], flat[1::2], strict=True))
    for service_id, value in pairs:
        try:
            live[service_id.decode()] = decode_message(value)
        except MessageError as exc:
            key = heartbeat_key(prefix, kind, service_id.decode())
            logger.warning("heartbeat %s: undecodable payload: %s", key, exc.reason)
    return live


def _list_args(prefix: str, kind: str) -> tuple[list[str], list[str]]:
    return [heartbeat_index_key(prefix, kind)], [heartbeat_prefix(prefix, kind)]


def list_live(client: redis.Redis, prefix: str, kind: str) -> dict[str, Message]:
    """Live services of `kind` (e.g. "worker") by id, each with its latest payload."""
    keys, args = _list_args(prefix, kind)
    return _decode_live(prefix, kind, client.register_script(_LIST)(keys, args))


async def list_live_async(client: aioredis.Redis, prefix: str, kind: str) -> dict[str, Message]:
    """`list_live` for `redis.asyncio` clients."""
    keys, args = _list_args(prefix, kind)
    return _decode_live(prefix, kind, await client.register_script(_LIST)(keys, args))


async def is_live_async(client: aioredis.Redis, prefix: str, kind: str, service_id: str) -> bool:
    """Whether the service's heartbeat key is there (one EXISTS, no listing)."""
    return bool(await client.exists(heartbeat_key(prefix, kind, service_id)))

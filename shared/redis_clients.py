"""Redis clients as every service makes them: without a socket timeout.

redis-py 8 gives every connection a 5 s socket timeout by default (earlier majors had none).
On Python 3.11 its asyncio client then sends each command through `asyncio.wait_for`, which
drops a task's cancellation when the write has finished by the time the cancellation lands:
a cancelled task goes on as if nothing happened (the router's read and watch loops never
ended, so it ignored SIGTERM until it was killed). A blocking read longer than the timeout
(`--block-ms` above 5000) would also fail every time. Timeouts here are the callers' own:
`XREAD BLOCK`, the blocking pool's `timeout`, the services' heartbeats and deadlines.
"""

from __future__ import annotations

import redis
import redis.asyncio as aioredis

# what redis-py before 8 did by default, passed explicitly so every major behaves the same
# (redis-py 8's connect timeout stays: connecting is bounded by `async_timeout`, which keeps
# cancellations)
CLIENT_OPTIONS: dict[str, None] = {"socket_timeout": None}


def connect(url: str) -> redis.Redis:
    """A synchronous client for `url`."""
    return redis.Redis.from_url(url, **CLIENT_OPTIONS)


def connect_async(url: str, max_connections: int | None = None) -> aioredis.Redis:
    """An asyncio client for `url`; with `max_connections`, a request beyond them waits up to
    30 s for a connection instead of failing."""
    if max_connections is None:
        return aioredis.Redis.from_url(url, **CLIENT_OPTIONS)
    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=30, **CLIENT_OPTIONS
    )
    return aioredis.Redis(connection_pool=pool)

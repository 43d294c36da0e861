"""Redis fixtures: a real redis-server per test module, on a free loopback port.

Load them in a test module with

    pytest_plugins = ["tests.redis_fixtures"]

(importing the fixture names instead works too, but trips ruff's F811 at every use).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

from shared.redis_server import EmbeddedRedis


@pytest.fixture(scope="module")
def redis_server() -> Iterator[EmbeddedRedis]:
    """A private redis-server for the module; stopped (and its files removed) afterwards."""
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture(scope="module")
def redis_url(redis_server: EmbeddedRedis) -> str:
    return redis_server.url


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    """A bytes client on an emptied database."""
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield client
    client.close()


@pytest.fixture
def key_prefix() -> str:
    """A deployment prefix of its own for each test."""
    return f"test-{uuid.uuid4().hex[:8]}"

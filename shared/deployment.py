"""What a running deployment was changed to, kept in Redis so that a worker starting later (a
new one, or one restarted after a crash) serves what the others serve: the checkpoint of the
last `/update_weights_from_disk` (or `BROADCAST_WEIGHTS` after weights a trainer broadcast with
`/update_weights_from_distributed`, which no worker starting later can get: it refuses to
start), the LoRA adapters loaded (or unloaded) at run time, and
whether generation is paused (`/pause_generation`, `/pause`: a worker starting then starts
paused, and every router's `/is_paused` reads it), and the device memory released while idle
(`/release_memory_occupation`, `/sleep`: a worker starting then releases the same, and every
router's `/is_sleeping` reads it). Besides, the weight version (SGLang's
`weight_version`: a label a client gives the weights, reported with every output), which
only routers read.

The router records a change once every worker asked has made it (a pause before it asks
them, so that a worker starting meanwhile starts paused; a release once every worker has
released, a resume before they are asked); a worker reads the record
as it starts, before it announces itself (services/worker.py). The start flags (`--model`,
`--lora-paths`) are the base the record is applied over. `DEL {p}:weights {p}:lora-adapters`
makes workers start from their flags alone again; `DEL {p}:paused` unpauses the workers that
start later (`/continue_generation` the running ones), `DEL {p}:memory-released` lets them
start with their memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import redis
import redis.asyncio as aioredis

from shared.keys import (
    lora_adapters_key,
    memory_released_key,
    paused_key,
    weight_version_key,
    weights_key,
)

DEFAULT_WEIGHT_VERSION = "default"  # SGLang's --weight-version default
# the weights record after tensors broadcast by a trainer (on no disk); not a folder's name
BROADCAST_WEIGHTS = "<broadcast by a trainer>"


@dataclass
class DeploymentState:
    weights: str | None = None  # None: each worker's own --model
    # name -> folder; "" for an adapter unloaded at run time (also one of --lora-paths)
    lora_adapters: dict[str, str] = field(default_factory=dict)
    paused: str | None = None  # the mode of the pause in force (None: generating)
    released: tuple[str, ...] = ()  # the memory tags released while idle


def read_state(client: redis.Redis, prefix: str) -> DeploymentState:
    weights = client.get(weights_key(prefix))
    adapters = client.hgetall(lora_adapters_key(prefix))
    paused = client.get(paused_key(prefix))
    return DeploymentState(
        weights.decode() if weights else None,
        {k.decode(): v.decode() for k, v in adapters.items()},
        paused.decode() if paused else None,
        _tags(client.get(memory_released_key(prefix))),
    )


async def record_weights(client: aioredis.Redis, prefix: str, path: str) -> None:
    await client.set(weights_key(prefix), path)


async def record_lora(client: aioredis.Redis, prefix: str, name: str, path: str | None) -> None:
    """`name` loaded from `path`, or unloaded (None)."""
    await client.hset(lora_adapters_key(prefix), name, path or "")


async def record_pause(client: aioredis.Redis, prefix: str, mode: str | None) -> None:
    """Generation paused in `mode`, or resumed (None)."""
    if mode is None:
        await client.delete(paused_key(prefix))
    else:
        await client.set(paused_key(prefix), mode)


async def record_weight_version(client: aioredis.Redis, prefix: str, version: str) -> None:
    await client.set(weight_version_key(prefix), version)


async def record_released(client: aioredis.Redis, prefix: str, tags: list[str]) -> None:
    """The memory tags released now (none: every worker has its memory)."""
    if tags:
        await client.set(memory_released_key(prefix), ",".join(sorted(tags)))
    else:
        await client.delete(memory_released_key(prefix))


async def read_released(client: aioredis.Redis, prefix: str) -> tuple[str, ...]:
    return _tags(await client.get(memory_released_key(prefix)))


async def read_version_pause_released(
    client: aioredis.Redis, prefix: str
) -> tuple[str, str | None, tuple[str, ...]]:
    """The weight version, the pause's mode (None: generating) and the memory tags released,
    in one round trip."""
    version, paused, released = await client.mget(
        weight_version_key(prefix), paused_key(prefix), memory_released_key(prefix)
    )
    return (version.decode() if version else DEFAULT_WEIGHT_VERSION,
            paused.decode() if paused else None, _tags(released))  # fmt: skip


def _tags(raw: bytes | None) -> tuple[str, ...]:
    return tuple(raw.decode().split(",")) if raw else ()

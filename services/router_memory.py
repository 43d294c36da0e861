"""Device memory given back while idle, as SGLang and vLLM serve it to reinforcement-learning
loops (the trainer uses the GPU between rollouts): SGLang's `POST /release_memory_occupation`
and `POST /resume_memory_occupation` (body `{"tags": [...]}`, of "weights", "kv_cache" and
"cuda_graph"; none: all), vLLM's `POST /sleep?level=1|2` (1: the weights copied to host
memory, 2: discarded; the K/V discarded either way), `POST /wake_up` (query `tags`, repeated;
none: all) and `GET /is_sleeping`.

Every live worker releases (services/worker_memory.py; what and how:
engine/memory_occupation.py). Weights discarded (level 2, or SGLang's call without the
workers' `--enable-weights-cpu-backup`) are read from the checkpoint served again before the
next forward, unless `/update_weights_from_disk` fills them first (the RL loop's order: the
update takes the released weights back). Releasing "kv_cache" empties the prefix caches. A
release is refused (400, with each worker's reason) while any request holds K/V: pause
generation in mode abort or retract first (services/router_pause.py), or let them end.
While weights or K/V are released, new requests are taken and wait (the time does not count
against their timeout); `/health_generate` answers `{"status": "sleeping"}` without
generating.

The tags released are recorded in Redis (shared/deployment.py) once every worker has released
them, and a resume removes them before it asks the workers: a worker starting meanwhile
releases the same, and every router's `/is_sleeping` agrees. A worker that refuses makes a
400 (the others that released are named: a second call, once it can, completes it); one that
does not answer in time a 503.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request

from services.router_control import ask_all_workers
from services.router_fields import _Strict
from services.router_protocol import ApiError, parse_body
from shared.deployment import read_released, record_released
from shared.messages import MemoryReqMsg
from shared.messages.worker import MEMORY_TAGS

ANSWER_TIMEOUT_S = 120.0  # a release copies the weights to host memory, a resume back


class MemoryBody(_Strict):
    tags: list[str] | None = None


def check_tags(tags: list[str] | None, field: str) -> list[str]:
    """`tags` in MEMORY_TAGS order (None: all); ApiError 400 for an unknown or empty list."""
    if tags is None:
        return list(MEMORY_TAGS)
    if not tags:
        raise ApiError(400, f"{field}: empty (leave it out for all)", field, "invalid_value")
    for tag in tags:
        if tag not in MEMORY_TAGS:
            raise ApiError(400, f"{field}: unknown tag {tag!r} (use {', '.join(MEMORY_TAGS)})",
                           field, "invalid_value")  # fmt: skip
    return [t for t in MEMORY_TAGS if t in tags]


async def release(router: Any, tags: list[str], backup_weights: bool | None) -> dict[str, Any]:
    """Release `tags` on every live worker; what they gave back. ApiError if one refused or
    did not answer."""
    broker = router.broker

    def question(request_id: str) -> MemoryReqMsg:
        return MemoryReqMsg(request_id, broker.router_id, "release", tags, backup_weights)

    answers = await _tell(router, question, "memory not released")
    released = set(tags).union(*(a.released for a in answers.values()))
    await record_released(broker.bus.redis, broker.bus.prefix, sorted(released))
    broker.set_deployment(released=tuple(sorted(released)))
    if "kv_cache" in tags:
        broker.workers.policy.forget_all()  # (their prefix caches were emptied)
    return _summary(answers, broker.released)


async def resume(router: Any, tags: list[str]) -> dict[str, Any]:
    broker = router.broker
    left = [t for t in await read_released(broker.bus.redis, broker.bus.prefix) if t not in tags]
    await record_released(broker.bus.redis, broker.bus.prefix, left)
    broker.set_deployment(released=tuple(sorted(left)))

    def question(request_id: str) -> MemoryReqMsg:
        return MemoryReqMsg(request_id, broker.router_id, "resume", tags)

    return _summary(await _tell(router, question, "memory not resumed"), broker.released)


async def released_tags(router: Any) -> tuple[str, ...]:
    """The memory tags released now (read now)."""
    await router.broker.read_deployment()
    return router.broker.released


async def _tell(router: Any, question: Any, failure: str) -> dict[str, Any]:
    return await ask_all_workers(router.broker, question, ANSWER_TIMEOUT_S, failure,
                                 failure.replace(" ", "_"), none_live_ok=True)  # fmt: skip


def _summary(answers: dict[str, Any], released: tuple[str, ...]) -> dict[str, Any]:
    return {"released": list(released),
            "num_bytes": {w: a.num_bytes for w, a in answers.items()}}  # fmt: skip


def _sleep_level(request: Request) -> int:
    raw = request.query_params.get("level", "1")
    if raw.strip() not in ("1", "2"):
        raise ApiError(400, f"level: {raw!r} (use 1: the weights kept in host memory, or 2: "
                            "discarded)", "level", "invalid_value")  # fmt: skip
    return int(raw)


def add_routes(app: Any, state: dict[str, Any]) -> None:
    @app.post("/release_memory_occupation")
    async def release_memory_occupation(request: Request) -> dict[str, Any]:
        router = state["router"]
        router.authorize(request)
        body = parse_body(MemoryBody, (await request.body()).strip() or b"{}")
        done = await release(router, check_tags(body.tags, "tags"), None)
        return {"success": True, "message": "Memory released.", **done}

    @app.post("/resume_memory_occupation")
    async def resume_memory_occupation(request: Request) -> dict[str, Any]:
        router = state["router"]
        router.authorize(request)
        body = parse_body(MemoryBody, (await request.body()).strip() or b"{}")
        done = await resume(router, check_tags(body.tags, "tags"))
        return {"success": True, "message": "Memory resumed.", **done}

    @app.post("/sleep")
    async def sleep(request: Request) -> dict[str, Any]:
        router = state["router"]
        router.authorize(request)
        level = _sleep_level(request)
        done = await release(router, ["weights", "kv_cache"], backup_weights=level == 1)
        return {"status": "sleeping", "level": level, **done}

    @app.post("/wake_up")
    async def wake_up(request: Request) -> dict[str, Any]:
        router = state["router"]
        router.authorize(request)
        tags = request.query_params.getlist("tags") or None
        done = await resume(router, check_tags(tags, "tags"))
        return {"status": "sleeping" if done["released"] else "awake", **done}

    @app.get("/is_sleeping")
    async def is_sleeping(request: Request) -> dict[str, bool]:
        router = state["router"]
        router.authorize(request)
        return {"is_sleeping": bool(await released_tags(router))}

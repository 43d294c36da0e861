"""Which model a request asks for: the base model, or one of the workers' LoRA adapters.

A request's `model` names the base model (the served name, the model's path or its folder
name) or an adapter: by its name (vLLM) or as `base:adapter` (SGLang); SGLang's `lora_path`
names one too (per prompt on `/generate`). What no live worker serves is a 404 (`model`) or a 400
(`lora_path`). The router's worker table may be a moment old (a worker just started), so it
reads the heartbeats again before refusing.
"""

from __future__ import annotations

from typing import Any

from services.router_protocol import ApiError, SubRequest
from services.router_workers import WorkerTable


def check_model(workers: WorkerTable, name: str, served_name: str) -> str | None:
    """The LoRA adapter `name` asks for (None: the base model); 404 if neither."""
    try:
        return workers.resolve_model(name, served_name)
    except KeyError:
        msg = f"the model {name!r} does not exist"
        raise ApiError(404, msg, "model", "model_not_found") from None


async def resolve_model(broker: Any, name: str, served_name: str) -> str | None:
    """`check_model`, reading the workers' heartbeats again before a 404."""
    try:
        return check_model(broker.workers, name, served_name)
    except ApiError:
        await broker.refresh_workers()
        return check_model(broker.workers, name, served_name)


async def request_adapter(broker: Any, body: Any, served_name: str) -> str | None:
    """The adapter of an OpenAI request: its `model`'s, or SGLang's `lora_path` where
    `model` names the base model (400 where the two name different adapters)."""
    lora = await resolve_model(broker, body.model, served_name)
    wanted = getattr(body, "lora_path", None)
    if not wanted:
        return lora
    if lora not in (None, wanted):
        msg = f"lora_path {wanted!r} and model {body.model!r} disagree"
        raise ApiError(400, msg, "lora_path", "invalid_value")
    return wanted


async def check_adapters(broker: Any, subs: list[SubRequest]) -> None:
    """400 for a sub-request naming an adapter that no live worker serves."""
    wanted = {sub.lora_name for sub in subs if sub.lora_name is not None}
    if not wanted <= broker.workers.lora_adapters():
        await broker.refresh_workers()
    served = broker.workers.lora_adapters()
    missing = sorted(wanted - served)
    if missing:
        msg = f"no LoRA adapter {missing[0]!r} is served (served: {sorted(served)})"
        raise ApiError(400, msg, "lora_path", "invalid_value")

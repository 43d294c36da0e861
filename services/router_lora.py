"""LoRA adapters loaded into and unloaded from the running workers, with vLLM's and SGLang's
requests and answers:

    POST /v1/load_lora_adapter     {"lora_name", "lora_path", "load_inplace"}   vLLM
    POST /v1/unload_lora_adapter   {"lora_name"}                                (plain text)
    POST /load_lora_adapter        {"lora_name", "lora_path"}                   SGLang
    POST /unload_lora_adapter      {"lora_name"}                                (JSON)

The router asks every live worker (a `LoraReqMsg`; services/worker.py) and waits for each
one's answer. Workers started without LoRA (no `--enable-lora` or `--lora-paths`) say so and
are left out; if none serves LoRA, the call is a 400. `lora_path` is a folder on the workers'
machines. A worker that refuses (no such folder, not a LoRA it can serve, a rank above its
`--max-lora-rank`, a name already loaded without `load_inplace`) makes it a 400 with its
reason (404 for unloading a name that is not loaded, as vLLM); one that does not answer in
time, a 503. Each worker's heartbeat lists its adapters before it answers, so a request
naming the adapter right after a successful load is routed to it. An adapter unloaded while
its requests run lets them finish. A worker that starts later (or restarts) loads the
adapters loaded at run time and leaves out those unloaded (shared/deployment.py).
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse

from services.router_control import Outcome
from services.router_fields import _Strict
from services.router_protocol import ApiError, parse_body
from shared.deployment import record_lora
from shared.messages import LoraReqMsg, LoraRespMsg

LORA_TIMEOUT_S = 120.0  # a worker reads the adapter's weights between two steps


class LoadLoraBody(_Strict):
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # vLLM's: replace a loaded adapter of the same name
    pinned: bool = False  # SGLang's: never evicted from the device slots (not supported)


class UnloadLoraBody(_Strict):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's, unused (adapters are known by name)


async def update_adapters(
    router: Any, action: str, name: str, path: str = "", replace: bool = False
) -> dict[str, str]:
    """Load or unload `name` on every live worker that serves LoRA; the adapters served
    after it (name -> folder, of the workers that took part). ApiError if it failed."""
    if not name.strip():
        raise ApiError(400, "lora_name must not be empty", "lora_name", "invalid_value")
    if action == "load" and name in router.broker.workers.model_names() | {router.model_name}:
        msg = f"lora_name {name!r} is the base model's name"
        raise ApiError(400, msg, "lora_name", "invalid_value")
    broker = router.broker
    await broker.refresh_workers()

    def question(request_id: str) -> LoraReqMsg:
        return LoraReqMsg(request_id, broker.router_id, action, name, path, replace)

    replies: dict[str, LoraRespMsg | None] = await broker.to_workers.ask(question, LORA_TIMEOUT_S)
    await broker.refresh_workers()  # (each answering worker's heartbeat already lists them)
    # the workers that serve LoRA, and those that did not say
    outcome = Outcome({w: r for w, r in replies.items() if r is None or r.lora_enabled})
    if not outcome.answers and not outcome.silent:
        raise ApiError(400, "no live worker serves LoRA adapters (start workers with "
                            "--enable-lora or --lora-paths)", None, "lora_disabled")  # fmt: skip
    if outcome.refused:
        reasons = outcome.refused.values()
        missing = action == "unload" and all("is not loaded" in m for m in reasons)
        code = "lora_not_found" if missing else "lora_refused"
        msg = f"LoRA adapter {name!r} not {action}ed: {outcome.detail()}"
        raise ApiError(404 if missing else 400, msg, "lora_name", code)
    if outcome.silent:
        raise outcome.no_answer(f"LoRA adapter {name!r}", LORA_TIMEOUT_S)
    adapters: dict[str, str] = {}
    for r in outcome.answers.values():
        adapters.update(r.adapters)
    # for workers that start later (shared/deployment.py)
    await record_lora(broker.bus.redis, broker.bus.prefix, name, adapters.get(name))
    return adapters


def add_routes(app: Any, state: dict[str, Any]) -> None:
    async def load(request: Request) -> tuple[str, dict[str, str]]:
        router = state["router"]
        router.authorize(request)
        body = parse_body(LoadLoraBody, await request.body())
        if body.pinned:
            raise ApiError(400, "pinned adapters are not supported", "pinned",
                           "unsupported_parameter")  # fmt: skip
        name = body.lora_name
        return name, await update_adapters(router, "load", name, body.lora_path, body.load_inplace)

    async def unload(request: Request) -> tuple[str, dict[str, str]]:
        router = state["router"]
        router.authorize(request)
        name = parse_body(UnloadLoraBody, await request.body()).lora_name
        return name, await update_adapters(router, "unload", name)

    @app.post("/v1/load_lora_adapter")
    async def vllm_load(request: Request) -> PlainTextResponse:
        name, _ = await load(request)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def vllm_unload(request: Request) -> PlainTextResponse:
        name, _ = await unload(request)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    @app.post("/load_lora_adapter")
    async def sglang_load(request: Request) -> JSONResponse:
        return await _sglang(load(request))

    @app.post("/unload_lora_adapter")
    async def sglang_unload(request: Request) -> JSONResponse:
        return await _sglang(unload(request))


async def _sglang(call: Any) -> JSONResponse:
    """SGLang's answer: {"success", "error_message", "loaded_adapters"}, 4xx/503 on failure."""
    try:
        _, adapters = await call
    except ApiError as exc:
        if exc.status in (401, 403):
            raise
        return JSONResponse({"success": False, "error_message": exc.message,
                             "loaded_adapters": None}, status_code=exc.status)  # fmt: skip
    return JSONResponse({"success": True, "error_message": "", "loaded_adapters": adapters})

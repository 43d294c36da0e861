"""Pausing generation, as SGLang and vLLM serve it to reinforcement-learning loops (pause,
update the weights, resume): SGLang's `POST /pause_generation` (body `{"mode": ...}`, default
"abort") and `POST /continue_generation`; vLLM's `POST /pause` (query `mode`, default "abort";
`wait_for_inflight_requests=true`, its older spelling of mode "wait"; `clear_cache`, default
true), `POST /resume` and `GET /is_paused`.

Every live worker stops stepping (services/worker.py), its requests handled by the mode:

* "abort": every request ends now (finish reason abort, with what it generated);
* "wait": the worker holds new requests back and answers once its running and waiting ones
  have ended (vLLM's; as long as they take, up to `PAUSE_WAIT_TIMEOUT_S`);
* "keep" (vLLM's name; SGLang's "in_place"): the running requests stay as they are, their
  K/V with them, and go on at the resume; a weights update is refused meanwhile (their K/V
  are the current weights');
* "retract" (SGLang's): the running requests go back to the waiting queue, what they
  computed into the prefix cache (a cache hit at the resume, unless a weights update or
  flush emptied it: they are then computed again, on the new weights).

While paused, new requests are taken (a bad one still gets its 400) and wait in the workers'
queues until the resume (the time paused does not count against the router's request
timeout: each router stops the clocks from its next worker refresh); aborts, `/flush_cache`
and `/update_weights_from_disk` act at once. `clear_cache` empties the prefix cache once no
request holds K/V (not in mode keep). The pause is recorded in Redis (shared/deployment.py)
before the workers are told, so that a worker starting meanwhile starts paused and every
router's `/is_paused` agrees; a resume deletes the record first. `/health_generate` answers
`{"status": "paused"}` without generating while it is there.

Answers: SGLang's `{"message": ..., "status": "ok"}`, vLLM's `{"status": "paused"}`,
`{"status": "resumed"}` and `{"is_paused": ...}`; an unknown mode is a 400, a worker that
refuses (a second pause in mode wait while one waits) a 400 with its reason, one that does
not answer in time a 503 (the pause stays recorded: a resume undoes it).
"""

from __future__ import annotations

from typing import Any

from fastapi import Request

from services.router_control import ask_all_workers
from services.router_fields import _Strict
from services.router_protocol import ApiError, parse_body
from shared.deployment import record_pause
from shared.messages import PauseReqMsg

# each name a client may give -> the worker's mode (shared/messages/worker.py PAUSE_MODES)
MODES = {"abort": "abort", "wait": "wait", "keep": "keep", "in_place": "keep",
         "retract": "retract"}  # fmt: skip
PAUSE_WAIT_TIMEOUT_S = 600.0  # mode wait: a worker answers once its requests have ended
ANSWER_TIMEOUT_S = 30.0  # the other modes and a resume: at once (a batch brought to rest)


class PauseBody(_Strict):
    mode: str = "abort"


class ContinueBody(_Strict):
    torch_empty_cache: bool = True  # SGLang's (its CUDA caching allocator's); nothing here


def pause_mode(name: str) -> str:
    mode = MODES.get(name)
    if mode is None:
        raise ApiError(400, f"unknown pause mode {name!r} (use abort, wait, keep or in_place, "
                            "or retract)", "mode", "invalid_value")  # fmt: skip
    return mode


async def pause(router: Any, mode: str, clear_cache: bool) -> None:
    """Pause every live worker in `mode` (one of PAUSE_MODES). ApiError if one refused or did
    not answer."""
    broker = router.broker
    await record_pause(broker.bus.redis, broker.bus.prefix, mode)
    # (its requests' deadlines stop now; other routers' at their refresh)
    broker.set_deployment(paused=mode)

    def question(request_id: str) -> PauseReqMsg:
        return PauseReqMsg(request_id, broker.router_id, "pause", mode, clear_cache)

    timeout_s = PAUSE_WAIT_TIMEOUT_S if mode == "wait" else ANSWER_TIMEOUT_S
    await _tell(router, question, timeout_s, "paused")
    if clear_cache and mode != "keep":
        broker.workers.policy.forget_all()  # (their prefix caches were emptied)


async def resume(router: Any) -> None:
    broker = router.broker
    await record_pause(broker.bus.redis, broker.bus.prefix, None)
    broker.set_deployment(paused=None)

    def question(request_id: str) -> PauseReqMsg:
        return PauseReqMsg(request_id, broker.router_id, "resume")

    await _tell(router, question, ANSWER_TIMEOUT_S, "resumed")


async def paused_mode(router: Any) -> str | None:
    """The mode of the pause in force (None: generating), read now."""
    await router.broker.read_deployment()
    return router.broker.paused


async def _tell(router: Any, question: Any, timeout_s: float, what: str) -> None:
    await ask_all_workers(router.broker, question, timeout_s, f"generation not {what}",
                          f"not_{what}", none_live_ok=True)  # fmt: skip


def _query_flag(request: Request, name: str, default: bool) -> bool:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    value = {"true": True, "1": True, "false": False, "0": False}.get(raw.strip().lower())
    if value is None:
        raise ApiError(400, f"{name}: {raw!r} is not a boolean", name, "invalid_value")
    return value


def add_routes(app: Any, state: dict[str, Any]) -> None:
    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> dict[str, str]:
        router = state["router"]
        router.authorize(request)
        body = parse_body(PauseBody, (await request.body()).strip() or b"{}")
        await pause(router, pause_mode(body.mode), clear_cache=False)
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation(request: Request) -> dict[str, str]:
        router = state["router"]
        router.authorize(request)
        parse_body(ContinueBody, (await request.body()).strip() or b"{}")
        await resume(router)
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.post("/pause")
    async def pause_vllm(request: Request) -> dict[str, str]:
        router = state["router"]
        router.authorize(request)
        mode = pause_mode(request.query_params.get("mode", "abort"))
        if _query_flag(request, "wait_for_inflight_requests", False):
            mode = "wait"
        await pause(router, mode, _query_flag(request, "clear_cache", True))
        return {"status": "paused"}

    @app.post("/resume")
    async def resume_vllm(request: Request) -> dict[str, str]:
        router = state["router"]
        router.authorize(request)
        await resume(router)
        return {"status": "resumed"}

    @app.get("/is_paused")
    async def is_paused(request: Request) -> dict[str, bool]:
        router = state["router"]
        router.authorize(request)
        return {"is_paused": await paused_mode(router) is not None}

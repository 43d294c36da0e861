"""`POST /update_weights_from_disk`, as SGLang serves it: every live worker replaces its
weights with the checkpoint in `model_path` (a folder on the workers' machines, of the same
model: same architecture, quantization and tensor shapes; engine/weight_update.py).

Each worker holds new requests back, lets its running requests finish (or aborts them first
with `abort_all_requests: true`), updates, empties its prefix cache and takes the held requests
on. The answer is SGLang's: `{"success", "message", "num_paused_requests"}` (the requests held
back, summed over the workers), a 400 with the reasons if a worker refused (a checkpoint of
another model: that worker's weights are unchanged), a 503 if one did not answer in time (its
update may still happen). `/get_model_info`'s `model_path` then names the checkpoint. SGLang's
`load_format` may be left out or "auto"/"safetensors"; `flush_cache: false` is refused (the
old weights' K/V would be reused).

The weight version, as SGLang keeps it for RL loops (which rollouts came from which policy):
a label, "default" until set, by `weight_version` in the update's body or by `POST
/update_weight_version` (`{"new_version", "abort_all_requests"}`; vLLM's call too); read at
`GET /get_weight_version` and `/weight_version` (SGLang's), `/weight_info` (vLLM's),
`/get_model_info`, and in every `/generate` output's `meta_info.weight_version`. It is the
deployment's, kept in Redis (shared/deployment.py): every router reports it (another router
than the one that set it, from its next worker-table refresh, within `--worker-check-s`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from services.router_control import Outcome
from services.router_fields import _Strict
from services.router_protocol import ApiError, parse_body
from shared.deployment import record_weight_version, record_weights
from shared.messages import UpdateWeightsReqMsg, UpdateWeightsRespMsg

# a worker first lets its running requests finish: as long as the longest of them may take
UPDATE_TIMEOUT_S = 600.0


class UpdateWeightsBody(_Strict):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    flush_cache: bool = True
    weight_version: str | None = None  # SGLang's: the label of the new weights


class WeightVersionBody(_Strict):
    new_version: str
    abort_all_requests: bool = False


async def set_weight_version(router: Any, version: str) -> None:
    if not version.strip():
        raise ApiError(400, "the weight version must not be empty", "new_version",
                       "invalid_value")  # fmt: skip
    broker = router.broker
    await record_weight_version(broker.bus.redis, broker.bus.prefix, version)
    broker.set_deployment(weight_version=version)


async def weight_version(router: Any) -> str:
    """The deployment's weight version, read now."""
    await router.broker.read_deployment()
    return router.broker.weight_version


async def update_weights(router: Any, body: UpdateWeightsBody) -> int:
    """Update every live worker; the requests they held back meanwhile. ApiError if any
    refused or did not answer."""
    if not body.model_path.strip():
        raise ApiError(400, "model_path must not be empty", "model_path", "invalid_value")
    if body.weight_version is not None and not body.weight_version.strip():
        raise ApiError(400, "weight_version must not be empty", "weight_version",
                       "invalid_value")  # fmt: skip
    if body.load_format not in (None, "auto", "safetensors"):
        raise ApiError(400, f"load_format {body.load_format!r} is not supported (safetensors "
                            "folders only)", "load_format", "unsupported_parameter")  # fmt: skip
    if not body.flush_cache:
        raise ApiError(400, "flush_cache false is not supported (the prefix cache holds the old "
                            "weights' K/V)", "flush_cache", "unsupported_parameter")  # fmt: skip
    broker = router.broker
    await broker.refresh_workers()

    def question(request_id: str) -> UpdateWeightsReqMsg:
        return UpdateWeightsReqMsg(
            request_id, broker.router_id, body.model_path, body.abort_all_requests
        )

    replies: dict[str, UpdateWeightsRespMsg | None] = await broker.to_workers.ask(
        question, UPDATE_TIMEOUT_S
    )
    await broker.refresh_workers()  # (each updated worker's heartbeat names the checkpoint)
    broker.workers.policy.forget_all()  # (their prefix caches were emptied)
    outcome = Outcome(replies)
    if outcome.refused:
        msg = f"weights not updated: {outcome.detail()}"
        raise ApiError(400, msg, "model_path", "update_refused")
    if outcome.silent:
        raise outcome.no_answer("weights update", UPDATE_TIMEOUT_S)
    if not outcome.answers:
        raise ApiError(503, "no live worker to update", None, "no_worker")
    path = next(iter(outcome.answers.values())).weights_path
    await record_weights(broker.bus.redis, broker.bus.prefix, path)  # (shared/deployment.py)
    if body.weight_version is not None:
        await set_weight_version(router, body.weight_version)
    return sum(r.num_paused_requests for r in outcome.answers.values())


async def weights_answer(
    state: dict[str, Any], request: Request, work: Callable[[Any], Awaitable[dict[str, Any]]]
) -> JSONResponse:
    """SGLang's answer to a weights call: `{"success": true, **work(router)}`, or, for an
    ApiError (other than 401/403), `{"success": false, "message"}` with its status."""
    router = state["router"]
    router.authorize(request)
    try:
        done = await work(router)
    except ApiError as exc:
        if exc.status in (401, 403):
            raise
        return JSONResponse({"success": False, "message": exc.message,
                             "num_paused_requests": 0}, status_code=exc.status)  # fmt: skip
    return JSONResponse({"success": True, **done})


def add_routes(app: Any, state: dict[str, Any]) -> None:
    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> JSONResponse:
        async def work(router: Any) -> dict[str, Any]:
            paused = await update_weights(router, parse_body(UpdateWeightsBody,
                                                             await request.body()))
            return {"message": "Succeeded to update model weights.",
                    "num_paused_requests": paused}  # fmt: skip

        return await weights_answer(state, request, work)

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> dict[str, Any]:
        router = state["router"]
        router.authorize(request)
        body = parse_body(WeightVersionBody, await request.body())
        await set_weight_version(router, body.new_version)
        if body.abort_all_requests:
            await router.broker.named.abort(None, "aborted: the weight version changed")
        return {"success": True, "message": f"Weight version updated to {body.new_version}",
                "new_version": body.new_version}  # fmt: skip

    @app.get("/get_weight_version")
    @app.get("/weight_version")
    @app.get("/weight_info")  # vLLM's
    async def get_weight_version(request: Request) -> dict[str, str]:
        router = state["router"]
        router.authorize(request)
        return {"weight_version": await weight_version(router)}

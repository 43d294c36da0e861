"""Weights an RL trainer broadcasts to the workers through a process group, as SGLang serves
it to trainers on other GPUs or machines (slime, verl, OpenRLHF, AReaL):

* `POST /init_weights_update_group` (`{"master_address", "master_port", "rank_offset",
  "world_size", "group_name": "weight_update_group", "backend": "nccl"}`): every live worker
  joins the trainer's group, worker i (in worker-id order) as rank `rank_offset + i`, so
  `rank_offset + workers <= world_size` (a worker of `--tp-size T` takes T ranks, its rank r
  as the worker's rank + r, and the next worker's come after them: SGLang's layout); the
  trainer (rank 0, serving the rendezvous at
  `master_address:master_port`) joins its side at the same time, and the call answers once
  all have (or `timeout_s`, sluice's field, default 300, has passed). The answer names each
  worker's rank. "nccl" needs the workers on CUDA; "gloo" works anywhere (this CPU's tests).
* `POST /update_weights_from_distributed` (`{"names", "dtypes", "shapes", "group_name",
  "flush_cache": true, "abort_all_requests": false, "weight_version"}`): each worker receives
  the tensors the trainer broadcasts next (`torch.distributed.broadcast(t, src=0,
  group=...)`, in the order of `names`; dtypes as "bfloat16") and loads them, as
  `/update_weights_from_disk` does (`load_format: "flattened_bucket"`, SGLang's: one uint8
  tensor per bucket, the tensors' bytes end to end): new requests are held back and the
  running ones finish
  first (or are aborted), and `{"success", "message", "num_paused_requests"}` comes back. A
  bucket refused (a name the model lacks, a shape that does not fit) is received all the
  same, so the trainer's broadcast ends: the answer is a 400 with each worker's reason.
* `POST /destroy_weights_update_group` (`{"group_name"}`): every worker leaves the group.
* `GET|POST /get_weights_by_name` (`{"name", "truncate_size": 100}`, or query parameters):
  the first `truncate_size` served values of a checkpoint tensor (as the checkpoint has it:
  q_proj's rows of the fused projection), flattened, a JSON list, from the first live worker
  (engine/weight_read.py): how a trainer checks what it sent.

After such an update the deployment's weights are on no disk: it is recorded
(shared/deployment.py), and a worker starting later refuses to start rather than serve
other weights (save them and `/update_weights_from_disk` to scale out again).
`POST /update_weights_from_tensor` over HTTP is refused: SGLang's body is pickled tensors
(CUDA IPC handles), which sluice does not unpickle from the network; `Engine.
update_weights_from_tensor` serves colocated trainers offline.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import Field

from services.router_control import ask_all_workers
from services.router_fields import _Strict
from services.router_protocol import ApiError, parse_body
from services.router_weights import UPDATE_TIMEOUT_S, set_weight_version, weights_answer
from shared.deployment import BROADCAST_WEIGHTS, record_weights
from shared.messages import DistributedWeightsReqMsg, WeightsGroupReqMsg, WeightsReadReqMsg
from shared.messages.worker import WEIGHT_DTYPES

GROUP = "weight_update_group"
BACKENDS = ("nccl", "gloo")
MAX_JOIN_S = 3600.0
MAX_READ = 1 << 20  # values /get_weights_by_name returns at most


class InitGroupBody(_Strict):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = GROUP
    backend: str = "nccl"
    timeout_s: float = 300.0  # sluice's: how long the workers wait for the trainer's side


class DistributedBody(_Strict):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = GROUP
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None


class GroupBody(_Strict):
    group_name: str = GROUP


class ReadBody(_Strict):
    name: str
    truncate_size: int = Field(100, ge=0, le=MAX_READ)


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, param, "invalid_value")


def check_init(body: InitGroupBody) -> None:
    if not body.master_address.strip():
        raise _bad("master_address must not be empty", "master_address")
    if not 0 < body.master_port < 65536:
        raise _bad(f"master_port {body.master_port} is not a TCP port", "master_port")
    if body.backend not in BACKENDS:
        raise _bad(f"backend {body.backend!r}: use one of {', '.join(BACKENDS)}", "backend")
    if body.rank_offset < 1:
        raise _bad(f"rank_offset {body.rank_offset}: rank 0 is the trainer's", "rank_offset")
    if not body.group_name.strip():
        raise _bad("group_name must not be empty", "group_name")
    if not 0 < body.timeout_s <= MAX_JOIN_S:
        raise _bad(f"timeout_s must be in (0, {MAX_JOIN_S:g}]", "timeout_s")


def check_tensors(body: DistributedBody) -> None:
    if not body.names:
        raise _bad("names must not be empty", "names")
    if not len(body.names) == len(body.dtypes) == len(body.shapes):
        raise _bad(f"{len(body.names)} names, {len(body.dtypes)} dtypes and "
                   f"{len(body.shapes)} shapes: one of each per tensor", "shapes")  # fmt: skip
    for dtype in body.dtypes:
        if dtype.removeprefix("torch.") not in WEIGHT_DTYPES:
            raise _bad(f"dtype {dtype!r} is not a weight dtype (use one of "
                       f"{', '.join(WEIGHT_DTYPES)})", "dtypes")  # fmt: skip
    for shape in body.shapes:
        if any(d < 0 for d in shape):
            raise _bad(f"shape {shape} has a negative size", "shapes")
    if body.load_format not in (None, "flattened_bucket"):
        raise ApiError(400, f"load_format {body.load_format!r}: use none (a broadcast per "
                            "tensor) or \"flattened_bucket\" (one per bucket)", "load_format",
                       "unsupported_parameter")  # fmt: skip
    if body.weight_version is not None and not body.weight_version.strip():
        raise _bad("weight_version must not be empty", "weight_version")


async def init_group(router: Any, body: InitGroupBody) -> dict[str, int]:
    """Every live worker into the trainer's group; each one's (first) rank."""
    check_init(body)
    broker = router.broker
    await broker.refresh_workers()
    ids = sorted(broker.workers.live)
    if not ids:
        raise ApiError(503, "no live worker to join the group", None, "no_worker")
    # a worker of T tensor-parallel ranks takes T ranks of the group, from its own on
    sizes = [max(1, broker.workers.live[w].tp_size) for w in ids]
    firsts = [body.rank_offset + sum(sizes[:i]) for i in range(len(ids))]
    ranks = dict(zip(ids, firsts))
    if body.rank_offset + sum(sizes) > body.world_size:
        raise _bad(f"{len(ids)} worker(s) of {sum(sizes)} rank(s) need ranks "
                   f"{body.rank_offset}..{body.rank_offset + sum(sizes) - 1}: world_size "
                   f"{body.world_size} is too small", "world_size")  # fmt: skip

    def question(request_id: str) -> WeightsGroupReqMsg:
        return WeightsGroupReqMsg(
            request_id, broker.router_id, "init", body.group_name, body.master_address,
            body.master_port, ranks, body.world_size, body.backend, body.timeout_s,
        )  # fmt: skip

    await ask_all_workers(broker, question, body.timeout_s + 30, "group not joined",
                          "group_not_joined")  # fmt: skip
    return ranks


async def update_distributed(router: Any, body: DistributedBody) -> int:
    """Every live worker receives and loads the trainer's bucket; the requests they held
    back meanwhile."""
    check_tensors(body)
    broker = router.broker

    def question(request_id: str) -> DistributedWeightsReqMsg:
        return DistributedWeightsReqMsg(
            request_id, broker.router_id, body.names, body.dtypes, body.shapes,
            body.group_name, body.flush_cache, body.abort_all_requests, body.load_format or "",
        )  # fmt: skip

    answers = await ask_all_workers(broker, question, UPDATE_TIMEOUT_S, "weights not updated",
                                    "update_refused")  # fmt: skip
    if body.flush_cache:
        broker.workers.policy.forget_all()  # (their prefix caches were emptied)
    await record_weights(broker.bus.redis, broker.bus.prefix, BROADCAST_WEIGHTS)
    if body.weight_version is not None:
        await set_weight_version(router, body.weight_version)
    return sum(a.num_paused_requests for a in answers.values())


async def destroy_group(router: Any, body: GroupBody) -> None:
    broker = router.broker

    def question(request_id: str) -> WeightsGroupReqMsg:
        return WeightsGroupReqMsg(request_id, broker.router_id, "destroy", body.group_name)

    await ask_all_workers(broker, question, 60.0, "group not destroyed", "group_not_destroyed")


async def read_weight(router: Any, body: ReadBody) -> list[float]:
    """The first live worker's (in worker-id order) served values of weight `body.name`;
    ApiError 400 with its reason if it cannot read it."""
    broker = router.broker

    def question(request_id: str) -> WeightsReadReqMsg:
        return WeightsReadReqMsg(request_id, broker.router_id, body.name, body.truncate_size)

    answers = await ask_all_workers(broker, question, 60.0, "weight not read", "read_refused")
    return next(iter(answers.values())).values


def add_routes(app: Any, state: dict[str, Any]) -> None:
    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request) -> JSONResponse:
        async def work(router: Any) -> dict[str, Any]:
            ranks = await init_group(router, parse_body(InitGroupBody, await request.body()))
            return {"message": "Succeeded to initialize custom process group.", "ranks": ranks}

        return await weights_answer(state, request, work)

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request) -> JSONResponse:
        async def work(router: Any) -> dict[str, Any]:
            paused = await update_distributed(router, parse_body(DistributedBody,
                                                                 await request.body()))
            return {"message": "Succeeded to update parameter online from distributed.",
                    "num_paused_requests": paused}  # fmt: skip

        return await weights_answer(state, request, work)

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request) -> JSONResponse:
        async def work(router: Any) -> dict[str, Any]:
            raw = (await request.body()).strip() or b"{}"
            await destroy_group(router, parse_body(GroupBody, raw))
            return {"message": "Succeeded to destroy custom process group."}

        return await weights_answer(state, request, work)

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(request: Request) -> JSONResponse:
        router = state["router"]
        router.authorize(request)
        raw = (await request.body()).strip()
        if not raw and request.method == "GET":  # (or as query parameters)
            query: dict[str, Any] = dict(request.query_params)
            if query.get("truncate_size", "").isdigit():
                query["truncate_size"] = int(query["truncate_size"])
            raw = json.dumps(query).encode()
        return JSONResponse(await read_weight(router, parse_body(ReadBody, raw)))

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request) -> JSONResponse:
        async def work(router: Any) -> dict[str, Any]:
            raise ApiError(400, "update_weights_from_tensor over HTTP takes pickled tensors "
                                "(SGLang's serialized_named_tensors), which sluice does not "
                                "unpickle from the network: use /update_weights_from_"
                                "distributed, /update_weights_from_disk, or Engine."
                                "update_weights_from_tensor in the trainer's process",
                           "serialized_named_tensors", "unsupported_parameter")  # fmt: skip

        return await weights_answer(state, request, work)

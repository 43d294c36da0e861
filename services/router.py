"""The router service: sluice's HTTP API (FastAPI + uvicorn) in front of the Redis streams.

Parse config → connect (an `AsyncBus`, a `Broker` with its reader and worker-table tasks, a
heartbeat) → serve HTTP until stopped. Each generation request is validated
(`router_protocol`), split into sub-requests sent to the live worker the routing policy picks
(`router_requests`), reassembled in token order with stop strings trimmed
(`router_stream`) and answered in the API's shape, whole or as SSE (`router_responses`).

    sluice router --redis-url redis://127.0.0.1:6379/0 --port 30000 [--api-key KEY]
                  [--incremental-streaming-output]
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from services import router_tokens as tokens
from services.batch_files import add_routes as add_file_routes
from services.batches import add_routes as add_batch_routes
from services.responses_store import add_routes as add_response_routes
from services.router_api import VERSION, Router
from services.router_embeddings import add_routes as add_embedding_routes
from services.router_lora import add_routes as add_lora_routes
from services.router_memory import add_routes as add_memory_routes
from services.router_metrics import CONTENT_TYPE
from services.router_named import AbortBody
from services.router_pause import add_routes as add_pause_routes
from services.router_profile import add_routes as add_profile_routes
from services.router_protocol import ApiError, parse_body
from services.router_tokens import DetokenizeBody, TokenizeBody
from services.router_weight_sync import add_routes as add_weight_sync_routes
from services.router_weights import add_routes as add_weights_routes
from services.router_weights import weight_version
from shared.async_bus import AsyncBus
from shared.heartbeat import Heartbeat, list_live_async
from shared.keys import DETOKENIZER_KIND, ROUTER_KIND, TOKENIZER_KIND, WORKER_KIND, heartbeat_key
from shared.logging import setup_logging
from shared.redis_clients import connect, connect_async
from shared.settings import (
    RouterSettings,
    add_settings_args,
    default_service_id,
    setting,
    settings_from_args,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouterConfig:
    router: RouterSettings = field(default_factory=RouterSettings)
    api_key: str | None = setting(
        None,
        "require 'Authorization: Bearer KEY' on the generation and model APIs",
        env="SLUICE_API_KEY",
    )
    worker_check_s: float = setting(
        0.5,
        "how often to re-read worker heartbeats and check requests waiting on a worker",
        env="SLUICE_ROUTER_WORKER_CHECK_S",
    )
    batch_lease_s: float = setting(
        10.0,
        "a router that stops renewing its lease on a batch this long (it died) leaves the "
        "batch to another router",
        env="SLUICE_BATCH_LEASE_S",
    )
    health_generate_timeout_s: float = setting(
        20.0,
        "/health_generate answers 503 if its one-token request takes longer",
        env="SLUICE_HEALTH_GENERATE_TIMEOUT_S",
    )

    @property
    def router_id(self) -> str:
        return self.router.router_id or default_service_id()

    def model_name(self, worker_models: set[str]) -> str:
        r = self.router
        if r.served_model_name:
            return r.served_model_name
        if r.model:
            return os.path.basename(r.model.rstrip("/"))
        short = sorted(m for m in worker_models if "/" not in m)
        return short[0] if short else "default"


def create_app(config: RouterConfig) -> FastAPI:
    url = config.router.common.require_redis_url()
    state: dict[str, Router] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        common = config.router.common
        # Requests beyond the pool wait for a connection instead of failing.
        bus = AsyncBus(connect_async(url, 64), common.prefix, maxlen=common.stream_maxlen)
        router = state["router"] = Router(config, bus)
        await router.broker.start()
        router.start_batches(app)
        key = heartbeat_key(common.prefix, ROUTER_KIND, config.router_id)
        beat = Heartbeat(connect(url), key, common.heartbeat_ttl_s, router.status)
        beat.start()
        logger.info(
            "router %s ready; workers: %s", config.router_id, sorted(router.broker.workers.live)
        )
        try:
            yield
        finally:
            await router.batches.stop()
            await router.background.stop()
            await router.broker.stop()
            beat.stop()
            await bus.aclose()

    app = FastAPI(title="sluice", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _bad_query(request: Request, exc: RequestValidationError) -> JSONResponse:
        """A query parameter of the wrong type (`?limit=abc`): a 400 in the API's error shape,
        not FastAPI's 422."""
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"][1:]) or None
        api = ApiError(400, f"{param or 'request'}: {err['msg']}", param, "invalid_value")
        return JSONResponse(api.body(), status_code=400)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        return await state["router"].generate(request, "generate")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await state["router"].generate(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await state["router"].generate(request, "chat")

    add_response_routes(app, state)  # POST /v1/responses, and its stored responses
    add_profile_routes(app, state)  # POST /start_profile, /stop_profile
    add_embedding_routes(app, state)  # POST /v1/embeddings
    add_lora_routes(app, state)  # POST /v1/load_lora_adapter, /load_lora_adapter, unloads
    add_weights_routes(app, state)  # POST /update_weights_from_disk
    add_weight_sync_routes(app, state)  # POST /init_weights_update_group, ..._from_distributed
    add_pause_routes(app, state)  # POST /pause_generation, /continue_generation, /pause, ...
    add_file_routes(app, state)  # POST /v1/files, GET /v1/files/{id}/content, ...
    add_batch_routes(app, state)  # POST /v1/batches, GET /v1/batches/{id}, .../cancel
    add_memory_routes(app, state)  # POST /release_memory_occupation, /sleep, /wake_up, ...

    def model_card(router: Router, name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": int(router.started_at),
            "owned_by": "sluice",
            "max_model_len": router.broker.workers.context_len,
        }

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        router = state["router"]
        router.authorize(request)
        await router.broker.refresh_workers()
        base = router.model_name
        adapters = [  # as vLLM lists them: the adapter's name, its base model as parent
            model_card(router, name) | {"root": name, "parent": base}
            for name in sorted(router.broker.workers.lora_adapters())
        ]
        return {"object": "list", "data": [model_card(router, base), *adapters]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str, request: Request) -> dict[str, Any]:
        """OpenAI's model retrieval (404 for a model not served)."""
        router = state["router"]
        router.authorize(request)
        await router.resolve_model(name)
        return model_card(router, name)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": VERSION}

    @app.post("/flush_cache")
    @app.post("/reset_prefix_cache")  # vLLM's name
    async def flush_cache(request: Request) -> Response:
        """SGLang's: empty every worker's prefix cache; 400 if one was busy (or silent)."""
        router = state["router"]
        router.authorize(request)
        await router.broker.refresh_workers()
        replies = await router.broker.to_workers.flush()
        router.broker.workers.policy.forget_all()
        failed = {
            w: r.message if r else "no answer"
            for w, r in replies.items()
            if r is None or not r.success
        }
        if failed:
            detail = "; ".join(f"{w}: {m}" for w, m in sorted(failed.items()))
            raise ApiError(400, f"cache not flushed ({detail})", None, "cache_not_flushed")
        return JSONResponse(
            {"success": True, "message": "Cache flushed.", "workers": sorted(replies)}
        )

    @app.post("/abort_request")
    async def abort_request(request: Request) -> dict[str, Any]:
        """SGLang's: end the requests in flight with the client's `rid` (or all of them:
        `abort_all`), on whichever router holds them; their responses finish with
        finish_reason abort. 404 if none has the rid."""
        router = state["router"]
        router.authorize(request)
        body = parse_body(AbortBody, await request.body())
        if not body.abort_all and body.rid is None:
            raise ApiError(400, "pass rid, or abort_all: true", "rid", "missing_required_parameter")
        rid = None if body.abort_all else body.rid
        num_aborted = await router.broker.named.abort(rid, "aborted by /abort_request")
        if rid is not None and not num_aborted:
            raise ApiError(404, f"no request in flight has rid {rid!r}", "rid", "not_found")
        return {"success": True, "num_aborted": num_aborted}

    @app.post("/tokenize")
    @app.post("/v1/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        """vLLM's and SGLang's: the ids of a prompt (or of prompts) or of chat messages
        (services/router_tokens.py)."""
        router = state["router"]
        body = router.query_body(request, TokenizeBody, await request.body())
        if router.broker.workers.context_len is None:  # no heartbeat read yet
            await router.broker.refresh_workers()
        return await tokens.tokenize(router.broker.queries, body, router.broker.workers.context_len)

    @app.post("/detokenize")
    @app.post("/v1/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        """vLLM's and SGLang's: the text of token ids (or of lists of them)."""
        router = state["router"]
        body = router.query_body(request, DetokenizeBody, await request.body())
        return await tokens.detokenize(router.broker.queries, body)

    @app.get("/get_server_info")
    @app.get("/server_info")  # (SGLang's newer name)
    async def get_server_info(request: Request) -> dict[str, Any]:
        router = state["router"]
        router.authorize(request)
        return await router.server_info()

    @app.get("/get_load")
    async def get_load(request: Request) -> list[dict[str, Any]]:
        """SGLang's (what load-balancing routers in front of it poll): one entry per live
        worker, as SGLang gives one per data-parallel rank: its running and waiting
        requests and the KV tokens its running requests hold, from its last heartbeat."""
        router = state["router"]
        router.authorize(request)
        await router.broker.refresh_workers()
        loads = sorted(router.broker.workers.live.values(), key=lambda w: w.worker_id)
        return [{"dp_rank": rank, "worker_id": w.worker_id,
                 "num_reqs": w.num_running_reqs + w.num_waiting_reqs,
                 "num_waiting_reqs": w.num_waiting_reqs, "num_tokens": w.num_used_tokens}
                for rank, w in enumerate(loads)]  # fmt: skip

    @app.get("/load")
    async def load(request: Request) -> dict[str, int]:
        """vLLM's: the requests this router has in flight (`server_load`; one per prompt and
        choice, as it sends them to workers)."""
        router = state["router"]
        router.authorize(request)
        return {"server_load": len(router.broker.handles)}

    @app.get("/get_model_info")
    @app.get("/model_info")  # (SGLang's newer name)
    async def get_model_info(request: Request) -> dict[str, Any]:
        """SGLang's model card: the served name, the model folder (when known), generation."""
        router = state["router"]
        router.authorize(request)
        if router.broker.workers.context_len is None:  # no heartbeat read yet
            await router.broker.refresh_workers()
        r = router.config.router
        updated = {hb.weights_path for hb in router.broker.workers.live.values()}
        return {
            # the checkpoint of the weights, where every worker's has been updated to one
            "model_path": updated.pop() if len(updated) == 1 and "" not in updated
            else r.model or router.model_name,
            "tokenizer_path": r.model,
            "is_generation": not router.broker.workers.embedding_only,
            "served_model_name": router.model_name,
            "max_context_length": router.broker.workers.context_len,
            "weight_version": await weight_version(router),
        }

    @app.get("/health")
    @app.get("/ping")  # vLLM's (SageMaker's) name, both methods
    @app.post("/ping")
    async def health() -> Response:
        """Whether a request can be served: a live worker, tokenizer and detokenizer (by
        their heartbeats); 503 naming the kinds that have none."""
        router = state["router"]
        live = {
            kind + "s": sorted(await list_live_async(router.bus.redis, router.bus.prefix, kind))
            for kind in (WORKER_KIND, TOKENIZER_KIND, DETOKENIZER_KIND)
        }
        missing = [kind for kind, ids in live.items() if not ids]
        status = "ok" if not missing else "no live " + ", ".join(k[:-1] for k in missing)
        return JSONResponse({"status": status, **live}, status_code=503 if missing else 200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        """SGLang's: one token generated through the whole pipeline; 503 if it fails or takes
        longer than the router's `health_generate_timeout_s`."""
        return await state["router"].health_generate()

    @app.get("/metrics")
    async def metrics() -> Response:
        router = state["router"]
        router.metrics.model_name = router.model_name
        workers = router.broker.workers
        text = router.metrics.render(workers.live, workers.routed)
        return PlainTextResponse(text, media_type=CONTENT_TYPE)

    return app


def run(config: RouterConfig) -> None:
    r = config.router
    logging.getLogger().handlers.clear()  # this process logs through setup_logging only
    setup_logging("router", config.router_id, r.common.log_level)
    uvicorn.run(
        create_app(config),
        host=r.host,
        port=r.port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=5,
    )


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("router", help="the HTTP router service")
    add_settings_args(p, RouterConfig)
    p.set_defaults(func=lambda ns: run(settings_from_args(RouterConfig, ns)))


def main(argv: list[str] | None = None) -> None:
    """`python -m services.router ...`: the service without the CLI's engine imports."""
    parser = argparse.ArgumentParser(prog="sluice router", description=__doc__)
    add_settings_args(parser, RouterConfig)
    run(settings_from_args(RouterConfig, parser.parse_args(argv)))


if __name__ == "__main__":
    main()

"""The router's request handling: authorization, validation, submission, the response.

`Router` holds what the HTTP handlers share (the broker, metrics, names, settings); its
`generate()` serves the three generation APIs. A non-streamed request is cancelled, and a
streamed one closed, when the client disconnects, which aborts its requests at the worker.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import os
import time
import uuid
from collections.abc import AsyncIterator
from functools import partial
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from services.batch_files import FileStore
from services.batch_lines import call_app
from services.batch_run import BatchRunner
from services.responses_api import ResponsesRequest
from services.responses_background import BackgroundResponses
from services.responses_store import ResponseStore, input_items
from services.responses_stream import ResponseShaper
from services.router_chat import ParserChoice
from services.router_fields import MAX_REQUEST_ID_LEN
from services.router_generate import GenerateRequest
from services.router_logprobs import TokenNames
from services.router_metrics import RouterMetrics
from services.router_models import check_adapters, check_model, request_adapter, resolve_model
from services.router_policy import make_policy
from services.router_protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    check_max_tokens,
    parse_body,
)
from services.router_requests import Broker
from services.router_responses import Formatter
from shared.async_bus import AsyncBus
from shared.keys import ROUTER_KIND
from shared.messages import ServiceStatusMsg

if TYPE_CHECKING:
    from services.router import RouterConfig

# kind → (request model, the name its max-token field has in errors)
_APIS = {
    "generate": (GenerateRequest, "sampling_params.max_new_tokens"),
    "completion": (CompletionRequest, "max_tokens"),
    "chat": (ChatCompletionRequest, "max_tokens"),
}


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sluice")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


VERSION = _package_version()
_HEALTH_REQUEST = GenerateRequest(text="ok", sampling_params={"max_new_tokens": 1})


class Router:
    """What the HTTP handlers share: the broker, the metrics, names and settings."""

    def __init__(self, config: RouterConfig, bus: AsyncBus) -> None:
        self.config, self.bus = config, bus
        self.metrics = RouterMetrics()
        r = config.router
        self.broker = Broker(
            bus,
            config.router_id,
            self.metrics,
            request_timeout_s=r.request_timeout_s,
            check_s=config.worker_check_s,
            policy=make_policy(r),
        )
        self.token_names = TokenNames()
        self.token_names.load([r.model] if r.model else [])
        self.tool_parser = ParserChoice(r.tool_call_parser)
        self.responses_store = ResponseStore(bus.redis, bus.prefix, r.responses_store_ttl_s)
        self.background = BackgroundResponses(self.responses_store, self.broker.router_id)
        self.files = FileStore(bus.redis, bus.prefix, r.files_ttl_s, r.files_max_bytes)
        self.batches = BatchRunner(
            bus.redis, bus.prefix, self.broker.router_id, self.files, r.batch_concurrency,
            r.batch_max_requests, poll_s=min(0.5, config.batch_lease_s / 4),
            lease_s=config.batch_lease_s, keep_s=r.files_ttl_s, priority=r.batch_priority,
        )  # fmt: skip
        self.num_handled = 0
        self.started_at = time.time()

    @property
    def model_name(self) -> str:
        return self.config.model_name(self.broker.workers.model_names())

    def start_batches(self, app: Any) -> None:
        """Run batches (services/batches.py), each line through `app`, the router's own."""
        key = self.config.api_key
        headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
        self.batches.start(lambda path, body: call_app(app, path, body, headers),
                           lambda: bool(self.broker.workers.live))  # fmt: skip

    def authorize(self, request: Request) -> None:
        key = self.config.api_key
        if key and not hmac.compare_digest(
            request.headers.get("authorization", ""), f"Bearer {key}"
        ):
            raise ApiError(401, "invalid or missing API key", None, "invalid_api_key")

    def check_model(self, name: str) -> str | None:
        """The LoRA adapter `name` asks for (None: the base model); 404 if neither."""
        return check_model(self.broker.workers, name, self.model_name)

    async def resolve_model(self, name: str) -> str | None:
        """`check_model` after a fresh look at the workers if the table does not know it."""
        return await resolve_model(self.broker, name, self.model_name)

    def query_body(self, request: Request, model_cls: type, raw: bytes) -> Any:
        """The body of a non-generation request, authorized and its `model` (if any) known."""
        self.authorize(request)
        body = parse_body(model_cls, raw)
        if body.model is not None:
            self.check_model(body.model)
        return body

    async def generate(self, request: Request, kind: str) -> Response:
        self.authorize(request)
        model_cls, max_param = _APIS[kind]
        body = parse_body(model_cls, await request.body())
        headers = None
        if kind != "generate":  # vLLM's request id: the header's, else the body's, else new
            body.request_id = _request_id_header(request) or body.request_id or uuid.uuid4().hex
            headers = {"X-Request-Id": body.request_id}
        fmt = await self._start(kind, body, max_param)
        if body.stream:
            return await _sse_response(request, fmt.chunks(), headers)
        return JSONResponse(await unless_disconnected(request, fmt.response()), headers=headers)

    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API, as the chat request it means (services/responses_api.py)."""
        self.authorize(request)
        body = ResponsesRequest.parse(await request.body())
        await self.resolve_model(body.model)
        store, history = self.responses_store, []
        storing = store.keeps(body.store)
        if body.background and not storing:
            raise self.background.not_stored(body.store)
        if body.previous_response_id is not None:
            history = await store.history(body.previous_response_id)
        rid = body._extras.get("rid")
        if storing and isinstance(rid, str):  # (its response is stored under it)
            await store.check_new_id(rid)
        chat = body.to_chat(history, stream=True if body.background else None)
        fmt = await self._start("chat", chat, "max_output_tokens")
        save = None
        if storing:  # the conversation, as stored; the first save keeps a stored response
            save = partial(store.save, items=[*history, *input_items(body.input)], new=True)
        shaper = ResponseShaper(body, fmt, save)
        if body.background:  # (the client may go: the response is generated anyway)
            queued = await self.background.start(shaper, partial(self.broker.cancel, fmt.handles))
            if body.stream:
                return await _sse_response(request, self.background.follow(shaper.id, -1))
            return JSONResponse(queued)
        if body.stream:
            return await _sse_response(request, shaper.events())
        return JSONResponse(await unless_disconnected(request, shaper.response()))

    async def _start(self, kind: str, body: Any, max_param: str) -> Formatter:
        """Send the request's sub-requests; the formatter of their output."""
        lora = (
            None
            if kind == "generate"
            else await request_adapter(self.broker, body, self.model_name)
        )
        subs = body.to_subrequests()
        if lora is not None:  # (/generate's name theirs per prompt)
            for sub in subs:
                sub.lora_name = lora
        await check_adapters(self.broker, subs)
        check_max_tokens(subs, self.broker.workers.context_len, max_param)
        tool_mode = getattr(body, "tool_mode", None)
        if tool_mode is not None and tool_mode.kind == "auto":
            tool_mode.parser = self.tool_parser.resolve(self._model_dirs())
            for sub in subs:
                if tool_mode.keeps_special_tokens:  # its call marker is a special token
                    sub.sampling_params.setdefault("skip_special_tokens", False)
        if subs[0].return_logprob:
            self.token_names.load(hb.model for hb in self.broker.workers.live.values())
        handles = await self.broker.open(subs)
        try:
            await self.broker.submit(handles)
        except BaseException:  # (an ApiError, or the client gone while it was sent)
            for h in handles:
                h.close()
            raise
        self.num_handled += 1
        prefix = {"chat": "chatcmpl-", "completion": "cmpl-"}.get(kind, "")
        return Formatter(
            kind,
            # SGLang's: the client's rid as the id; vLLM's: its request_id after the prefix
            subs[0].rid or prefix + (getattr(body, "request_id", None) or uuid.uuid4().hex),
            int(time.time()),
            getattr(body, "model", self.model_name),
            self.token_names,
            handles,
            include_usage=getattr(body, "include_usage", False),
            continuous_usage=getattr(body, "continuous_usage", False),
            batch=kind == "generate" and (body.is_batch or len(subs) > 1),
            incremental=self.config.router.incremental_streaming_output,
            tool_mode=tool_mode,
            weight_version=lambda: self.broker.weight_version,
            reasoning_parser=(
                self.config.router.reasoning_parser
                if getattr(body, "separate_reasoning", True) is not False
                else None
            ),
        )

    async def health_generate(self) -> Response:
        """One token generated through the tokenizer, a worker and a detokenizer (SGLang's
        /health_generate; an embedding-only deployment embeds it); out of the metrics. While
        generation is paused (services/router_pause.py), `{"status": "paused"}` at once, and
        `{"status": "sleeping"}` while the memory is released (services/router_memory.py): a
        probe must not fail a server paused on purpose."""
        start = time.perf_counter()
        mode = self.broker.paused  # (as of the last worker refresh: no read of its own)
        if mode is not None:
            return JSONResponse({"status": "paused", "mode": mode})
        if self.broker.asleep:  # (services/router_memory.py)
            return JSONResponse({"status": "sleeping", "released": list(self.broker.released)})
        subs = _HEALTH_REQUEST.to_subrequests()
        if self.broker.workers.embedding_only:
            subs[0].embed, subs[0].sampling_params = True, {"max_new_tokens": 0}
        handles = await self.broker.open(subs)
        for h in handles:
            h.observed = False

        async def one_token() -> None:
            await self.broker.submit(handles)
            async for _ in handles[0].deltas():
                pass

        try:
            await asyncio.wait_for(one_token(), self.config.health_generate_timeout_s)
        except (ApiError, asyncio.TimeoutError) as exc:
            for h in handles:
                h.close()
            message = exc.message if isinstance(exc, ApiError) else "timed out"
            return JSONResponse({"status": "failed", "message": message}, status_code=503)
        seconds = round(time.perf_counter() - start, 4)
        return JSONResponse({"status": "ok", "seconds": seconds})

    async def server_info(self) -> dict[str, Any]:
        """SGLang's /get_server_info: the router's settings (credentials left out) and, as
        `internal_states`, each live worker's load and capacity (its heartbeat's fields, and
        under SGLang's names the ones its tools read: `avg_spec_accept_length`,
        `last_gen_throughput`)."""
        await self.broker.refresh_workers()
        r = self.config.router
        info: dict[str, Any] = {
            **{f.name: getattr(r.common, f.name) for f in dataclasses.fields(r.common)},
            **{f.name: getattr(r, f.name) for f in dataclasses.fields(r) if f.name != "common"},
            **{
                f.name: getattr(self.config, f.name)
                for f in dataclasses.fields(self.config)
                if f.name not in ("router", "api_key")
            },
            "redis_url": without_credentials(r.common.redis_url),
            "router_id": self.config.router_id,
            "served_model_name": self.model_name,
            "api_key_required": bool(self.config.api_key),
            "version": VERSION,
        }
        loads = sorted(self.broker.workers.live.values(), key=lambda w: w.worker_id)
        info["internal_states"] = [
            {**dataclasses.asdict(load), "avg_spec_accept_length": load.spec_accept_length,
             "last_gen_throughput": load.gen_throughput}
            for load in loads
        ]  # fmt: skip
        return info

    def _model_dirs(self) -> list[str | None]:
        live = self.broker.workers.live.values()
        return [self.config.router.model, *(hb.model for hb in live)]

    def status(self) -> ServiceStatusMsg:
        return ServiceStatusMsg(
            kind=ROUTER_KIND,
            service_id=self.config.router_id,
            host=os.uname().nodename,
            pid=os.getpid(),
            started_at=self.started_at,
            updated_at=time.time(),
            num_handled=self.num_handled,
        )


def without_credentials(url: str | None) -> str | None:
    if url is None:
        return None
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))


def _request_id_header(request: Request) -> str | None:
    """vLLM's `X-Request-Id` request header (it wins over the body's `request_id`)."""
    value = request.headers.get("x-request-id")
    if value is not None and not 0 < len(value) <= MAX_REQUEST_ID_LEN:
        raise ApiError(400, f"X-Request-Id must have 1 to {MAX_REQUEST_ID_LEN} characters",
                       "X-Request-Id", "invalid_value")  # fmt: skip
    return value


async def _sse_response(
    request: Request, chunks: AsyncIterator[bytes], headers: dict[str, str] | None = None
) -> Response:
    """Wait for the first chunk, so that an error before any output is a plain HTTP error."""
    try:
        first = await unless_disconnected(request, chunks.__anext__())
    except StopAsyncIteration:
        first = b""

    async def body() -> AsyncIterator[bytes]:
        try:
            yield first
            async for chunk in chunks:
                yield chunk
        finally:
            await chunks.aclose()  # closes the handles: aborts at the worker if unfinished

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})}
    return StreamingResponse(body(), media_type="text/event-stream", headers=headers)


async def unless_disconnected(request: Request, work: Any) -> Any:
    """Await `work`, cancelling it (which aborts its requests) if the client goes away."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
    if task.cancelled():
        raise ApiError(499, "client disconnected", None, "client_closed_request")
    return task.result()

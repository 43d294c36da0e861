"""Requests in flight: sending them through the tokenizers, receiving their output, aborting.

One `Broker` per router process owns
* a reader task that XREADs the router's stream `{p}:router:{r}:out` and hands every
  `DetokRow` and `ErrorMsg` to the `RequestHandle` of its rid (rows of unknown rids, from
  requests already ended or retried, are dropped), answers to tokenize queries to
  `TokenQueries` (`router_tokens`) and the answers of cache flushes and profiler starts and
  stops to `WorkerQuestions` (`router_control`);
* a watch task that keeps the table of live workers (`WorkerTable`) current, renews the
  TTL of the router's stream (which a clean stop deletes), and looks after requests that
  wait: past their deadline they fail with 504; waiting on a worker
  whose heartbeat is gone, they are sent to another worker if nothing was produced yet,
  else fail with 503 (failures reach a handle through its inbox, like its rows);
* the abort messages, sent without making the caller wait;
* the requests their clients named (`NamedRequests`, services/router_named.py: a rid is
  claimed in Redis for the whole deployment), which `cancel` ends at their workers
  (/abort_request, also when another router asks: `AbortNamedMsg` on this router's stream).

A `RequestHandle` (services/router_handle.py) follows one sub-request: the broker submits
it to the worker the routing policy picks (services/router_policy.py; a TokenizeReqMsg to
`{p}:tokenize`), and it yields `Delta`s in token order.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid

import redis

from services.router_control import WorkerQuestions
from services.router_handle import RequestHandle
from services.router_metrics import RouterMetrics
from services.router_named import NamedRequests
from services.router_policy import Policy, routing_key
from services.router_protocol import ApiError, SubRequest
from services.router_tokens import TokenQueries
from services.router_workers import WorkerTable
from shared.async_bus import AsyncBus
from shared.deployment import DEFAULT_WEIGHT_VERSION, read_version_pause_released
from shared.heartbeat import list_live_async
from shared.keys import (
    ROUTER_OUT_TTL_MS,
    WORKER_KIND,
    router_out_stream,
    tokenize_stream,
    worker_in_stream,
)
from shared.messages import (
    AbortNamedMsg,
    AbortNamedRespMsg,
    AbortReqMsg,
    DetokOutputMsg,
    ErrorMsg,
    FlushCacheRespMsg,
    LoraRespMsg,
    MemoryRespMsg,
    PauseRespMsg,
    ProfileRespMsg,
    TokenizeReqMsg,
    TokenizeRespMsg,
    UpdateWeightsRespMsg,
    WeightsReadRespMsg,
    WorkerLoadMsg,
)

logger = logging.getLogger(__name__)
LOOP_STOP_S = 3.0  # the longest stop() waits for its loops (a read blocks for 1 s)

# the workers' answers to the router's questions (services/router_control.py)
_WORKER_ANSWERS = (
    FlushCacheRespMsg, ProfileRespMsg, LoraRespMsg, UpdateWeightsRespMsg, PauseRespMsg,
    MemoryRespMsg, WeightsReadRespMsg,
)  # fmt: skip


class Broker:
    def __init__(
        self,
        bus: AsyncBus,
        router_id: str,
        metrics: RouterMetrics,
        *,
        request_timeout_s: float = 600.0,
        check_s: float = 0.5,
        max_attempts: int = 3,
        policy: Policy | None = None,
    ) -> None:
        self.bus, self.router_id, self.metrics = bus, router_id, metrics
        self.request_timeout_s, self.check_s = request_timeout_s, check_s
        self.max_attempts = max_attempts
        self.out_stream = router_out_stream(bus.prefix, router_id)
        self.workers = WorkerTable(policy, router_id)
        self.to_workers = WorkerQuestions(bus, router_id, self.workers)
        self.queries = TokenQueries(bus, router_id)
        self.named = NamedRequests(self)
        # the deployment's weight version (SGLang's) and whether generation is paused (its
        # mode), as of the last refresh
        self.weight_version = DEFAULT_WEIGHT_VERSION
        self.paused: str | None = None
        self.released: tuple[str, ...] = ()  # memory tags released (router_memory.py)
        self._deployment_writes = 0  # this router's own changes of the three (`set_deployment`)
        self.handles: dict[str, RequestHandle] = {}
        self._tasks: set[asyncio.Task] = set()  # abort messages on their way
        self._loops: list[asyncio.Task] = []
        self._stopping = False
        self._ids = itertools.count()
        self._rid_base = uuid.uuid4().hex[:12]

    async def start(self) -> None:
        await self.refresh_workers()
        self._loops = [asyncio.create_task(c) for c in (self._read_loop(), self._watch_loop())]

    async def stop(self) -> None:
        """Abort what is in flight (waiting briefly for the aborts to go out), stop the loops,
        delete this router's stream: first (a stop cut short, e.g. killed after its grace
        period, leaves none behind) and last (what was written to it meanwhile)."""
        self._stopping = True
        await self._delete_stream()
        for handle in list(self.handles.values()):
            handle.close()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=1.0)
        for task in self._loops:
            task.cancel()
        # Bounded: a loop whose cancellation a library swallowed ends at its next check of
        # `_stopping` (within a read's block), and a stop must end whatever happens.
        running: set[asyncio.Task] = set()
        if self._loops:
            _, running = await asyncio.wait(self._loops, timeout=LOOP_STOP_S)
        for task in running:
            logger.warning("router loop %s did not stop within %g s", task.get_coro(), LOOP_STOP_S)
        await self._delete_stream()

    async def _delete_stream(self) -> None:
        try:
            await self.bus.redis.delete(self.out_stream)
        except redis.RedisError as exc:
            logger.warning("deleting %s: %s", self.out_stream, exc)

    async def open(self, subs: list[SubRequest]) -> list[RequestHandle]:
        """Handles of a new request's sub-requests; 400 if its rid names one in flight."""
        arrived = time.perf_counter()
        handles = [RequestHandle(self, sub, arrived) for sub in subs]
        await self.named.add(handles)
        return handles

    async def submit(self, handles: list[RequestHandle]) -> None:
        """Send each handle (again) to the live worker the routing policy picks of those it
        has not tried."""
        msgs = []
        for h in handles:
            sub = h.sub
            key = routing_key(
                text=sub.text, text_pair=sub.text_pair, input_ids=sub.input_ids,
                messages=sub.messages, tools=sub.tools, lora_name=sub.lora_name,
                cache_salt=sub.cache_salt,
            ) if self.workers.policy.uses_key else None  # fmt: skip
            kind = {"lora": sub.lora_name, "embedding": sub.embed, "key": key}
            worker = self.workers.choose(exclude=h.tried, **kind)
            if worker is None:  # the table may be a moment old: look again before failing
                await self.refresh_workers()
                worker = self.workers.choose(exclude=h.tried, **kind)
            if worker is None:
                raise self.workers.none_for(h.sub.embed)
            self.forget(h)
            h.rid = f"{self._rid_base}-{next(self._ids)}"
            h.worker = worker
            h.tried.append(worker.worker_id)
            self.handles[h.rid] = h
            self.workers.started(worker.worker_id)
            msgs.append((tokenize_stream(self.bus.prefix), self._tokenize_msg(h)))
        try:
            await self.bus.publish_many(msgs)
        except redis.RedisError as exc:
            raise ApiError(503, f"message bus unavailable: {exc}", None, "bus_unavailable") from exc
        for h in handles:
            if h.cancelled:  # while it was being sent
                self.abort(h, h.cancelled)

    def cancel(self, handles: list[RequestHandle], why: str) -> None:
        """End `handles` at their workers: each response finishes with finish_reason abort."""
        for h in handles:
            if h.cancelled or h.closed:
                continue
            h.cancelled = why
            if h.worker is not None and h.rid in self.handles:
                self.abort(h, why)

    def forget(self, handle: RequestHandle) -> None:
        if self.handles.pop(handle.rid, None) is not None and handle.worker is not None:
            self.workers.ended(handle.worker.worker_id)

    def abort(self, handle: RequestHandle, reason: str) -> None:
        assert handle.worker is not None
        stream = worker_in_stream(self.bus.prefix, handle.worker.worker_id)
        self.spawn(self.bus.publish(stream, AbortReqMsg(handle.rid, reason)))

    async def refresh_workers(self) -> None:
        """The worker table from the heartbeats; the weight version, the pause and the
        memory released from Redis."""
        live = await list_live_async(self.bus.redis, self.bus.prefix, WORKER_KIND)
        self.workers.update({k: v for k, v in live.items() if isinstance(v, WorkerLoadMsg)})
        await self.read_deployment()

    @property
    def asleep(self) -> bool:
        """Whether the workers' weights or K/V are released (nothing generates)."""
        return bool({"weights", "kv_cache"} & set(self.released))

    async def read_deployment(self) -> None:
        """The deployment's weight version, pause and memory released, read now (one round
        trip). A read that this router's own change overtook (`set_deployment` while it was on
        its way) is dropped: it holds the values from before that change."""
        writes = self._deployment_writes
        read = await read_version_pause_released(self.bus.redis, self.bus.prefix)
        if writes == self._deployment_writes:
            self.weight_version, self.paused, self.released = read

    def set_deployment(self, **fields: object) -> None:
        """This router's change of the weight version, pause or memory released (already
        recorded in Redis): seen at once, and not undone by a read that began before it."""
        for name, value in fields.items():
            assert name in ("weight_version", "paused", "released"), name
            setattr(self, name, value)
        self._deployment_writes += 1

    def _tokenize_msg(self, h: RequestHandle) -> TokenizeReqMsg:
        sub = h.sub
        assert h.worker is not None
        # vLLM's: from the first token, computed once per prompt
        wants_prompt = sub.prompt_logprobs is not None and sub.prompt_scored_by is None
        return TokenizeReqMsg(
            rid=h.rid,
            router_id=self.router_id,
            worker_id=h.worker.worker_id,
            text=sub.text,
            messages=sub.messages,
            input_ids=sub.input_ids,
            sampling_params=sub.sampling_params,
            stream=True,
            return_logprob=sub.return_logprob or wants_prompt,
            top_logprobs_num=max(sub.top_logprobs_num, sub.prompt_logprobs or 0) if wants_prompt
            else sub.top_logprobs_num,
            logprob_start_len=0 if wants_prompt else sub.logprob_start_len,
            created=time.time(),
            tools=sub.tools,
            chat_template_kwargs=sub.chat_template_kwargs,
            add_generation_prompt=sub.add_generation_prompt,
            continue_final_message=sub.continue_final_message,
            return_prompt_ranks=wants_prompt,
            priority=sub.priority,
            lora_name=sub.lora_name,
            return_prompt_ids=sub.return_token_ids,
            embed=sub.embed,
            text_pair=sub.text_pair,
            cache_salt=sub.cache_salt,
        )

    def _dispatch(self, msg: object) -> None:
        if isinstance(msg, DetokOutputMsg):
            handles = self.handles
            for row in msg.rows():
                h = handles.get(row.rid)
                if h is not None:
                    h.deliver(row)
        elif isinstance(msg, ErrorMsg):
            h = self.handles.get(msg.rid)
            if h is not None:
                h.deliver(msg)
            else:
                self.queries.deliver(msg)
        elif isinstance(msg, _WORKER_ANSWERS):
            self.to_workers.deliver(msg)
        elif isinstance(msg, TokenizeRespMsg):
            self.queries.deliver(msg)
        elif isinstance(msg, (AbortNamedMsg, AbortNamedRespMsg)):
            self.named.deliver(msg)
        else:
            logger.warning("unexpected %s message on %s", type(msg).__name__, self.out_stream)

    async def _read_loop(self) -> None:
        last_id = "0"  # the stream is this router's own: whatever is there is ours or stale
        while not self._stopping:
            try:
                last_id, entries = await self.bus.read_plain(
                    self.out_stream, last_id, count=512, block_ms=1000
                )
            except redis.RedisError as exc:
                logger.warning("reading %s: %s", self.out_stream, exc)
                await asyncio.sleep(0.5)
                continue
            for _, msg in entries:
                self._dispatch(msg)

    async def _watch_loop(self) -> None:
        """Every `check_s`: refresh the worker table, renew the TTL of this router's stream,
        then look after waiting requests. Time generation spends paused or with the memory
        released (on purpose: services/router_pause.py, services/router_memory.py) does not
        count against a request's deadline."""
        last = time.perf_counter()
        while not self._stopping:
            await asyncio.sleep(self.check_s)
            try:
                await self.refresh_workers()
                await self.bus.redis.pexpire(self.out_stream, ROUTER_OUT_TTL_MS)
            except redis.RedisError as exc:
                logger.warning("refreshing workers: %s", exc)
                continue
            now = time.perf_counter()
            if self.paused is not None or self.asleep:
                for handle in self.handles.values():
                    handle.deadline += now - last
            last = now
            for handle in list(self.handles.values()):
                if now >= handle.deadline:
                    handle.deliver(
                        ApiError(
                            504,
                            f"request timed out after {self.request_timeout_s:g} s",
                            None,
                            "timeout",
                        )
                    )
                elif handle.waiting:
                    await self._check_worker(handle)

    async def _check_worker(self, h: RequestHandle) -> None:
        """A request waits on a dead worker: resend it if nothing came yet, else fail it."""
        w = h.worker
        if w is None or self.workers.is_alive(w.worker_id, w.pid):
            return
        if h.assembler.num_rows_seen == 0 and len(h.tried) < self.max_attempts:
            logger.warning("worker %s is gone; resending %s", w.worker_id, h.rid)
            try:
                await self.submit([h])
                return
            except ApiError as err:
                h.deliver(err)
                return
        h.deliver(
            ApiError(
                503,
                f"worker {w.worker_id} stopped while serving the request",
                None,
                "worker_unavailable",
            )
        )

    def spawn(self, coro: object) -> None:
        """Run `coro` in the background (stop() waits briefly for what is left)."""
        task = asyncio.ensure_future(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.warning("router task failed: %r", task.exception())

"""The worker service: one engine (scheduler, prefix cache, model) fed through Redis.

    I/O process:    {p}:worker:{w}:in ──▶ records ──┐       (services.worker_io)
    scheduler loop: drain records → dispatch → scheduler.step() → one step record
    I/O process:    ◀── step messages to {p}:detok, ErrorMsgs to routers, heartbeat ──┘

The scheduler's process runs one Python thread and never talks to Redis: a child process
does (see `services.worker_link` for why a process, with the measurements, and for the
records on its pipes). The loop drains the requests and aborts that arrived between steps
(blocking on them only when the scheduler has no work), and after each step writes one
compact record with every request that got tokens or ended in it (`step_records`); the
I/O process builds and sends the step message. A `GenerateReqMsg` becomes
`scheduler.add_request` (a ValueError, or a grammar that fails to compile later, becomes an
`ErrorMsg` to its router); an `AbortReqMsg` becomes `scheduler.abort_request`, or is
remembered when it overtook its request; a `FlushCacheReqMsg` empties the prefix cache if
nothing runs or waits, and is answered either way; a `ProfileReqMsg` starts or stops the torch
profiler around the steps (services/worker_profile.py); a `LoraReqMsg` loads or unloads a LoRA
adapter (engine/scheduler/model_updates.py) and is answered with the adapters served then; an
`UpdateWeightsReqMsg` (a `DistributedWeightsReqMsg`: tensors an RL trainer broadcasts, in a
group a `WeightsGroupReqMsg` joined) holds new requests back until the running ones end, then
updates the weights and admits them (services/worker_weights.py); a `PauseReqMsg` stops the
stepping (its requests aborted, kept, retracted, or, mode "wait", run to their end first; new
ones wait in the queue) or starts it again, and a paused worker's aborts, cache flushes and
weights updates act at once (the scheduler at rest: engine/scheduler/pausing.py); a
`MemoryReqMsg` releases the device memory while no request holds K/V, or takes it back
(services/worker_memory.py; nothing steps while weights or K/V are released, as if paused).
The load figures go to the I/O process's heartbeat (`WorkerLoadMsg`) at most every 0.25 s;
SIGTERM / SIGINT stop the loop, and the I/O process deletes the heartbeat.

    sluice worker --redis-url redis://127.0.0.1:6379/0 --worker-id 0 --model /models/m
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time
from typing import TYPE_CHECKING

from engine.scheduler.step_trace import StepTrace
from services.group_consumer import exit_process, stop_on_signals
from services.worker_link import IoLink
from services.worker_load import REFRESH_EVERY_S, WorkerFacts, load_figures
from services.worker_memory import MemoryHandling
from services.worker_pause import PauseHandling
from services.worker_profile import StepProfiler
from services.worker_requests import (
    RequestTable,
    aborted_row,
    check_kind,
    sampling_params,
    step_records,
)
from services.worker_weights import WeightsHandling, WeightsUpdate, attempt
from shared.deployment import BROADCAST_WEIGHTS, read_state
from shared.keys import WORKER_KIND, detok_stream, router_out_stream, weights_key
from shared.logging import setup_logging
from shared.messages import (
    AbortReqMsg,
    DistributedWeightsReqMsg,
    ErrorMsg,
    FlushCacheReqMsg,
    FlushCacheRespMsg,
    GenerateReqMsg,
    LoraReqMsg,
    LoraRespMsg,
    MemoryReqMsg,
    PauseReqMsg,
    ProfileReqMsg,
    ProfileRespMsg,
    StepOutputMsg,
    UpdateWeightsReqMsg,
    WeightsGroupReqMsg,
    WeightsReadReqMsg,
)
from shared.settings import WorkerSettings, add_settings_args, settings_from_args

if TYPE_CHECKING:
    from engine.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # how long an idle loop blocks on the pipe before checking for stop


class Worker(PauseHandling, MemoryHandling, WeightsHandling):
    def __init__(
        self,
        settings: WorkerSettings,
        scheduler: Scheduler,
        model: str,
        paused: str | None = None,
    ) -> None:
        self.settings = settings
        self.scheduler = scheduler
        self.model = model
        self.worker_id = settings.worker_id
        self.prefix = settings.common.prefix
        self.vocab_size = scheduler.model_runner.model_config.vocab_size
        self.table = RequestTable()
        self.detok_stream = detok_stream(self.prefix)
        self.stop = threading.Event()
        self.num_steps = 0
        self._events_waiting = False  # an abort of a queued request emitted its final event
        self._next_load = 0.0
        self.trace = StepTrace(settings.step_trace) if settings.step_trace else None
        self.profiler = StepProfiler(
            self.worker_id, settings.profile_dir, getattr(scheduler, "executor", None)
        )
        self._handlers = {
            GenerateReqMsg: self._on_generate,
            AbortReqMsg: self._on_abort,
            FlushCacheReqMsg: self._on_flush,
            ProfileReqMsg: self._on_profile,
            LoraReqMsg: self._on_lora,
            UpdateWeightsReqMsg: self._on_update_weights,
            PauseReqMsg: self._on_pause,
            MemoryReqMsg: self._on_memory,
            DistributedWeightsReqMsg: self._on_update_weights,
            WeightsGroupReqMsg: self._on_weights_group,
            WeightsReadReqMsg: self._on_weights_read,
        }
        # a weights update waiting for the running requests to end, and the requests that
        # arrived meanwhile (admitted after it)
        self._update: WeightsUpdate | None = None
        self._held: list[GenerateReqMsg] = []
        # generation paused: the mode it was paused in (None: running; `paused` a worker
        # starting in a paused deployment), and a pause in mode "wait" until the requests it
        # waits for have ended (new ones are held back meanwhile)
        self._paused: str | None = paused
        self._pausing: PauseReqMsg | None = None
        self.link = IoLink(self.hello())  # starts the I/O process; ready when this returns

    def hello(self) -> dict:
        """The I/O process's configuration."""
        common, s = self.settings.common, self.settings
        return {
            "redis_url": common.require_redis_url(),
            "prefix": self.prefix,
            "stream_maxlen": common.stream_maxlen,
            "worker_id": self.worker_id,
            "batch_size": s.batch_size,
            "block_ms": s.block_ms,
            "heartbeat_ttl_s": common.heartbeat_ttl_s,
            # a router missing at two looks this far apart is gone (services/worker_routers.py)
            "router_check_s": max(0.5, common.heartbeat_ttl_s / 2),
            "log_level": common.log_level,
            "facts": list(WorkerFacts.of(self.scheduler, self.worker_id, self.model)),
        }

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> None:
        logger.info("worker %s ready (model %s)", self.worker_id, self.model)
        try:
            while not self.stop.is_set():
                self._send_load()
                idle = not self._runnable()
                if idle and self.trace is not None:
                    self.trace.flush()
                self._drain(block=idle and self._update is None and self._pausing is None)
                if self._runnable() or (self._events_waiting and self._stepping()):
                    self._step()
                elif self._events_waiting:  # paused: no batch runs, its events go out
                    self._events_waiting = False
                    self._publish(self.scheduler.output.take_events())
                if self._update is not None and self._update_ready():
                    self._update_weights()
                if self._pausing is not None and not self.scheduler.has_work():
                    self._paused_after_wait()
        finally:
            if self.trace is not None:
                self.trace.flush()
            if self.profiler.active:  # (what was profiled is not lost)
                self.profiler.stop()
            self.link.close()
            close = getattr(self.scheduler, "close", None)
            if close is not None:
                close()
            logger.info("stopped after %d steps", self.num_steps)

    def _drain(self, block: bool) -> None:
        for msg in self.link.receive(timeout=IDLE_WAIT_S if block else 0.0):
            self._handlers[type(msg)](msg)

    def _step(self) -> None:
        self._events_waiting = False
        start = time.perf_counter()
        if self.profiler.active:  # (nothing on the step's path otherwise)
            events = self.profiler.run_step(self.num_steps + 1, self.scheduler.step)
        else:
            events = self.scheduler.step()
        if self.trace is not None:
            self.trace.add(start, time.perf_counter(), self.scheduler.last_batch, len(events))
        self.num_steps += 1
        self._publish(events)

    def _publish(self, events: list) -> None:
        """A step's events (or, paused, those of aborts and of a batch brought to rest) to
        the I/O process; grammars that failed to compile to their routers."""
        rows, plain, ended = step_records(events, self.table.active)
        for rid in ended:
            self.table.end(rid)
        if rows or plain[0]:
            self.link.step(self.num_steps, rows, plain)
        for rid, why in self.scheduler.take_rejected():  # grammars that did not compile
            info = self.table.active.get(rid)
            if info is not None:
                self.table.end(rid)
                self.link.forget(rid)
                self._reject(rid, info.router_id, why)

    def _send_load(self) -> None:
        now = time.monotonic()
        if now >= self._next_load:
            self._next_load = now + REFRESH_EVERY_S
            if not self._stepping():  # (no step updates the figures: requests admitted since)
                self.scheduler.settle()
            figures = load_figures(self.scheduler)
            self.link.load(figures._replace(reqs_by_router=self.table.by_router()))

    # -- dispatch ---------------------------------------------------------------------------
    def _stepping(self) -> bool:
        """Neither paused nor with weights or K/V released (services/worker_memory.py)."""
        return self._paused is None and not self.scheduler.asleep

    def _runnable(self) -> bool:
        return self._stepping() and self.scheduler.has_work()

    def _on_generate(self, msg: GenerateReqMsg) -> None:
        if self._update is not None or self._pausing is not None:  # (after either)
            self._held.append(msg)
            return
        admission = self.table.admit(msg)
        if admission == "duplicate":
            logger.info("ignoring a second copy of request %s", msg.rid)
            return
        if admission == "aborted":
            row = aborted_row(msg)
            out = StepOutputMsg.from_rows([row], worker_id=self.worker_id, step=self.num_steps)
            self.link.publish(self.detok_stream, out)
            return
        try:
            check_kind(msg, self.scheduler.args.is_embedding)
            params = sampling_params(msg, self.vocab_size)
            self.scheduler.add_request(
                msg.rid, msg.input_ids, params, msg.priority, msg.lora_name,
                token_type_ids=msg.token_type_ids, cache_salt=msg.cache_salt,
            )  # fmt: skip
        except ValueError as exc:
            self._reject(msg.rid, msg.router_id, str(exc))
            return
        self.link.start(msg.rid, self.table.start(msg))

    def _reject(self, rid: str, router_id: str, why: str) -> None:
        """The request's 400, to its router."""
        source = f"{WORKER_KIND}:{self.worker_id}"
        error = ErrorMsg(rid, router_id, "invalid_request", why, 400, source)
        self.link.publish(router_out_stream(self.prefix, router_id), error)

    def _on_abort(self, msg: AbortReqMsg) -> None:
        if self._abort(msg.rid, msg.reason or "aborted by request") and self._paused:
            self.scheduler.end_aborted()  # (a paused scheduler steps no more)

    def _abort(self, rid: str, why: str) -> bool:
        if not self.table.abort(rid):
            return False
        self.scheduler.abort_request(rid, why)
        self._events_waiting = True  # even if the scheduler is left without work
        return True

    def _on_flush(self, msg: FlushCacheReqMsg) -> None:
        flushed = self.scheduler.flush_cache(keep_waiting=not self._stepping())
        if flushed:
            logger.info("prefix cache flushed")
        note = "" if flushed else "not flushed: requests are running or waiting"
        reply = FlushCacheRespMsg(msg.request_id, msg.router_id, self.worker_id, flushed, note)
        self.link.publish(router_out_stream(self.prefix, msg.router_id), reply)

    def _on_profile(self, msg: ProfileReqMsg) -> None:
        paths: list[str] = []
        if msg.action == "start":
            ok, note = self.profiler.start(msg)
        elif msg.action == "stop":
            ok, note, paths = self.profiler.stop()
        else:
            ok, note = False, f"unknown profile action {msg.action!r}"
        reply = ProfileRespMsg(msg.request_id, msg.router_id, self.worker_id, ok, note, paths)
        self.link.publish(router_out_stream(self.prefix, msg.router_id), reply)

    def _on_lora(self, msg: LoraReqMsg) -> None:
        loras, sched = self.scheduler.loras, self.scheduler
        if msg.action == "load":
            ok, note = attempt(sched.load_lora_adapter, msg.lora_name, msg.lora_path, msg.replace)
        elif msg.action == "unload":
            ok, note = attempt(sched.unload_lora_adapter, msg.lora_name)
        else:
            ok, note = False, f"unknown LoRA action {msg.action!r}"
        if ok:
            self.link.facts(lora_adapters=sorted(loras.ids))
        reply = LoraRespMsg(
            msg.request_id, msg.router_id, self.worker_id, ok, note, loras.enabled,
            dict(loras.paths),
        )  # fmt: skip
        self.link.publish(router_out_stream(self.prefix, msg.router_id), reply)

    def _abort_all(self, why: str) -> int:
        rids = list(self.table.active)
        for rid in rids:
            self._abort(rid, why)
        if self._paused:
            self.scheduler.end_aborted()
        return len(rids)

    def _admit_held(self) -> None:
        """The requests held back by a weights update or a pause in mode "wait", once
        neither holds them back (into the waiting queue, paused or not)."""
        if self._update is None and self._pausing is None:
            held, self._held = self._held, []
            for request in held:
                self._on_generate(request)

def catch_up(scheduler: Scheduler, settings: WorkerSettings) -> str | None:
    """Make what the deployment's other workers serve since run-time changes (a weights
    update, LoRA adapters loaded or unloaded, memory released while idle; shared/deployment.py)
    this worker's too, before it announces itself; returns the mode of the pause in force, if
    generation is paused.
    Weights it cannot load stop it: serving other weights than the rest of the deployment
    would be worse. An adapter it cannot load is left out (the router sends requests naming
    an adapter only to workers that serve it)."""
    from shared.redis_clients import connect

    client = connect(settings.common.require_redis_url())
    try:
        state = read_state(client, settings.common.prefix)
    finally:
        client.close()
    weights = state.weights
    if weights == BROADCAST_WEIGHTS:
        raise SystemExit(
            "the deployment serves weights an RL trainer broadcast (/update_weights_from_"
            "distributed), which are on no disk: this worker cannot serve the same. Save them "
            "as a checkpoint and POST /update_weights_from_disk, or, to start workers from "
            f"--model again: DEL {weights_key(settings.common.prefix)}"
        )
    if weights and os.path.realpath(weights) != os.path.realpath(scheduler.weights_path):
        logger.info("the deployment's weights were updated to %s: loading them", weights)
        try:
            scheduler.update_weights_from_disk(weights)
        except Exception as exc:  # noqa: BLE001 - stop with the reason
            raise SystemExit(
                f"the deployment serves the weights of {weights} (a weights update), which "
                f"this worker cannot load: {exc}. To start workers from --model again: DEL "
                f"{weights_key(settings.common.prefix)}"
            ) from exc
    if state.paused is not None:
        logger.info("generation is paused (mode %s): starting paused", state.paused)
    _catch_up_loras(scheduler, state.lora_adapters)
    if state.released:  # (last: the rest reads the weights)
        logger.info("the deployment's memory is released (%s): releasing it",
                    ", ".join(state.released))  # fmt: skip
        try:
            scheduler.release_memory_occupation(
                state.released, scheduler.args.enable_weights_cpu_backup
            )
        except ValueError as exc:  # (a record written by hand: started with its memory)
            logger.warning("memory not released: %s", exc)
    return state.paused


def _catch_up_loras(scheduler: Scheduler, adapters: dict[str, str]) -> None:
    loras = scheduler.loras
    changes = sorted(adapters.items())
    if changes and not loras.enabled:
        logger.info("LoRA adapters were loaded at run time, but this worker serves none "
                    "(start it with --enable-lora)")  # fmt: skip
        return
    for name, path in changes:
        try:
            if not path and name in loras.ids:
                scheduler.unload_lora_adapter(name)
            elif path and loras.paths.get(name) != path:
                scheduler.load_lora_adapter(name, path, name in loras.ids)
        except Exception as exc:  # noqa: BLE001 - the others still serve it
            logger.warning("LoRA adapter %r (from %s, loaded at run time) left out: %s",
                           name, path, exc)  # fmt: skip


def run(settings: WorkerSettings, ns: argparse.Namespace) -> None:
    from engine.engine import build_scheduler
    from engine.tokenizer import load_tokenizer
    from services.engine_args import engine_args_from

    common = settings.common
    if getattr(ns, "node_rank", 0) > 0:  # another machine's ranks of node 0's worker
        from engine.tp_ranks import run_node

        logging.getLogger().handlers.clear()
        setup_logging(WORKER_KIND, f"{settings.worker_id}-node{ns.node_rank}", common.log_level)
        ns.model_path = ns.model_path or settings.model
        exit_process(run_node(engine_args_from(ns)))
    common.require_redis_url()  # fail before the slow part
    logging.getLogger().handlers.clear()  # this process logs through setup_logging only
    setup_logging(WORKER_KIND, settings.worker_id, common.log_level)
    if ns.model_path is None:
        ns.model_path = settings.model
    args = engine_args_from(ns)
    scheduler = build_scheduler(args, load_tokenizer(args.model_path))
    paused = catch_up(scheduler, settings)
    scheduler.grammar_queue.warm_up()  # in the background
    worker = Worker(settings, scheduler, args.model_path, paused)
    stop_on_signals(worker.stop)
    worker.run()


def _main(ns: argparse.Namespace) -> None:
    run(settings_from_args(WorkerSettings, ns), ns)
    exit_process(0)


def add_parser(sub: argparse._SubParsersAction) -> None:
    from services.engine_args import add_engine_args

    # The engine's --model/--model-path replaces the settings' --model (SLUICE_MODEL stays).
    p = sub.add_parser("worker", help="a worker service (one engine)", conflict_handler="resolve")
    add_settings_args(p, WorkerSettings)
    add_engine_args(p)
    p.set_defaults(func=_main)

"""The worker service: one engine (scheduler, prefix cache, model) fed through Redis.

    receiver thread: {p}:worker:{w}:in ──▶ local queue ─┐
    scheduler loop:  drain queue → dispatch → scheduler.step() → one StepOutputMsg
    sender thread:   ◀── pipelined XADDs to {p}:detok (and ErrorMsgs to routers) ──┘

The loop never waits on Redis: it drains the local queue between steps (blocking on it
only when the scheduler has no work), and hands each step's events to the sender, which
builds the step message (rows, encoding) on its thread, while the next forward runs. A
`GenerateReqMsg` becomes `scheduler.add_request` (a ValueError becomes an `ErrorMsg` to
its router); an `AbortReqMsg` becomes `scheduler.abort_request`, or is remembered when
it overtook its request. Each step sends one message with every request that got tokens
or ended in it (see `worker_requests.step_row`). A heartbeat carries the worker's load
(`WorkerLoadMsg`); SIGTERM / SIGINT stop the loop and delete it.

    sluice worker --redis-url redis://127.0.0.1:6379/0 --worker-id 0 --model /models/m
"""

from __future__ import annotations

import argparse
import functools
import logging
import queue
import threading
from typing import TYPE_CHECKING

from services.group_consumer import exit_process, stop_on_signals
from services.worker_io import Receiver, Sender
from services.worker_load import LoadReporter
from services.worker_requests import RequestTable, aborted_row, sampling_params, step_message
from shared.bus import Bus
from shared.heartbeat import Heartbeat
from shared.keys import (
    WORKER_KIND,
    detok_stream,
    heartbeat_key,
    router_out_stream,
    worker_in_stream,
)
from shared.logging import setup_logging
from shared.messages import AbortReqMsg, ErrorMsg, GenerateReqMsg, StepOutputMsg
from shared.settings import WorkerSettings, add_settings_args, settings_from_args

if TYPE_CHECKING:
    from engine.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # how long an idle loop blocks on the queue before checking for stop


class Worker:
    def __init__(
        self, settings: WorkerSettings, scheduler: Scheduler, bus: Bus, model: str
    ) -> None:
        self.settings = settings
        self.scheduler = scheduler
        self.bus = bus
        self.model = model
        self.worker_id = settings.worker_id
        self.vocab_size = scheduler.model_runner.model_config.vocab_size
        self.table = RequestTable()
        stream = worker_in_stream(bus.prefix, self.worker_id)
        self.receiver = Receiver(
            bus, stream, self.worker_id, settings.batch_size, settings.block_ms
        )
        self.sender = Sender(bus)
        self.detok_stream = detok_stream(bus.prefix)
        key = heartbeat_key(bus.prefix, WORKER_KIND, self.worker_id)
        self.load = LoadReporter(scheduler, self.worker_id, model)
        ttl = settings.common.heartbeat_ttl_s
        self.heartbeat = Heartbeat(bus.redis, key, ttl, self.load.payload)
        self.stop = threading.Event()
        self.num_steps = 0
        self._events_waiting = False  # an abort of a queued request emitted its final event
        self._handlers = {GenerateReqMsg: self._on_generate, AbortReqMsg: self._on_abort}

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> None:
        self.receiver.prepare()
        self.receiver.start()
        self.sender.start()
        self.heartbeat.start()
        logger.info("worker %s ready (model %s)", self.worker_id, self.model)
        try:
            while not self.stop.is_set():
                self._drain(block=not self.scheduler.has_work())
                if self.scheduler.has_work() or self._events_waiting:
                    self._step()
                self.load.refresh()
        finally:
            self.heartbeat.stop()
            self.receiver.stop()
            self.sender.stop()
            close = getattr(self.scheduler, "close", None)
            if close is not None:
                close()
            logger.info("stopped after %d steps", self.num_steps)

    def _drain(self, block: bool) -> None:
        inbox = self.receiver.inbox
        try:
            batch = inbox.get(timeout=IDLE_WAIT_S) if block else inbox.get_nowait()
            while True:
                for msg in batch or ():
                    self._handlers[type(msg)](msg)
                batch = inbox.get_nowait()
        except queue.Empty:
            pass

    def _step(self) -> None:
        self._events_waiting = False
        events = self.scheduler.step()
        self.num_steps += 1
        ours = []
        for event in events:
            info = self.table.active.get(event.rid)
            if info is None:  # not ours (cannot happen: every request comes through here)
                continue
            ours.append((event, info, event.req.cached_tokens))
            if event.finished_reason is not None:
                self.table.end(event.rid)
        if ours:  # rows built and encoded on the sender thread, off the scheduler's path
            build = functools.partial(step_message, ours, self.worker_id, self.num_steps)
            self.sender.send(self.detok_stream, build)

    # -- dispatch ---------------------------------------------------------------------------
    def _on_generate(self, msg: GenerateReqMsg) -> None:
        admission = self.table.admit(msg)
        if admission == "duplicate":
            logger.info("ignoring a second copy of request %s", msg.rid)
            return
        if admission == "aborted":
            row = aborted_row(msg)
            out = StepOutputMsg.from_rows([row], worker_id=self.worker_id, step=self.num_steps)
            self.sender.send(self.detok_stream, out)
            return
        try:
            params = sampling_params(msg, self.vocab_size)
            self.scheduler.add_request(msg.rid, msg.input_ids, params)
        except ValueError as exc:
            source = f"{WORKER_KIND}:{self.worker_id}"
            error = ErrorMsg(msg.rid, msg.router_id, "invalid_request", str(exc), 400, source)
            self.sender.send(router_out_stream(self.bus.prefix, msg.router_id), error)
            return
        self.table.start(msg)

    def _on_abort(self, msg: AbortReqMsg) -> None:
        if self.table.abort(msg.rid):
            self.scheduler.abort_request(msg.rid)
            self._events_waiting = True  # even if the scheduler is left without work


def run(settings: WorkerSettings, ns: argparse.Namespace) -> None:
    from engine.engine import build_scheduler
    from engine.tokenizer import load_tokenizer
    from services.engine_args import engine_args_from

    common = settings.common
    url = common.require_redis_url()  # fail before the slow part
    logging.getLogger().handlers.clear()  # this process logs through setup_logging only
    setup_logging(WORKER_KIND, settings.worker_id, common.log_level)
    if ns.model_path is None:
        ns.model_path = settings.model
    args = engine_args_from(ns)
    scheduler = build_scheduler(args, load_tokenizer(args.model_path))
    bus = Bus.from_url(url, common.prefix, maxlen=common.stream_maxlen)
    worker = Worker(settings, scheduler, bus, args.model_path)
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

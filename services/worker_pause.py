"""A worker's pausing (SGLang's `/pause_generation`, vLLM's `/pause`; services/router_pause.py):
a `PauseReqMsg` stops the worker's stepping, in the message's mode, or starts it again. A
mixin of `Worker` (services/worker.py), which owns the state it changes: `_paused` (the mode
in force, None when generating), `_pausing` (a pause in mode "wait" until the requests it
waits for have ended), the requests held back and a weights update waiting. What is done to
the scheduler's requests at rest is `Pausing`'s (engine/scheduler/pausing.py).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from shared.keys import router_out_stream
from shared.messages import PauseReqMsg, PauseRespMsg

if TYPE_CHECKING:
    from engine.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


class PauseHandling:
    scheduler: Scheduler
    table: Any
    link: Any
    prefix: str
    worker_id: str
    _paused: str | None
    _pausing: PauseReqMsg | None
    _update: Any  # a weights update waiting (services/worker_weights.py)
    _events_waiting: bool
    _abort_all: Any
    _admit_held: Any
    _refuse_update: Any

    def _on_pause(self, msg: PauseReqMsg) -> None:
        if msg.action == "resume":
            self._resume(msg)
        elif msg.mode == "wait" and self._paused is None:
            if self._pausing is not None:
                why = "a pause in mode wait is waiting for its requests already"
                self._reply_pause(msg, False, why)
                return
            logger.info("pausing: waiting for %d request(s) to end", len(self.table.active))
            self._pausing = msg
        else:
            self._reply_pause(msg, True, "", self._pause_now(msg))

    def _pause_now(self, msg: PauseReqMsg) -> int:
        """Pause in `msg.mode` at once (paused already, a "wait" has nothing to wait for);
        the requests acted on."""
        sched, mode = self.scheduler, msg.mode
        if mode == "abort":
            count = self._abort_all("aborted: generation paused")
        sched.settle()
        if mode == "abort":
            sched.end_aborted()
        elif mode == "retract":
            count = sched.retract_all()
        else:
            count = len(self.table.active)
        self._events_waiting = True  # (the tokens of the batch brought to rest, the aborts)
        if self._pausing is not None:  # a pause waiting for its requests is done with
            self._reply_pause(self._pausing, True, f"paused by a pause in mode {mode}")
            self._pausing = None
        self._paused = "keep" if mode == "wait" else mode  # (a "wait" when paused already)
        self._after_pause(msg)
        logger.info("generation paused (mode %s): %d request(s)", mode, count)
        return count

    def _paused_after_wait(self) -> None:
        msg, self._pausing = self._pausing, None
        assert msg is not None
        self._paused = "wait"
        self._after_pause(msg)
        logger.info("generation paused (mode wait)")
        self._reply_pause(msg, True, "")

    def _after_pause(self, msg: PauseReqMsg) -> None:
        """A pause is in force: the cache flush it asked for, a weights update that cannot
        happen now refused, the requests held back meanwhile into the (paused) queue."""
        sched = self.scheduler
        if msg.clear_cache and sched.flush_cache(keep_waiting=True):
            logger.info("prefix cache flushed")
        update = self._update
        if update is not None and sched.holds_kv():
            self._update = None
            self._refuse_update(update, self._kept_in_place())
        self._admit_held()

    def _resume(self, msg: PauseReqMsg) -> None:
        if self._pausing is not None:
            self._reply_pause(self._pausing, False, "resumed before its requests ended")
            self._pausing = None
        was, self._paused = self._paused, None
        if was is not None:
            logger.info("generation resumed (paused in mode %s)", was)
        self._admit_held()
        self._reply_pause(msg, True, "", len(self.table.active))

    def _reply_pause(self, msg: PauseReqMsg, ok: bool, note: str, count: int = 0) -> None:
        reply = PauseRespMsg(msg.request_id, msg.router_id, self.worker_id, ok, note, count)
        self.link.publish(router_out_stream(self.prefix, msg.router_id), reply)

    def _kept_in_place(self) -> str:
        return (f"generation is paused in place (mode {self._paused}) with requests holding "
                "the current weights' K/V: pause in mode abort, retract or wait to update the "
                "weights, or resume first")  # fmt: skip

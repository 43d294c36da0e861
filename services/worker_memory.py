"""A worker's device memory given back while idle and taken again (SGLang's
`/release_memory_occupation` and `/resume_memory_occupation`, vLLM's `/sleep` and `/wake_up`;
services/router_memory.py): a `MemoryReqMsg` releases or resumes the memory of its tags
(engine/scheduler/memory_release.py), refused with the reason while a request holds K/V.
While weights or K/V are released the worker does not step (`Worker._stepping`): new
requests wait in the queue, aborts end them at once, and a weights update goes on at once
(it takes the weights back). A mixin of `Worker` (services/worker.py).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from shared.keys import router_out_stream
from shared.messages import MemoryReqMsg, MemoryRespMsg

if TYPE_CHECKING:
    from engine.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


class MemoryHandling:
    scheduler: Scheduler
    link: Any
    prefix: str
    worker_id: str
    _events_waiting: bool

    def _on_memory(self, msg: MemoryReqMsg) -> None:
        sched = self.scheduler
        tags = msg.tags or None
        try:
            if msg.action == "release":
                backup = msg.backup_weights
                if backup is None:
                    backup = sched.args.enable_weights_cpu_backup
                num_bytes = sched.release_memory_occupation(tags, backup)
            else:
                num_bytes = sched.resume_memory_occupation(tags)
        except ValueError as exc:
            self._reply_memory(msg, False, str(exc), 0)
            return
        finally:
            self._events_waiting = True  # (a release settles: the batch in flight's tokens)
        logger.info("memory %s (%s): %.1f MB; released now: %s", msg.action,
                    ", ".join(msg.tags) or "all", num_bytes / 2**20,
                    ", ".join(sorted(sched.released_memory)) or "none")  # fmt: skip
        self._reply_memory(msg, True, "", num_bytes)

    def _reply_memory(self, msg: MemoryReqMsg, ok: bool, note: str, num_bytes: int) -> None:
        released = sorted(self.scheduler.released_memory)
        reply = MemoryRespMsg(
            msg.request_id, msg.router_id, self.worker_id, ok, note, released, num_bytes
        )
        self.link.publish(router_out_stream(self.prefix, msg.router_id), reply)

"""A worker's weights replaced while it serves (a mixin of `Worker`, services/worker.py):
another checkpoint's (`UpdateWeightsReqMsg`, SGLang's `/update_weights_from_disk`), or the
tensors an RL trainer broadcasts through a process group the worker joined
(`WeightsGroupReqMsg`, `DistributedWeightsReqMsg`: SGLang's `/init_weights_update_group`,
`/update_weights_from_distributed`, `/destroy_weights_update_group`; engine/weight_groups.py).

An update holds new requests back, lets the running ones finish (or aborts them first with
`abort_all_requests`), then replaces the weights between steps and admits the requests held
(a paused worker, or one with its memory released, updates at once when no request holds
K/V). A refused update of broadcast tensors still receives them: the trainer's broadcast
would otherwise wait out its timeout. Joining a group blocks the scheduler's loop until the
trainer's side comes (or `timeout_s`): the heartbeat goes on meanwhile (the I/O process).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from services.worker_load import other_checkpoint
from shared.keys import router_out_stream
from shared.messages import (
    DistributedWeightsReqMsg,
    UpdateWeightsReqMsg,
    UpdateWeightsRespMsg,
    WeightsGroupReqMsg,
    WeightsReadReqMsg,
    WeightsReadRespMsg,
)

if TYPE_CHECKING:
    from engine.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

WeightsUpdate = UpdateWeightsReqMsg | DistributedWeightsReqMsg


class WeightsHandling:
    scheduler: Scheduler
    link: Any
    prefix: str
    worker_id: str
    model: str
    table: Any
    _update: WeightsUpdate | None
    _held: list
    _paused: str | None
    _stepping: Any
    _abort_all: Any
    _admit_held: Any
    _kept_in_place: Any

    def _on_update_weights(self, msg: WeightsUpdate) -> None:
        """Hold new requests back until the running ones have ended (aborted with
        `abort_all_requests`); the update itself is `_update_weights`, once idle."""
        if self._update is not None:
            why = f"an update of the weights ({_what(self._update)}) is in progress"
            self._refuse_update(msg, why)
            return
        logger.info("weights update %s: waiting for %d running request(s)%s", _what(msg),
                    len(self.table.active),
                    " (aborting them)" if msg.abort_all_requests else "")  # fmt: skip
        if msg.abort_all_requests:
            self._abort_all("aborted: the weights are being updated")
        if self._paused is not None and self.scheduler.holds_kv():
            self._refuse_update(msg, self._kept_in_place())
            return
        self._update = msg

    def _update_ready(self) -> bool:
        """Whether the update waiting may go on: idle, or paused (or with memory released)
        with no request holding the current weights' K/V (waiting ones then run on the new
        weights)."""
        if not self._stepping():
            return not self.scheduler.holds_kv()
        return not self.scheduler.has_work()

    def _update_weights(self) -> None:
        msg, self._update = self._update, None
        assert msg is not None
        sched = self.scheduler
        if isinstance(msg, DistributedWeightsReqMsg):
            ok, note = attempt(sched.update_weights_from_distributed, msg.names, msg.dtypes,
                               msg.shapes, msg.group_name, msg.flush_cache,
                               msg.load_format == "flattened_bucket")  # fmt: skip
        else:
            ok, note = attempt(sched.update_weights_from_disk, msg.model_path)
            if ok:
                self.link.facts(weights_path=other_checkpoint(sched.weights_path, self.model))
        self._reply_update(msg, ok, note, len(self._held))
        self._admit_held()

    def _refuse_update(self, msg: WeightsUpdate, why: str) -> None:
        """Answer `msg` with a refusal; broadcast tensors are received first (and dropped)."""
        if isinstance(msg, DistributedWeightsReqMsg):
            self.scheduler.discard_distributed(msg.names, msg.dtypes, msg.shapes, msg.group_name,
                                               msg.load_format == "flattened_bucket")  # fmt: skip
        self._reply_update(msg, False, why, 0)

    def _reply_update(
        self, msg: WeightsUpdate | WeightsGroupReqMsg, ok: bool, note: str, paused: int
    ) -> None:
        reply = UpdateWeightsRespMsg(
            msg.request_id, msg.router_id, self.worker_id, ok, note, paused,
            self.scheduler.weights_path,
        )  # fmt: skip
        self.link.publish(router_out_stream(self.prefix, msg.router_id), reply)

    def _on_weights_group(self, msg: WeightsGroupReqMsg) -> None:
        """Join the trainer's group as this worker's rank in `msg.ranks` (blocks until every
        rank has, or `timeout_s`), or leave it."""
        sched = self.scheduler
        if msg.action == "destroy":
            ok, note = attempt(sched.destroy_weights_update_group, msg.group_name)
        elif self.worker_id not in msg.ranks:
            ok, note = False, f"no rank for worker {self.worker_id} in the group"
        else:
            rank = msg.ranks[self.worker_id]
            logger.info("joining weights update group %r at %s:%d as rank %d of %d (%s)",
                        msg.group_name, msg.master_address, msg.master_port, rank,
                        msg.world_size, msg.backend)  # fmt: skip
            ok, note = attempt(sched.init_weights_update_group, msg.master_address,
                                msg.master_port, rank, msg.world_size, msg.group_name,
                                msg.backend, msg.timeout_s)  # fmt: skip
        self._reply_update(msg, ok, note, 0)


    def _on_weights_read(self, msg: WeightsReadReqMsg) -> None:
        """The served values of a weight, read back (between steps, where the model is)."""
        ok, note, values = attempt_value(self.scheduler.get_weights_by_name, msg.name,
                                         msg.truncate_size)  # fmt: skip
        reply = WeightsReadRespMsg(msg.request_id, msg.router_id, self.worker_id, ok, note,
                                   values or [])  # fmt: skip
        self.link.publish(router_out_stream(self.prefix, msg.router_id), reply)


def _what(msg: WeightsUpdate) -> str:
    if isinstance(msg, DistributedWeightsReqMsg):
        return f"of {len(msg.names)} tensor(s) broadcast in group {msg.group_name!r}"
    return f"to {msg.model_path}"


def attempt(change: Any, *args: Any) -> tuple[bool, str]:
    """Run a change to the model (a LoRA load, a weights update): (True, "") or (False, why).
    A ValueError is a refusal; anything else is logged too; the worker goes on either way."""
    return attempt_value(change, *args)[:2]


def attempt_value(call: Any, *args: Any) -> tuple[bool, str, Any]:
    """`attempt`, with `call`'s result (None if it failed)."""
    try:
        result = call(*args)
    except Exception as exc:  # noqa: BLE001 - answered with the reason
        if not isinstance(exc, ValueError):
            logger.exception("%s%r", call.__name__, args)
        return False, str(exc), None
    return True, "", result

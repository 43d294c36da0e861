"""What a paused scheduler needs (SGLang's `/pause_generation`, vLLM's `/pause`; the worker
pauses by not stepping, services/worker.py): bringing the requests to rest between steps, and
the three things done to them at rest: ending those aborted meanwhile, sending the running
ones back to waiting, and telling whether any still holds K/V (a weights update may go on
with requests waiting, not with requests holding the old weights' K/V).

At rest (`settle`) nothing is in flight and no prefill batch is left to fold: every live
request is waiting (or compiling its grammar), running with all its tokens on the host, or
the chunked one, whose computed part is in the prefix cache. A mixin of `Scheduler`
(engine/scheduler/scheduler.py), which owns that state; the overlap scheduler first processes
the batch it has in flight.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.scheduler.output_processor import StepEvent

if TYPE_CHECKING:
    from engine.scheduler.output_processor import OutputProcessor
    from engine.scheduler.req import Req
    from engine.scheduler.schedule_batch import ScheduleBatch


class Pausing:
    tree_cache: Any
    stats: Any
    output: OutputProcessor
    waiting_queue: list[Req]
    running_batch: ScheduleBatch
    last_batch: ScheduleBatch | None
    chunked_req: Req | None
    _fold_last_batch: Any
    _update_stats: Any

    def settle(self) -> None:
        """Bring the requests to rest (see the module doc); their events (tokens of a batch
        that was in flight) are the output's, as after a step. Idempotent."""
        self._fold_last_batch()
        self.last_batch = None
        self._update_stats()

    def holds_kv(self) -> bool:
        """Whether a request holds K/V: running, prefilled in part, or in a batch not folded
        yet (or in flight). Waiting requests and those compiling a grammar hold none."""
        if self.chunked_req is not None:
            return True
        batches = [self.running_batch] + ([self.last_batch] if self.last_batch else [])
        return any(not r.finished for b in batches for r in b.reqs)

    def end_aborted(self) -> int:
        """Settle, then end now the requests marked to abort that hold K/V, as their next step
        would (what they computed goes into the prefix cache; their final events are the
        output's). A paused scheduler steps no more, so its aborts end here. How many."""
        self.settle()
        ended = self._take_held(lambda r: r.to_abort is not None)
        for req in ended:
            req.finished_reason = req.to_abort
            self._cache_computed(req)
            self.output.emit(StepEvent(req, [], len(req.output_ids), req.finished_reason))
        self._update_stats()
        return len(ended)

    def retract_all(self) -> int:
        """SGLang's pause mode "retract": settle, end the requests marked to abort, and send
        every other running request (and the chunked one) back to the front of the waiting
        queue, in order, holding nothing. Unlike a retraction for memory, what each computed
        goes into the prefix cache first: unless evicted or flushed (a weights update
        flushes), its re-prefill is a cache hit of all but its last token. How many."""
        self.end_aborted()
        retracted = self._take_held(lambda r: True)
        for req in retracted:
            self._cache_computed(req)
            req.reset_for_retract()
        self.waiting_queue[:0] = retracted
        self.stats.num_retractions += len(retracted)
        self._update_stats()
        return len(retracted)

    def _take_held(self, which: Any) -> list[Req]:
        """Take the unfinished requests holding K/V (settled: the running batch and the
        chunked one) for which `which(req)` holds out of the batch."""
        taken = [r for r in self.running_batch.reqs if not r.finished and which(r)]
        if taken:
            gone = {id(r) for r in taken}
            self.running_batch.reqs = [r for r in self.running_batch.reqs if id(r) not in gone]
        chunked = self.chunked_req
        if chunked is not None and which(chunked):
            taken.append(chunked)
            self.chunked_req = None
        return taken

    def _cache_computed(self, req: Req) -> None:
        """Give back what `req` holds, its computed tokens into the prefix cache (its KV is
        complete: nothing of it is in flight once settled)."""
        req.fill_ids = req.all_ids()[: req.kv_allocated_len]
        self.tree_cache.cache_finished_req(req)

"""The scheduler: continuous batching with chunked prefill over a radix prefix cache.

One iteration (`step`): pick the next batch (a prefill batch if any waiting request can be
admitted, else the running decode batch), run it on the model runner, process its results
(append tokens, check finish conditions, update the cache). The overlap scheduler reorders
the last two parts; everything else is shared. What arrives and leaves between steps
(new requests, aborts, cache flushes, grammar masks) is `RequestIntake`'s
(engine/scheduler/request_intake.py); what a paused worker does to the requests between
steps is `Pausing`'s (engine/scheduler/pausing.py), and the device memory it gives back
while idle `MemoryRelease`'s (engine/scheduler/memory_release.py).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

from engine.config import EngineArgs
from engine.forward_batch import ForwardMode
from engine.lora import lora_rank, read_adapter_specs
from engine.lora.registry import LoRARegistry
from engine.scheduler.grammar_queue import GrammarQueue
from engine.scheduler.memory_release import MemoryRelease
from engine.scheduler.model_updates import ModelUpdates
from engine.scheduler.output_processor import OutputProcessor, StepEvent
from engine.scheduler.pausing import Pausing
from engine.scheduler.pools import MemoryPools
from engine.scheduler.prefill_adder import AddResult, PrefillAdder
from engine.scheduler.req import Req
from engine.scheduler.request_intake import RequestIntake
from engine.scheduler.schedule_batch import ScheduleBatch
from engine.scheduler.schedule_policy import SchedulePolicy
from engine.speculative.scheduling import make_drafter

logger = logging.getLogger(__name__)
_FINISHED_REASON = attrgetter("finished_reason")  # (read of every running request, every step)


@dataclass
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    token_usage: float = 0.0
    new_token_ratio: float = 0.0
    num_retractions: int = 0
    cache_hit_tokens: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_finished: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class Scheduler(RequestIntake, ModelUpdates, Pausing, MemoryRelease):
    def __init__(
        self,
        args: EngineArgs,
        model_runner: Any,
        tree_cache: Any,
        tokenizer: Any | None = None,
    ) -> None:
        self.args = args
        self.model_runner = model_runner
        self.context_len = model_runner.model_config.context_len
        self.eos_token_ids = tuple(model_runner.model_config.eos_token_ids)
        self.pools = MemoryPools(
            model_runner.req_to_token_pool,
            model_runner.allocator,
            tree_cache,
            args.page_size,
            getattr(model_runner, "swa_window", None),
        )
        self.tree_cache = tree_cache
        specs = read_adapter_specs(args.lora_paths)
        rank = lora_rank(args, specs) if args.lora_enabled else None
        self.loras = LoRARegistry(specs, args.lora_enabled, rank)
        self.lora_ids = self.loras.ids  # name -> id of the adapters served now (the same dict)
        self.weights_path = getattr(model_runner, "weights_path", "")  # (the checkpoint)
        self.released_memory: frozenset[str] = frozenset()  # (engine/memory_occupation.py)
        # checkpoint tensors discarded and not sent again (engine/runner_weights.py)
        self.weights_missing = 0
        sign = (1 if args.schedule_low_priority_values_first else -1) * (
            args.enable_priority_scheduling
        )
        self.policy = SchedulePolicy(args.schedule_policy, tree_cache, args.random_seed, sign)
        self.waiting_queue: list[Req] = []
        self.running_batch = ScheduleBatch([], self.pools, ForwardMode.DECODE)
        self.chunked_req: Req | None = None
        self.last_batch: ScheduleBatch | None = None
        self.new_token_ratio = args.init_new_token_ratio
        self.stats = SchedulerStats()
        self.output = OutputProcessor(self, tokenizer)
        self.tokenizer = tokenizer
        # requests whose grammar compiles (the backend is built for the first of them)
        self.grammar_queue = GrammarQueue(self._make_grammar_backend, args.grammar_compile_threads)
        self._constrained: set[Req] = set()  # unfinished requests with a grammar
        self._rejected: list[tuple[str, str]] = []  # (rid, why) not taken yet
        self._arrival = itertools.count()
        chunk = args.chunked_prefill_size
        self.chunked_prefill_size = None if chunk is None or chunk < 0 else chunk
        self.drafter = make_drafter(args, model_runner, self.context_len)
        self.max_running_requests = min(
            args.max_running_requests, self.pools.req_to_token_pool.size - 1
        )

    # -- one iteration --------------------------------------------------------------------------
    def step(self) -> list[StepEvent]:
        """Run one batch and return what happened to requests (new tokens, finishes)."""
        batch = self.get_next_batch_to_run()
        if batch is not None:
            result = self.run_batch(batch)
            self.output.process_batch_result(batch, result)
        else:
            self.idle()
        self.last_batch = batch
        self.release_loras()
        self._update_stats()
        return self.output.take_events()

    def close(self) -> None:
        self.grammar_queue.close()
        if self.drafter is not None:
            self.drafter.close()

    def idle(self) -> None:
        """Nothing to run: read the allocator's deferred checks (the device has no batch to
        finish first), then wait briefly on compiling grammars."""
        self.pools.allocator.verify()
        self.wait_for_grammars()

    def run_batch(self, batch: ScheduleBatch) -> Any:
        mwb = batch.get_model_worker_batch()
        if self._constrained:
            mwb.vocab_mask = self.vocab_mask(batch.reqs)
        return self.model_runner.forward_batch_generation(mwb)

    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        if len(self.grammar_queue):
            self._admit_compiled()
        self._fold_last_batch()
        prefill = self.get_new_batch_prefill()
        if prefill is not None:
            return prefill
        return self.update_running_batch()

    def _fold_last_batch(self) -> None:
        """A prefill batch just run joins the running batch (its chunked request apart)."""
        last = self.last_batch
        if last is not None and last.forward_mode.is_extend():
            if self.chunked_req is not None:
                self._finish_chunk(last)
            last.filter()
            if not last.is_empty():
                self.running_batch.merge(last)

    def _finish_chunk(self, last: ScheduleBatch) -> None:
        """The chunk just run leaves the request partly prefilled: share what is computed with
        the cache and keep it out of the decode batch."""
        req = self.chunked_req
        last.filter(exclude=req)
        self.tree_cache.cache_unfinished_req(req)
        if req.to_abort is not None:
            req.finished_reason = req.to_abort
            self.tree_cache.cache_finished_req(req)
            self.output.emit(StepEvent(req, [], len(req.output_ids), req.finished_reason))
            self.chunked_req = None

    def get_new_batch_prefill(self) -> ScheduleBatch | None:
        if not self.waiting_queue and self.chunked_req is None:
            return None
        running = len(self.running_batch)
        full = running >= self.max_running_requests and self.chunked_req is None
        if full and not (self.policy.priority_sign and self._may_preempt()):
            return None
        self.policy.calc_priority(self.waiting_queue)
        preempted = self._preempt_for_priority() if self.policy.priority_sign else []
        running = len(self.running_batch)
        if running >= self.max_running_requests and self.chunked_req is None:
            self.waiting_queue.extend(preempted)
            return None
        adder = PrefillAdder(
            self.pools,
            self.running_batch.running_need_tokens(self.new_token_ratio),
            self.args.max_prefill_tokens,
            self.chunked_prefill_size,
            min(
                self.max_running_requests - running,
                self.pools.req_to_token_pool.available_size(),
            ),
            mixed_decode_tokens=running if self.args.enable_mixed_chunk else 0,
            running_swa_need=self.running_batch.running_swa_need_tokens(self.new_token_ratio),
            **self._lora_budget(),
        )
        chunked_batch_req = None
        if self.chunked_req is not None:
            chunked_batch_req = self.chunked_req
            self.chunked_req = adder.add_chunked_req(self.chunked_req)
        matched = self.policy.matched_all
        deprioritized = self.policy.deprioritized
        for req in self.waiting_queue:
            if req.rid in deprioritized and adder.can_run_list:
                continue
            if not matched or req.match_epoch != self.tree_cache.epoch:
                # (matched before a load back of an earlier request evicted device cache)
                req.init_next_round_input(self.tree_cache)
            result = adder.add_one_req(req)
            if result is AddResult.SKIP:
                continue
            if result is not AddResult.CONTINUE:
                break
        admitted = {id(r) for r in adder.can_run_list}
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in admitted]
        self.waiting_queue.extend(preempted)  # not in this batch: they just left it
        if adder.new_chunked_req is not None:
            self.chunked_req = adder.new_chunked_req
        if not adder.can_run_list:
            return None
        for req in adder.can_run_list:
            if req is not chunked_batch_req and not req.is_retracted:
                req.cached_tokens += len(req.prefix_indices)
                self.stats.cache_hit_tokens += len(req.prefix_indices)
        batch = ScheduleBatch(adder.can_run_list, self.pools, ForwardMode.EXTEND)
        batch.chunked_req = self.chunked_req
        batch.prepare_for_extend()
        if self.args.enable_mixed_chunk:
            self._mix_running_into(batch)
        return batch

    def _lora_budget(self) -> dict[str, Any]:
        """The adder's LoRA slot budget (nothing with LoRA off)."""
        if not self.loras.enabled:
            return {}
        running = {r.lora_id for r in self.running_batch.reqs}
        return {"lora_slots": self.args.max_loras_per_batch, "running_loras": running}

    def _may_preempt(self) -> bool:
        """Whether some waiting request's priority beats some running one's by more than the
        threshold (a cheap test before sorting the queue when the batch is full)."""
        rank = self.policy.rank
        best = min(map(rank, self.waiting_queue))
        running = [rank(r) for r in self.running_batch.reqs if r.finished_reason is None]
        threshold = self.args.priority_scheduling_preemption_threshold
        return bool(running) and max(running) - best > threshold

    def _preempt_for_priority(self) -> list[Req]:
        """Send running requests back to waiting for the first waiting request, if its
        priority beats theirs by more than the threshold and it cannot be admitted otherwise
        (SGLang's priority preemption). Returns them; they keep their output."""
        top = next((r for r in self.waiting_queue if not r.finished), None)
        if top is None or self.running_batch.is_empty():
            return []
        if not self.policy.matched_all:
            top.init_next_round_input(self.tree_cache)
        victims = self.policy.preemption_victims(
            top,
            self.running_batch,
            self.max_running_requests,
            self.chunked_prefill_size,
            self.new_token_ratio,
            self.args.priority_scheduling_preemption_threshold,
        )
        if victims:
            self.running_batch.retract(victims)
            self.stats.num_retractions += len(victims)  # (the overlap loop drops their rows)
            logger.info("request %s preempted %d running requests", top.rid, len(victims))
        return victims

    def _mix_running_into(self, batch: ScheduleBatch) -> None:
        """Mixed chunk: the running requests take their decode step inside the prefill batch
        instead of pausing for it. Skipped when their next KV slots cannot be had without a
        retraction (the next decode step then retracts, as usual)."""
        running = self.running_batch
        running.filter()
        if running.is_empty() or not running.check_decode_mem():
            return
        running.prepare_for_decode(self.decode_input_ids(running))
        batch.mix_with_running(running)
        self.running_batch = ScheduleBatch([], self.pools, ForwardMode.DECODE)

    def update_running_batch(self) -> ScheduleBatch | None:
        batch = self.running_batch
        batch.filter()
        if batch.is_empty():
            return None
        if not batch.check_decode_mem():
            retracted = batch.retract_decode()
            self.stats.num_retractions += len(retracted)
            self.new_token_ratio = batch.retract_new_token_ratio()
            logger.info(
                "retracted %d requests; new_token_ratio=%.3f", len(retracted), self.new_token_ratio
            )
            self.waiting_queue.extend(retracted)
        else:
            self.new_token_ratio = max(
                self.new_token_ratio - self.args.new_token_ratio_decay,
                self.args.min_new_token_ratio,
            )
        if self.drafter is None or not self.drafter.prepare(batch):
            batch.prepare_for_decode(self.decode_input_ids(batch))
        return batch

    def decode_input_ids(self, batch: ScheduleBatch) -> list[int] | None:
        """The input token of each request of the next decode step; None means each request's
        last output token. The overlap scheduler gives placeholders for tokens in flight."""
        return None

    def _update_stats(self) -> None:
        s = self.stats
        # Requests of a prefill batch (with, in a mixed batch, the decoding ones) join the
        # running batch at the next step; finished ones stay until the next step filters them.
        running = list(map(_FINISHED_REASON, self.running_batch.reqs)).count(None)
        last = self.last_batch
        if last is not None and last.forward_mode.is_extend():
            chunked = self.chunked_req
            running += sum(1 for r in last.reqs if r is not chunked and r.finished_reason is None)
        s.num_running = running + (1 if self.chunked_req else 0)
        s.num_waiting = len(self.waiting_queue) + len(self.grammar_queue)
        s.token_usage = self.pools.token_usage()
        s.new_token_ratio = self.new_token_ratio

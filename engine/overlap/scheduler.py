"""`OverlapScheduler`: the scheduler with batch N+1 launched before batch N is processed.

One step (SGLang's `event_loop_overlap`, with the device behind an `OverlapExecutor`):

    schedule batch N+1 -> launch its forward and sampling (non-blocking) -> wait for and
    process batch N's results [-> launch N+1's sampling, for a batch with a grammar]

While the device runs the forward of N+1, the host processes N (appends tokens, checks
finish conditions, updates the prefix cache) and then schedules N+2. Everything but the loop
order is the plain `Scheduler`'s. Events come out one step later.

Invariants that keep the outputs identical to the plain loop:

* Placeholders. A token that is sampled but not processed yet exists on the host only as a
  negative FutureMap id in the record of its batch and in the `input_ids` of the decode
  batch that feeds it back; never in `req.output_ids`. So max_new_tokens, stop checks,
  decoding, stop strings and prefix-cache keys (`fill_ids` come from `output_ids`) only see
  real tokens.
* Step positions (seeded sampling) count the token in flight: `len(output_ids) + 1` for a
  request with a placeholder. A sample is only kept if that token was appended (otherwise
  the request finished, was aborted or was retracted), so it always matches the plain loop.
  Penalties and bad words read the history the device keeps (penalty counts, last tokens:
  engine/sampling/penalty_slots.py): each batch's sampling adds its tokens there, and the
  next batch's, which runs after it, reads them. A grammar's token mask needs the history on
  the host: a batch with such a request is sampled after the previous batch has been
  processed, when `output_ids` is exactly its history.
* Results are processed against the batch as it was launched (`_Record`): rows of requests
  that finished while it was in flight are skipped (their extra token is dropped; their KV
  slot, counted in `kv_allocated_len`, was freed once, with the rest of the request), and
  rows of requests retracted meanwhile (their retraction count changed) are dropped (the
  request recomputes that token after its re-prefill).
* Launches run in order on the device, so KV slots and request rows freed while a batch is
  in flight are only reused by batches that run after it.
* At most two batches are alive (the record buffer): the one just launched and the one
  being processed. A launched batch whose requests all finished meanwhile is retired in the
  same step, so nothing is left in flight once every request has ended.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from engine.config import EngineArgs
from engine.forward_batch import ForwardMode
from engine.model_runner import GenerationBatchResult
from engine.overlap.executor import Launch, OverlapExecutor, create_executor
from engine.overlap.future_map import FutureMap
from engine.sampling.penalty_slots import PenaltyPlan, PenaltySlots
from engine.sampling.sampling_batch_info import SamplingBatchInfo, SamplingInfoCache
from engine.sampling.sampling_params import SamplingParams
from engine.scheduler.output_processor import StepEvent
from engine.scheduler.req import Req
from engine.scheduler.schedule_batch import ScheduleBatch
from engine.scheduler.scheduler import Scheduler


@dataclass
class _Record:
    """A launched batch as it was at launch: what its results are processed against."""

    reqs: list[Req]
    forward_mode: ForwardMode
    chunked_req: Req | None  # a partial prompt: its sampled token means nothing
    retractions: list[int]  # each request's num_retractions at launch
    placeholders: list[int]
    launch: Launch
    deferred_sampling: bool
    num_retractions: int  # the scheduler's count at launch: unchanged means none of these
    decoding_reqs: frozenset[Req] = frozenset()  # a mixed batch's decode steps
    prompts_cached: bool = False
    penalty_plan: PenaltyPlan | None = None  # its rows of the device's penalty counts

    def pending(self) -> dict[Req, int]:
        """Request -> placeholder of the token this batch samples for it."""
        out = dict(zip(self.reqs, self.placeholders))
        out.pop(self.chunked_req, None)  # type: ignore[arg-type]
        return out


class OverlapScheduler(Scheduler):
    """Drop-in for `Scheduler`: `step`, `add_request`, `abort_request`, `has_work` and
    `close` are all called from one thread (the scheduler's), between steps; only device work
    runs elsewhere (the executor's forward thread or streams). `has_work()` and `holds_kv()`
    stay true while a batch is in flight; `close()` stops the executor."""

    def __init__(
        self,
        args: EngineArgs,
        model_runner: Any,
        tree_cache: Any,
        tokenizer: Any | None = None,
        executor: OverlapExecutor | None = None,
    ) -> None:
        super().__init__(args, model_runner, tree_cache, tokenizer)
        max_bs = model_runner.req_to_token_pool.size  # no batch has more rows than the pool
        self.future_map = FutureMap(max_bs, model_runner.device)
        if executor is None and args.overlap_device_process:
            from engine.overlap.process_executor import ProcessExecutor

            executor = ProcessExecutor(model_runner, self.future_map)
        self.executor = executor or create_executor(model_runner, self.future_map)
        if getattr(model_runner, "use_cuda_graph", False):  # now, not in the first request
            model_runner.capture_cuda_graphs(self.future_map)
        self.vocab_size = model_runner.model_config.vocab_size
        self._in_flight: deque[_Record] = deque()  # the record buffer: at most two batches
        # During a step: request -> placeholder, for the batch launched by the previous step
        # (the only one not processed yet, so the only tokens the host does not have); built
        # on first use (`_placeholders`), since a decode step of the same batch needs none.
        self._pending: dict[Req, int] | None = None
        # requests whose sampling needs their history on the host: a grammar's mask is that
        # of the output so far
        self._history: set[Req] = set()
        self._penalty_slots = PenaltySlots()  # penalties, bad words: the device history
        self._seeded: set[Req] = set()  # requests whose sampling needs its step positions
        self._sampling_cache = SamplingInfoCache()

    # -- the loop -------------------------------------------------------------------------------
    def step(self) -> list[StepEvent]:
        self._pending = None
        batch = self.get_next_batch_to_run()
        record = self._launch(batch) if batch is not None else None
        if self._in_flight and self._in_flight[0] is not record:
            self._process(self._in_flight.popleft())
        if record is not None:
            if record.deferred_sampling:
                self._launch_sample(record)
            if all(r.finished for r in record.reqs):
                self._process(self._in_flight.popleft())  # nothing left to learn from it
        elif not self._in_flight:
            self.idle()
        self.last_batch = batch
        self.release_loras()
        self._update_stats()
        return self.output.take_events()

    def holds_kv(self) -> bool:
        return bool(self._in_flight) or super().holds_kv()

    def settle(self) -> None:
        """The batch in flight is processed first (its tokens are the output's events)."""
        self._pending = None
        while self._in_flight:
            self._process(self._in_flight.popleft())
        super().settle()

    def _on_device(self, method: str, *args: Any) -> Any:
        """Through the executor: after the forwards in flight, before the next."""
        return self.executor.call(method, *args)

    def placeholders_in_flight(self) -> dict[Req, int]:
        """Between steps: the requests whose next token is sampled but not processed yet."""
        return self._in_flight[-1].pending() if self._in_flight else {}

    def add_request(
        self,
        rid: str,
        input_ids: list[int],
        params: SamplingParams,
        priority: int | None = None,
        lora_name: str | None = None,
        token_type_ids: list[int] | None = None,
        cache_salt: str | None = None,
    ) -> Req:
        req = super().add_request(
            rid, input_ids, params, priority, lora_name, token_type_ids, cache_salt
        )
        if params.needs_history:
            self._history.add(req)
        if params.has_device_history:
            self._penalty_slots.add(req)
        if params.sampling_seed is not None or params.min_new_tokens > 0:
            self._seeded.add(req)
        return req

    def close(self) -> None:
        """Stop the executor (the forward thread on CPU). Results in flight are dropped."""
        self.executor.close()
        self._in_flight.clear()
        super().close()

    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        record = self._in_flight[-1] if self._in_flight else None  # the last batch launched
        if record is not None and record.forward_mode.is_extend():
            self._cache_prompts(record)
        return super().get_next_batch_to_run()

    def _cache_prompts(self, record: _Record) -> None:
        """Share the prompts of the prefill in flight with the prefix cache now, as the plain
        loop has by this point, rather than when its results are processed a step later:
        requests held back to hit a prefix shared with it are admitted next and should hit
        it. Only prompt tokens (and, after a retraction, real output tokens) are inserted;
        their KV is written by the batch in flight, before any later batch reads it. The
        chunked request is the base class's (`_finish_chunk`)."""
        for req in record.reqs:
            if req is not record.chunked_req and not req.finished:
                if req not in record.decoding_reqs:
                    self.tree_cache.cache_unfinished_req(req)
        record.prompts_cached = True  # processing its results need not do it again

    def decode_input_ids(self, batch: ScheduleBatch) -> list[int]:
        record = self._in_flight[-1] if self._in_flight else None
        if record is not None and record.chunked_req is None and batch.reqs == record.reqs:
            return list(record.placeholders)  # the batch in flight again: all its tokens are
        pending = self._placeholders()
        return [pending[r] if r in pending else r.output_ids[-1] for r in batch.reqs]

    def _placeholders(self) -> dict[Req, int]:
        """`placeholders_in_flight()` as of the start of this step."""
        if self._pending is None:
            self._pending = self.placeholders_in_flight()
        return self._pending

    # -- launch ---------------------------------------------------------------------------------
    def _launch(self, batch: ScheduleBatch) -> _Record:
        reqs = batch.reqs
        chunked = getattr(batch, "chunked_req", None) if batch.forward_mode.is_extend() else None
        deferred = False
        if self._history:
            self._history = {r for r in self._history if not r.finished}
            deferred = any(r in self._history for r in reqs)
        plan = self._penalty_slots.plan(reqs, chunked) if self._penalty_slots else None
        info = None
        if not deferred:
            positions = None  # only seeded rows read them
            if self._seeded:
                self._seeded = {r for r in self._seeded if not r.finished}
            if self._seeded:
                pending = self._placeholders()
                positions = [len(r.output_ids) + (r in pending) for r in reqs]
            info = self._sampling_info(reqs, positions, plan)
        slots = self.future_map.alloc_future_indices(len(reqs))
        launch = self.executor.launch_forward(batch.get_model_worker_batch(), slots, info)
        record = _Record(
            list(reqs),
            batch.forward_mode,
            chunked,
            [r.num_retractions for r in reqs],
            slots.placeholders(),
            launch,
            deferred,
            self.stats.num_retractions,
            batch.decoding_reqs,
            penalty_plan=plan,
        )
        self._in_flight.append(record)
        assert len(self._in_flight) <= 2, "more than two batches in flight"
        return record

    def _launch_sample(self, record: _Record) -> None:
        """Deferred sampling: every earlier batch is processed, the histories are complete."""
        reqs = record.reqs
        positions = [len(r.output_ids) for r in reqs]
        info = self._sampling_info(reqs, positions, record.penalty_plan, history=True)
        self.executor.launch_sample(record.launch, info)

    def _sampling_info(
        self,
        reqs: list[Req],
        step_positions: list[int] | None,
        penalty_plan: PenaltyPlan | None,
        history: bool = False,
    ) -> SamplingBatchInfo:
        device = self.model_runner.device
        info = self._sampling_cache.get(
            [r.sampling_params for r in reqs],
            self.vocab_size,
            device,
            penalty_plan,
            output_ids=[r.output_ids for r in reqs] if history else None,
            step_positions=step_positions,
            eos_token_ids=self.eos_token_ids,
        )
        return info.with_vocab_mask(self.vocab_mask(reqs), device) if history else info

    # -- results --------------------------------------------------------------------------------
    def _process(self, record: _Record) -> None:
        result = self.executor.wait(record.launch)
        reqs = record.reqs
        if self.stats.num_retractions != record.num_retractions:  # some may be retracted
            keep = [i for i, (r, n) in enumerate(zip(reqs, record.retractions))
                    if r.num_retractions == n]
            if len(keep) < len(reqs):
                reqs = [reqs[i] for i in keep]
                result = _select_rows(result, keep)
        batch = ScheduleBatch(reqs, self.pools, record.forward_mode)
        batch.chunked_req = record.chunked_req
        batch.prompts_cached = record.prompts_cached
        batch.decoding_reqs = record.decoding_reqs
        self.output.process_batch_result(batch, result)


def _select_rows(result: GenerationBatchResult, rows: list[int]) -> GenerationBatchResult:
    index = torch.tensor(rows, dtype=torch.int64)
    logprobs = result.logprobs
    top = result.top_logprobs
    prompt = result.prompt_logprobs
    return GenerationBatchResult(
        result.next_token_ids.index_select(0, index),
        logprobs.index_select(0, index) if logprobs is not None else None,
        [top[i] for i in rows] if top is not None else None,
        [prompt[i] for i in rows] if prompt is not None else None,
    )

"""A model runner without a model, for fast scheduler tests.

The "KV cache" stores token ids by slot. A forward writes each new token's id at its slot,
then predicts for every request from the ids read back through `req_to_token` — so a wrong
slot anywhere (prefix sharing, chunking, paging, retraction, eviction) changes the output.
The prediction is a hash of the whole sequence, identical whether a token was computed in a
prefill, a later chunk, a decode step or a recomputation after retraction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import EngineArgs
from engine.mem_cache.allocator import TokenToKVPoolAllocator
from engine.mem_cache.memory_pool import ReqToTokenPool
from engine.mem_cache.no_cache import NoRadixCache
from engine.mem_cache.radix_cache import RadixCache
from engine.model_runner import GenerationBatchResult
from engine.scheduler.schedule_batch import ModelWorkerBatch
from engine.scheduler.scheduler import Scheduler


@dataclass(frozen=True)
class FakeModelConfig:
    vocab_size: int = 1000
    context_len: int = 4096
    eos_token_ids: tuple[int, ...] = (2,)
    labels: tuple[str, ...] = ()  # (not a classifier)


def expected_next(ids: list[int], vocab: int) -> int:
    """The fake model's next token after `ids` (never below 3: 0-2 are special)."""
    h = 0
    for t in ids:
        h = (h * 1000003 + t + 1) % 2147483647
    return 3 + h % (vocab - 3)


class ChecksumModelRunner:
    def __init__(self, args: EngineArgs, config: FakeModelConfig | None = None) -> None:
        self.model_config = config or FakeModelConfig()
        self.args = args
        size = args.max_total_tokens or 8192
        self.req_to_token_pool = ReqToTokenPool(
            args.max_running_requests + 1, self.model_config.context_len + 8
        )
        self.allocator = TokenToKVPoolAllocator(size, args.page_size)
        self.kv_tokens = torch.full((size + args.page_size,), -1, dtype=torch.int64)
        self.num_forwards = 0
        self.forward_log: list[tuple[str, int, int]] = []  # (mode, batch size, tokens)

    def forward_batch_generation(self, mwb: ModelWorkerBatch) -> GenerationBatchResult:
        self.num_forwards += 1
        self.forward_log.append((mwb.forward_mode.name, mwb.batch_size, len(mwb.input_ids)))
        loc = mwb.out_cache_loc.to(torch.int64)
        assert (loc >= self.args.page_size).all(), "a new token was written to the padding page"
        self.kv_tokens[loc] = torch.tensor(mwb.input_ids, dtype=torch.int64)
        table = self.req_to_token_pool.req_to_token
        out = []
        for row, seq_len in zip(mwb.req_pool_indices, mwb.seq_lens):
            ids = self.kv_tokens[table[row, :seq_len].to(torch.int64)].tolist()
            assert -1 not in ids, "attention would read a slot that was never written"
            out.append(expected_next(ids, self.model_config.vocab_size))
        return GenerationBatchResult(torch.tensor(out, dtype=torch.int64))


def create_scheduler(**kwargs: object) -> Scheduler:
    """A scheduler over the checksum runner; kwargs are EngineArgs fields."""
    kwargs.setdefault("disable_overlap_schedule", True)
    args = EngineArgs.from_kwargs(model_path="<fake>", **kwargs)
    runner = ChecksumModelRunner(args)
    cache_cls = NoRadixCache if args.disable_radix_cache else RadixCache
    cache = cache_cls(runner.req_to_token_pool, runner.allocator, args.page_size)
    return Scheduler(args, runner, cache)


def expected_output(prompt: list[int], max_new_tokens: int, vocab: int = 1000) -> list[int]:
    ids = list(prompt)
    out = []
    for _ in range(max_new_tokens):
        ids.append(expected_next(ids, vocab))
        out.append(ids[-1])
    return out

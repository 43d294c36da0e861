"""Decode and verify batches built straight on a model runner's pools, eager forwards that leave
its KV pool as they found it (what the CUDA-graph tests, CPU and GPU, compare replays with), and
the strict eager graph double."""

from __future__ import annotations

import random

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from engine.forward_batch import ForwardBatch, ForwardMode
from engine.model_runner import ModelRunner


def decode_batch(
    runner: ModelRunner, rows: list[int], seq_lens: list[int], seed: int = 0
) -> ForwardBatch:
    """Request `rows[i]` has `seq_lens[i]` tokens (the last one new) in distinct random slots."""
    rng = random.Random(seed)
    table = runner.req_to_token_pool.req_to_token
    slots = rng.sample(range(1, runner.max_total_tokens), sum(seq_lens))
    for row, seq_len in zip(rows, seq_lens):
        table[row, :seq_len] = torch.tensor(slots[:seq_len], dtype=torch.int32, device=table.device)
        del slots[:seq_len]
    i64 = lambda xs: torch.tensor(xs, dtype=torch.int64, device=table.device)  # noqa: E731
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=len(rows),
        input_ids=i64([rng.randrange(8, runner.model_config.vocab_size) for _ in rows]),
        positions=i64([n - 1 for n in seq_lens]),
        out_cache_loc=table[rows, [n - 1 for n in seq_lens]].to(torch.int64),
        req_pool_indices=i64(rows),
        seq_lens=i64(seq_lens),
        seq_lens_cpu=list(seq_lens),
        req_to_token=table,
        kv_pool=runner.kv_pool,
        attn_backend=runner.attn_backend,
    )


def verify_batch(
    runner: ModelRunner, rows: list[int], prefix_lens: list[int], draft_lens: list[int],
    seed: int = 0,
) -> ForwardBatch:
    """A speculative verify step: request `rows[i]` has `prefix_lens[i]` cached tokens and
    1 + `draft_lens[i]` new ones (its last token and drafts), all in distinct random slots."""
    rng = random.Random(seed)
    table = runner.req_to_token_pool.req_to_token
    seq_lens = [p + 1 + k for p, k in zip(prefix_lens, draft_lens, strict=True)]
    slots = rng.sample(range(1, runner.max_total_tokens), sum(seq_lens))
    out_cache_loc, positions = [], []
    for row, prefix, seq_len in zip(rows, prefix_lens, seq_lens):
        table[row, :seq_len] = torch.tensor(slots[:seq_len], dtype=torch.int32, device=table.device)
        out_cache_loc += slots[prefix:seq_len]
        positions += range(prefix, seq_len)
        del slots[:seq_len]
    i64 = lambda xs: torch.tensor(xs, dtype=torch.int64, device=table.device)  # noqa: E731
    extend = [1 + k for k in draft_lens]
    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=len(rows),
        input_ids=i64([rng.randrange(8, runner.model_config.vocab_size) for _ in positions]),
        positions=i64(positions),
        out_cache_loc=i64(out_cache_loc),
        req_pool_indices=i64(rows),
        seq_lens=i64(seq_lens),
        seq_lens_cpu=seq_lens,
        req_to_token=table,
        kv_pool=runner.kv_pool,
        attn_backend=runner.attn_backend,
        extend_prefix_lens_cpu=list(prefix_lens),
        extend_seq_lens_cpu=extend,
        extend_start_loc=i64([sum(extend[:i]) for i in range(len(extend))]),
        extend_seq_lens=i64(extend),
        return_all_logits=True,
        spec_draft_lens=list(draft_lens),
    )


def kv_snapshot(runner: ModelRunner) -> list[torch.Tensor]:
    return [b.clone() for b in runner.kv_pool.k_buffer + runner.kv_pool.v_buffer]


def kv_restore(runner: ModelRunner, kv: list[torch.Tensor]) -> None:
    for buf, saved in zip(runner.kv_pool.k_buffer + runner.kv_pool.v_buffer, kv):
        buf.copy_(saved)


def eager_forward(
    runner: ModelRunner, fb: ForwardBatch
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Logits and the KV pool after an eager forward, the pool left as it was."""
    saved = kv_snapshot(runner)
    runner.attn_backend.init_forward_metadata(fb)
    with torch.inference_mode():
        logits = runner.model(fb.input_ids, fb.positions, fb).clone()
    after = kv_snapshot(runner)
    kv_restore(runner, saved)
    return logits, after


class OpLog(TorchDispatchMode):
    """The torch ops run under it, each with its arguments' shapes, dtypes and scalars."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops.append((func, tree_map(_signature, args), tree_map(_signature, kwargs)))
        return func(*args, **kwargs)


def _signature(x: object) -> object:
    if isinstance(x, torch.Tensor):
        return x.shape, x.dtype
    if x is None or isinstance(x, (bool, int, float, str, torch.dtype, torch.device)):
        return x
    return type(x).__name__  # e.g. the storages the Triton interpreter copies through


class StrictEagerCapturer:
    """The eager double, plus a rule of real graphs that an eager replay would not enforce:
    every replay runs the captured ops with the captured shapes and scalar arguments, whatever
    the host values (`seq_lens_cpu`, ...) of the new batch. (Triton launches are not torch
    ops; their grids depend on the batch size only.)"""

    def capture(self, step):
        with OpLog() as log:
            step()
        return _CheckedGraph(step, log.ops)


class _CheckedGraph:
    def __init__(self, step, ops: list[tuple]) -> None:
        self.step, self.ops, self.num_replays = step, ops, 0

    def replay(self) -> None:
        self.num_replays += 1
        with OpLog() as log:
            self.step()
        assert log.ops == self.ops, "a replay ran other ops than the capture"

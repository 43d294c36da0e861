"""Decode batches built straight on a model runner's pools, and eager forwards that leave
its KV pool as they found it: what the CUDA-graph tests (CPU and GPU) compare replays with."""

from __future__ import annotations

import random

import torch

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

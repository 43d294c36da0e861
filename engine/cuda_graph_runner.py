"""Decode forwards replayed from CUDA graphs, one graph per captured batch size.

A decode step of a small batch launches hundreds of small kernels; on a GPU the host's launch
time then exceeds the device's compute. A CUDA graph records a step's launches once and
replays them with one call. A graph replays exactly what it recorded (the same kernels, the
same shapes, the same device addresses), hence the layout here:

* static buffers of `max_bs` rows: `input_ids`, `positions`, `out_cache_loc`,
  `req_pool_indices`, `seq_lens` (int64; the rows of one tensor, `static_rows`, loaded with
  two copies), and `logits` [max_bs, width] in the model's dtype (float32 with a soft cap
  or for a float64 model: `LogitsProcessor.graph_logits_dtype`; a 16-bit model's rows are
  ROW_MULTIPLE-padded where its lm_head pads, engine/layers/logits.py). The graph of
  size `bs` reads and writes their first `bs` rows; the model reads the KV pool and the pool's
  `req_to_token` (fixed tensors) and the attention backend's graph state
  (`AttentionBackend.init_cuda_graph_state`), part of which the graph may compute itself
  before the layers (`AttentionBackend.cuda_graph_prologue`: flashinfer's page ids);
* a batch of `n` requests replays the graph of the smallest captured size `bs >= n`. Rows
  `n..bs-1` are padding: input id 0 at position 0, written to KV slot 0 (never handed out),
  attending over `cuda_graph_seq_len_fill_value` keys of the model runner's padding row of
  `req_to_token` (a row no request owns; all its entries are slot 0). Rows never mix in a
  decode forward, so padding cannot change a real row's logits;
* the logits are written inside the graph into the static `logits` (the lm_head's matmul
  writes them there: `ForwardBatch.logits_out`; no float32 copy is made), and `replay`
  returns a view of its first `n` rows and `vocab` columns, valid until the next replay.
  The sampler reads 16-bit rows as they are (greedy: their argmax) or converts them. Device work is
  stream-ordered, so anything enqueued before the next replay (sampling) reads this step's
  values. The one buffer bounds the graphs' output memory: the graphs share one memory pool
  (captured largest first, so the smaller ones reuse its blocks), and outputs left alive in
  the pool would add up to sum(sizes) x vocab.

FutureMap: a runner is bound to at most one `FutureMap` for its lifetime (`future_map`, given
at construction). When bound, every graph starts by resolving the placeholders of the static
`input_ids` from that map (`FutureMap.resolve_future`: a Triton kernel on CUDA whose grid
depends on `bs` only and whose buffer never moves), so `replay` copies the raw ids, negative
placeholders included. Resolution of ids that are all real is a no-op, so a bound runner
also serves batches without a map. The overlap scheduler creates its map after the model
runner; the model runner therefore captures at its first forward that brings a map it has
not seen (see `ModelRunner.forward`).

The capture mechanism is a seam (`GraphCapturer`): `CudaGraphCapturer` records real graphs;
`EagerGraphCapturer` "captures" by keeping the step function and "replays" by running it
again on the static buffers, which lets CPU tests run the whole replay path (buffers, padding,
backend metadata hooks, in-graph resolution).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from engine.forward_batch import ForwardBatch, ForwardMode
from engine.layers.logits import logits_width

if TYPE_CHECKING:
    from engine.overlap.future_map import FutureMap


class Graph(Protocol):
    def replay(self) -> None: ...


class GraphCapturer(Protocol):
    def capture(self, step: Callable[[], None]) -> Graph:
        """Record `step` (which reads and writes only long-lived tensors) as a graph."""
        ...


class CudaGraphCapturer:
    """torch.cuda graphs on a side stream, all in one memory pool.

    Before each capture `step` runs `num_warmups` times on the capture stream, as torch
    requires: that compiles the Triton kernels of this batch size (their specialisation
    depends on integer arguments such as the number of tokens) and lets cuBLAS set up its
    workspace for the stream, neither of which may happen during capture.
    """

    def __init__(self, device: torch.device | str, num_warmups: int = 2) -> None:
        self.device = torch.device(device)
        self.num_warmups = num_warmups
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(self.device)

    def capture(self, step: Callable[[], None]) -> Graph:
        with torch.cuda.device(self.device):
            # the static buffers were filled on the current stream
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                for _ in range(self.num_warmups):
                    step()
            graph = torch.cuda.CUDAGraph()
            # torch.cuda.graph synchronizes the device first (the warm-ups are done)
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                step()
            torch.cuda.current_stream().wait_stream(self.stream)
        return graph


class EagerGraphCapturer:
    """The CPU stand-in for `CudaGraphCapturer`: the "graph" runs `step` again on replay.

    Unlike a real graph it re-runs the step's Python, so it cannot catch a step that depends
    on host values; it does run every device-side path of the runner exactly as a replay.
    """

    def capture(self, step: Callable[[], None]) -> Graph:
        step()  # the warm-up
        return _EagerGraph(step)


class _EagerGraph:
    def __init__(self, step: Callable[[], None]) -> None:
        self.step = step
        self.num_replays = 0

    def replay(self) -> None:
        self.num_replays += 1
        self.step()


class CudaGraphRunner:
    """Decode graphs of a model runner for the sizes `batch_sizes` (see the module docstring).

    `can_run(forward_batch, future_map)` says whether a batch can be replayed;
    `replay(forward_batch)` returns its logits [n, vocab] (a view, valid until the next
    replay). `capture()` records every size, largest first.
    """

    def __init__(
        self,
        model_runner: Any,
        batch_sizes: Sequence[int],
        future_map: FutureMap | None = None,
        capturer: GraphCapturer | None = None,
    ) -> None:
        if not batch_sizes or min(batch_sizes) < 1:
            raise ValueError(f"CudaGraphRunner: batch sizes must be >= 1, got {batch_sizes}")
        self.model = model_runner.model
        self.backend = model_runner.attn_backend
        self.kv_pool = model_runner.kv_pool
        self.req_to_token: torch.Tensor = model_runner.req_to_token_pool.req_to_token
        self.padding_req_row: int = model_runner.padding_req_row
        self.future_map = future_map
        self.batch_sizes = sorted(set(batch_sizes))
        self.max_bs = self.batch_sizes[-1]
        self.capturer = capturer or CudaGraphCapturer(model_runner.device)
        self.seq_len_fill_value = self.backend.cuda_graph_seq_len_fill_value
        self.graphs: dict[int, Graph] = {}
        device = model_runner.device
        vocab_size = model_runner.model_config.vocab_size
        with torch.inference_mode():
            # the int64 inputs are the rows of one tensor, in `ForwardBatch.decode_rows`'
            # order then out_cache_loc: a replay loads them with one or two copies, and pads
            # them with one more (from `padding`, every row's padding value)
            fill = [self.padding_req_row, self.seq_len_fill_value, 0, 0, 0]
            self.padding = torch.tensor(fill, dtype=torch.int64, device=device)[:, None].expand(
                5, self.max_bs
            )
            self.static_rows = self.padding.contiguous()
            (self.req_pool_indices, self.seq_lens, self.input_ids, self.positions,
             self.out_cache_loc) = self.static_rows.unbind(0)  # fmt: skip
            self.vocab_size = vocab_size
            dtype = _logits_dtype(model_runner)
            width = logits_width(dtype, vocab_size)  # (the lm_head's padded rows, if it pads)
            self.logits = torch.zeros(self.max_bs, width, dtype=dtype, device=device)
            # an EAGLE head's decode forwards: the hidden states each row reads (its own
            # previous output) and those it leaves (engine/models/llama_eagle.py)
            hidden = getattr(self.model, "decode_hidden_width", None)
            self.spec_hidden = self.spec_hidden_out = None
            if hidden is not None:
                self.spec_hidden = torch.zeros(self.max_bs, hidden, dtype=model_runner.dtype,
                                               device=device)  # fmt: skip
                self.spec_hidden_out = torch.zeros_like(self.spec_hidden)
            self.lora, self.lora_mask = lora_graph_mask(model_runner, self.max_bs)

    # -- capture --------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        """Record one graph per size, largest first (every static row is padding now)."""
        self.backend.init_cuda_graph_state(self.max_bs, int(self.req_to_token.shape[1]))
        for bs in reversed(self.batch_sizes):
            batch = self._static_batch(bs, [self.seq_len_fill_value] * bs)
            self.backend.init_forward_metadata_capture_cuda_graph(batch)
            if self.lora is not None:  # (LoRA adapters: their layers over the static mask)
                self.lora.bind_graph_rows(self.lora_mask[:bs])
            self.graphs[bs] = self.capturer.capture(self._step(batch))

    def _step(self, batch: ForwardBatch) -> Callable[[], None]:
        """What a graph of size `batch.batch_size` records."""
        return graph_step(self, batch, self.future_map)

    # -- replay ---------------------------------------------------------------------------------
    def can_run(self, forward_batch: ForwardBatch, future_map: FutureMap | None = None) -> bool:
        fb = forward_batch
        return (
            bool(self.graphs)
            and self.backend.supports_cuda_graph
            and fb.forward_mode.is_decode()
            and 0 < fb.batch_size <= self.max_bs
            and not fb.return_all_logits
            and (future_map is None or future_map is self.future_map)
            and reads_graph_state(self, fb)
            and (fb.spec_hidden is None) == (self.spec_hidden is None)
        )

    def padded_size(self, batch_size: int) -> int:
        """The smallest captured size that holds `batch_size` rows."""
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, batch_size)]

    def lora_rows(self, forward_batch: ForwardBatch) -> tuple[torch.Tensor, int]:
        """The static LoRA mask rows the replay of `forward_batch` reads, and its tokens a
        request (`LoRAManager.prepare`)."""
        return self.lora_mask[: self.padded_size(forward_batch.batch_size)], 1

    @torch.inference_mode()
    def replay(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """Logits [n, vocab] of a batch that `can_run` (in `logits.dtype`; rows strided where
        the buffer is wider). Placeholders in its input ids are resolved by the graph (from
        the bound FutureMap)."""
        n = forward_batch.batch_size
        bs = self.padded_size(n)
        batch = self._load(forward_batch, bs)
        self.backend.init_forward_metadata_replay_cuda_graph(batch)
        self.graphs[bs].replay()
        if self.spec_hidden_out is not None:
            forward_batch.spec_hidden_out = self.spec_hidden_out[:n]
        return self.logits[:n, : self.vocab_size]

    def _load(self, forward_batch: ForwardBatch, bs: int) -> ForwardBatch:
        """Copy the batch into the static rows and pad them to `bs`; the static batch."""
        fb, n = forward_batch, forward_batch.batch_size
        if _packed(fb):  # (every replay from `ModelRunner.build_forward_batch`)
            self.static_rows[:4, :n].copy_(fb.decode_rows)
        else:
            self.req_pool_indices[:n].copy_(fb.req_pool_indices)
            self.seq_lens[:n].copy_(fb.seq_lens)
            self.input_ids[:n].copy_(fb.input_ids)
            self.positions[:n].copy_(fb.positions)
        self.out_cache_loc[:n].copy_(fb.out_cache_loc)
        if self.spec_hidden is not None:  # (padding rows read stale rows: rows never mix)
            self.spec_hidden[:n].copy_(fb.spec_hidden)
        if bs > n:  # a larger batch may have left its rows here
            self.static_rows[:, n:bs].copy_(self.padding[:, n:bs])
        padding = [self.seq_len_fill_value] * (bs - n)
        return self._static_batch(bs, list(fb.seq_lens_cpu) + padding)

    def _static_batch(self, bs: int, seq_lens_cpu: list[int]) -> ForwardBatch:
        hidden = None if self.spec_hidden is None else self.spec_hidden[:bs]
        return static_batch(self, ForwardMode.DECODE, bs, bs, seq_lens_cpu, spec_hidden=hidden)


def lora_graph_mask(model_runner: Any, rows: int) -> tuple[Any, torch.Tensor | None]:
    """(the runner's LoRA manager, the static mask of `rows` tokens its graphs record the
    LoRA layers over: engine/lora/manager.py), or (None, None) without LoRA."""
    lora = getattr(model_runner, "lora", None)
    if lora is None:
        return None, None
    return lora, torch.zeros(rows, lora.columns, dtype=lora.dtype, device=model_runner.device)


def reads_graph_state(graphs: Any, fb: ForwardBatch) -> bool:
    """Whether the batch is over the very tensors a graph runner's graphs read (its model
    runner's `req_to_token`, KV pool and backend; not, e.g., a private copy of the rows)."""
    return (
        fb.req_to_token is graphs.req_to_token
        and fb.kv_pool is graphs.kv_pool
        and fb.attn_backend is graphs.backend
    )


def static_batch(
    graphs: Any, mode: ForwardMode, bs: int, num_tokens: int, seq_lens_cpu: list[int],
    **extra: Any,
) -> ForwardBatch:
    """The static buffers of a graph runner (decode or verify: its `input_ids`, `positions`,
    `out_cache_loc` per token, `req_pool_indices`, `seq_lens` per request) cut to `bs`
    requests of `num_tokens` tokens, as a batch over its model runner's pools and backend."""
    return ForwardBatch(
        forward_mode=mode,
        batch_size=bs,
        input_ids=graphs.input_ids[:num_tokens],
        positions=graphs.positions[:num_tokens],
        out_cache_loc=graphs.out_cache_loc[:num_tokens],
        req_pool_indices=graphs.req_pool_indices[:bs],
        seq_lens=graphs.seq_lens[:bs],
        seq_lens_cpu=seq_lens_cpu,
        req_to_token=graphs.req_to_token,
        kv_pool=graphs.kv_pool,
        attn_backend=graphs.backend,
        **extra,
    )


def graph_step(
    graphs: Any, batch: ForwardBatch, future_map: FutureMap | None = None
) -> Callable[[], None]:
    """What a graph runner's graph of `batch` (its static batch of one size) records: the
    placeholders resolved (with `future_map`), the backend's prologue, the model, whose
    logits the logits processor writes into the runner's `logits` rows of the batch."""
    out = batch.logits_out = graphs.logits[: batch.num_tokens]

    def step() -> None:
        if future_map is not None:
            future_map.resolve_future(batch.input_ids)
        graphs.backend.cuda_graph_prologue(batch)
        logits = graphs.model(batch.input_ids, batch.positions, batch)
        if logits.data_ptr() != out.data_ptr():  # (a model that computes them otherwise)
            out[:, : graphs.vocab_size].copy_(logits)
        hidden_out = getattr(graphs, "spec_hidden_out", None)
        if hidden_out is not None:  # (an EAGLE head's output hidden states)
            hidden_out[: batch.num_tokens].copy_(batch.spec_hidden_out)

    return step


def _logits_dtype(model_runner: Any) -> torch.dtype:
    processor = getattr(model_runner.model, "logits_processor", None)
    if processor is None:
        return torch.float32
    return processor.graph_logits_dtype(model_runner.dtype)


def _packed(fb: ForwardBatch) -> bool:
    """Whether the batch's four per-request inputs are still the rows of its `decode_rows`
    (nothing replaced one of them since it was built)."""
    rows = fb.decode_rows
    return rows is not None and all(
        t.data_ptr() == row.data_ptr() and t.shape == row.shape
        for t, row in zip((fb.req_pool_indices, fb.seq_lens, fb.input_ids, fb.positions), rows)
    )

"""Speculative verify steps replayed from CUDA graphs, one graph per captured batch size.

A verify step (verify.py) is an EXTEND of each request's last token and its drafts, with
logits at every position. Run eagerly on a GPU it launches a forward's kernels one by one:
the fourth GPU session measured 4.8 ms for an n-gram verify step of one request against
0.86 ms for a decode step replayed from a graph (gpu_speculative.json), which no accept length
can pay back. SGLang captures these steps too (its TARGET_VERIFY graphs, a fixed number of
draft tokens per request); so does this runner.

Layout: `width` = num_speculative_tokens + 1 tokens per request. A batch of n requests with
k_i <= width - 1 drafts replays the graph of the smallest captured size bs >= n, whose
tokens are request-major, `width` each:

* request i's tokens sit at i * width .. i * width + k_i, followed by width - 1 - k_i padding
  tokens (id 0, at the request's last position, their K/V written to slot 0, which is never
  handed out);
* requests n..bs-1 are padding: the model runner's padding row of `req_to_token` (every entry
  slot 0), `width` tokens at positions 0..width-1, K/V written to slot 0;
* `seq_lens` of request i is its prefix + width (its real length plus its padding tokens),
  `extend_seq_lens` is `width` for all, `extend_start_loc` is i * width (constant buffers).

With draft trees (`trees`: every verify step of the engine has them) the graphs run the
Triton extend kernel's tree variant over static masks, one [width, width] block a request:
request i's ancestor mask in its top-left corner (`_tree_depths` writes them, and the tokens'
positions are the nodes' depths), causal rows elsewhere, so that padding tokens see what they
would in a chain's graph.

Padding cannot change a real token's logits: attention is causal within a request's new
tokens and its padding tokens come after its real ones, requests do not attend to each other,
the padding K/V lands in slot 0 (read by padding queries only), and every other layer works
row by row. The logits are written in the graph into a static [max_bs * width, vocab] buffer;
`replay` returns the real tokens' rows in the batch's packed order (a view when no request is
padded, else one gather), so verify.py samples them as eager logits.

Each replay copies the batch into the static buffers: one host-to-device copy of the padded
positions, the real tokens' places and the lengths (numpy on the host), then scatters the
batch's device tensors (ids, KV slots) into their places. Under tensor parallelism every rank
captures the same verify graphs, and where rank 0 replays one its followers replay theirs
(engine/tp_ranks.py). The triton and flashinfer backends capture them, and so the hybrid
prefill/decode backend (its prefill backend's); a backend without `supports_verify_cuda_graph`
(the hybrid sliding-window one, torch_native) runs verify steps eagerly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from engine.cuda_graph_runner import (
    CudaGraphCapturer,
    CudaGraphRunner,
    Graph,
    GraphCapturer,
    _logits_dtype,
    graph_step,
    lora_graph_mask,
    reads_graph_state,
    static_batch,
)
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.layers.logits import logits_width
from engine.speculative.scheduling import check_tree_support
from engine.speculative.tree import ancestor_mask, depths

# verify graphs are captured for the decode graphs' sizes up to this many requests:
# speculation pays at small batches, and each size's graph holds width x its logits rows
VERIFY_GRAPH_MAX_BS = 64


def verify_graph_sizes(decode_sizes: Sequence[int]) -> tuple[int, ...]:
    """The batch sizes verify graphs are captured for: the decode graphs' up to
    VERIFY_GRAPH_MAX_BS, and that size itself where the decode sizes pass it."""
    sizes = {bs for bs in decode_sizes if bs <= VERIFY_GRAPH_MAX_BS}
    if any(bs > VERIFY_GRAPH_MAX_BS for bs in decode_sizes):
        sizes.add(VERIFY_GRAPH_MAX_BS)
    return tuple(sorted(sizes))


class VerifyGraphRunner:
    """Verify graphs of a model runner for `batch_sizes`, `width` tokens per request (see the
    module docstring). `can_run(forward_batch)`, `replay(forward_batch)` -> logits [tokens,
    vocab] in the batch's packed order (valid until the next replay), `capture()`."""

    def __init__(
        self,
        model_runner: Any,
        batch_sizes: Sequence[int],
        width: int,
        capturer: GraphCapturer | None = None,
        trees: bool = False,
    ) -> None:
        if not batch_sizes or min(batch_sizes) < 1 or width < 2:
            raise ValueError(f"VerifyGraphRunner: sizes {batch_sizes}, width {width}")
        self.model = model_runner.model
        self.backend = model_runner.attn_backend
        self.kv_pool = model_runner.kv_pool
        self.req_to_token: torch.Tensor = model_runner.req_to_token_pool.req_to_token
        self.padding_req_row: int = model_runner.padding_req_row
        self.batch_sizes = sorted(set(batch_sizes))
        self.max_bs = self.batch_sizes[-1]
        self.width = width
        self.capturer = capturer or CudaGraphCapturer(model_runner.device)
        self.graphs: dict[int, Graph] = {}
        device = model_runner.device
        self.vocab_size = model_runner.model_config.vocab_size
        max_tokens = self.max_bs * width
        with torch.inference_mode():
            # per token: (input_ids, out_cache_loc, positions); per request: (req_pool_indices,
            # seq_lens); constants: extend_seq_lens, extend_start_loc
            self.tokens = torch.zeros(3, max_tokens, dtype=torch.int64, device=device)
            self.input_ids, self.out_cache_loc, self.positions = self.tokens.unbind(0)
            self.positions.copy_(torch.arange(width, device=device).repeat(self.max_bs))
            self.requests = torch.tensor(
                [[self.padding_req_row], [width]], dtype=torch.int64, device=device
            ).repeat(1, self.max_bs)
            self.req_pool_indices, self.seq_lens = self.requests.unbind(0)
            self.extend_lens = torch.full((self.max_bs,), width, dtype=torch.int64, device=device)
            self.start_loc = torch.arange(0, max_tokens, width, dtype=torch.int64, device=device)
            dtype = _logits_dtype(model_runner)
            self.logits = torch.zeros(
                max_tokens, logits_width(dtype, self.vocab_size), dtype=dtype, device=device
            )
            # an EAGLE head's catch-up: the model's hidden states each token reads, and the
            # head's own it leaves (engine/models/llama_eagle.py)
            self.spec_hidden = self.spec_hidden_out = None
            width_in = getattr(self.model, "catchup_hidden_width", None)
            if width_in is not None:
                self.spec_hidden = torch.zeros(max_tokens, width_in, dtype=model_runner.dtype,
                                               device=device)  # fmt: skip
                self.spec_hidden_out = torch.zeros(
                    max_tokens, self.model.decode_hidden_width, dtype=model_runner.dtype,
                    device=device,
                )  # fmt: skip
            self.lora, self.lora_mask = lora_graph_mask(model_runner, max_tokens)
        self._pad_positions = np.arange(width, dtype=np.int64)
        # draft trees (engine/speculative/tree.py): every request's [width, width] ancestor
        # mask; a padding row sees the rows before it (causal), a real node its ancestors
        self.trees = trees
        self.tree_mask: tuple[torch.Tensor, torch.Tensor] | None = None
        if trees:
            check_tree_support(model_runner)  # (the drafter's check, before any capture)
            self._causal = np.tril(np.ones((width, width), dtype=np.uint8))
            masks = torch.from_numpy(np.tile(self._causal.ravel(), self.max_bs)).to(device)
            starts = torch.arange(0, max_tokens * width, width * width, dtype=torch.int64)
            self.tree_mask = (masks, starts.to(device))

    # -- capture --------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        """Record one graph per size, largest first (every static row is padding now)."""
        self.backend.init_verify_cuda_graph_state(
            self.max_bs, self.width, int(self.req_to_token.shape[1])
        )
        for bs in reversed(self.batch_sizes):
            batch = self._static_batch(bs, [self.width] * bs)
            self.backend.init_forward_metadata_capture_cuda_graph(batch)
            if self.lora is not None:  # (LoRA adapters: their layers over the static mask)
                self.lora.bind_graph_rows(self.lora_mask[: bs * self.width])
            self.graphs[bs] = self.capturer.capture(self._step(batch))

    def _step(self, batch: ForwardBatch) -> Callable[[], None]:
        return graph_step(self, batch)

    # -- replay ---------------------------------------------------------------------------------
    def can_run(self, forward_batch: ForwardBatch) -> bool:
        fb, lens = forward_batch, forward_batch.spec_draft_lens
        if not self.graphs or lens is None or not 0 < fb.batch_size <= self.max_bs:
            return False
        # a request's padded length must stay inside its row of req_to_token (a backend
        # reads the row's entries up to it: entries past the real length are never read by a
        # real token, but must exist)
        room = int(self.req_to_token.shape[1]) - self.width + 1
        return (
            self.backend.supports_verify_cuda_graph
            and fb.forward_mode.is_extend()
            and fb.return_all_logits
            and fb.prompt_logprob_rows is None
            and fb.pooling is None
            and max(lens) < self.width
            and all(n - k <= room for n, k in zip(fb.seq_lens_cpu, lens, strict=True))
            and reads_graph_state(self, fb)
            and (fb.spec_hidden is None) == (self.spec_hidden is None)
            and (fb.spec_parents is not None) == self.trees
        )

    padded_size = CudaGraphRunner.padded_size

    def lora_rows(self, forward_batch: ForwardBatch) -> tuple[torch.Tensor, int]:
        """As `CudaGraphRunner.lora_rows`: `width` tokens a request."""
        bs = self.padded_size(forward_batch.batch_size)
        return self.lora_mask[: bs * self.width], self.width

    @torch.inference_mode()
    def replay(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """Logits [tokens, vocab] of a batch that `can_run`, one row per token of the batch
        in its order (in `logits.dtype`)."""
        n = forward_batch.batch_size
        bs = self.padded_size(n)
        batch, rows = self._load(forward_batch, bs)
        self.backend.init_forward_metadata_replay_cuda_graph(batch)
        self.graphs[bs].replay()
        out = self.spec_hidden_out
        if rows is None:  # every request has width - 1 drafts: its rows come first, in order
            if out is not None:
                forward_batch.spec_hidden_out = out[: n * self.width]
            return self.logits[: n * self.width, : self.vocab_size]
        if out is not None:
            forward_batch.spec_hidden_out = out.index_select(0, rows)
        return self.logits.index_select(0, rows)[:, : self.vocab_size]

    def _load(
        self, forward_batch: ForwardBatch, bs: int
    ) -> tuple[ForwardBatch, torch.Tensor | None]:
        """Copy the batch into the static buffers, padded to `bs` requests of `width` tokens;
        the static batch, and the places of the real tokens (None: the first n * width)."""
        fb, n, w = forward_batch, forward_batch.batch_size, self.width
        assert fb.spec_draft_lens is not None
        lens = np.asarray(fb.spec_draft_lens, dtype=np.int64)
        seq = np.asarray(fb.seq_lens_cpu, dtype=np.int64)
        prefix = seq - lens - 1
        j = self._pad_positions
        positions = np.empty((bs, w), dtype=np.int64)  # padding tokens: the last real position
        if self.trees:
            positions[:n] = prefix[:, None] + self._tree_depths(fb.spec_parents, bs)
        else:
            positions[:n] = prefix[:, None] + np.minimum(j[None, :], lens[:, None])
        positions[n:] = j
        full = bool((lens == w - 1).all())
        places = None if full else np.flatnonzero((j[None, :] <= lens[:, None]).ravel())
        padded_seq = np.full(bs, w, dtype=np.int64)
        padded_seq[:n] = prefix + w
        parts = [positions.ravel(), padded_seq] + ([] if full else [places])
        host = torch.from_numpy(np.concatenate(parts))
        dev = host.to(self.tokens.device, non_blocking=False)
        m = bs * w
        self.positions[:m].copy_(dev[:m])
        self.seq_lens[:bs].copy_(dev[m : m + bs])
        self.req_pool_indices[:n].copy_(fb.req_pool_indices)
        if bs > n:
            self.req_pool_indices[n:bs].fill_(self.padding_req_row)
        rows = None
        if full:
            self.input_ids[: n * w].copy_(fb.input_ids)
            self.out_cache_loc[: n * w].copy_(fb.out_cache_loc)
            if self.spec_hidden is not None:  # (padding tokens read stale rows: no real
                self.spec_hidden[: n * w].copy_(fb.spec_hidden)  # token attends to them)
            if bs > n:
                self.tokens[:2, n * w : m].zero_()
        else:
            rows = dev[m + bs :]
            self.tokens[:2, :m].zero_()
            self.input_ids.index_copy_(0, rows, fb.input_ids)
            self.out_cache_loc.index_copy_(0, rows, fb.out_cache_loc)
            if self.spec_hidden is not None:
                self.spec_hidden.index_copy_(0, rows, fb.spec_hidden)
        seq_cpu = padded_seq.tolist()
        return self._static_batch(bs, seq_cpu), rows

    def _tree_depths(self, parents: list[list[int]], bs: int) -> np.ndarray:
        """[n, width] each real request's node depths (padding: its last node's), and its
        ancestor masks written into the static masks (the rest of the first `bs` requests'
        rows causal)."""
        assert self.tree_mask is not None
        w = self.width
        masks = np.broadcast_to(self._causal, (bs, w, w)).copy()
        out = np.empty((len(parents), w), dtype=np.int64)
        for i, ps in enumerate(parents):
            d = depths(ps)
            out[i, : len(d)] = d
            out[i, len(d) :] = d[-1]
            masks[i, : len(d), : len(d)] = ancestor_mask(ps)
        self.tree_mask[0][: bs * w * w].copy_(torch.from_numpy(masks.reshape(-1)))
        return out

    def _static_batch(self, bs: int, seq_lens_cpu: list[int]) -> ForwardBatch:
        w = self.width
        return static_batch(
            self, ForwardMode.EXTEND, bs, bs * w, seq_lens_cpu,
            extend_prefix_lens_cpu=[s - w for s in seq_lens_cpu], extend_seq_lens_cpu=[w] * bs,
            extend_start_loc=self.start_loc[:bs], extend_seq_lens=self.extend_lens[:bs],
            return_all_logits=True,
            spec_hidden=None if self.spec_hidden is None else self.spec_hidden[: bs * w],
            spec_tree_mask=self.tree_mask,
        )  # fmt: skip

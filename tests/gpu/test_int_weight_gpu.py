"""Integer weights on the GPU (needs CUDA and compiled Triton; the runbook's `int-weight` step):

* the Triton W4A16 / W8A16 GEMM (kernels/int_gemm.py) against the torch reference on the same
  packed weights, at a 4096 x 4096 layer: one row, a decode batch, a prefill; 4 bits in
  groups of 128 (with and without zero points), 8 bits per channel; bf16 and fp16;
* W8A8 int8 through torch._int_mm (one row, 16, 300) against the float path, and its
  one-launch activation quantization against the torch one bit for bit;
* integer experts through the fused MoE's grouped GEMMs against the torch path on their
  dequantized weights (16 experts of Qwen3-30B-A3B's shape, top 8; 4 bits in groups of 128
  with zero points, 8 bits per channel; 4 and 300 tokens; bf16);
* the engine on a tiny W4A16 checkpoint, and on a GPTQ one with activation ordering (its
  layers' inputs permuted on the device before the kernel), in float32 (Triton attention),
  its IntWeightLinear layers on the kernel: transformers' greedy tokens (GPTQ: on the float
  weights compressed-tensors unpacks from the checkpoint it was written from).
"""

from __future__ import annotations

import pytest
import torch

from tests.factories import require_compiled_cuda

require_compiled_cuda()

from kernels.int_gemm import int_gemm, int_gemm_reference  # noqa: E402

pytestmark = [pytest.mark.gpu]


@pytest.mark.parametrize("m", [1, 16, 300])
def test_group_index_matches_the_reference(m):
    """A row-parallel half (2048 columns) of a 4096-column W4A16 weight with activation
    ordering: each column's scale and zero point gathered from all 32 groups (`gidx`)."""
    n, k, groups = 4096, 2048, 32
    gen = torch.Generator(device="cuda").manual_seed(0)
    packed = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), dtype=torch.int32,
                           device="cuda", generator=gen)  # fmt: skip
    scale = (torch.rand(n, groups, device="cuda", generator=gen) * 0.02).bfloat16()
    zero = torch.randint(-8, 8, (n, groups), dtype=torch.int8, device="cuda", generator=gen)
    gidx = torch.randint(0, groups, (k,), dtype=torch.int32, device="cuda", generator=gen)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    got = int_gemm(x, packed, scale, zero, 4, 128, gidx=gidx).float()
    want = int_gemm_reference(x.float(), packed, scale.float(), zero, 4, 128, gidx=gidx)
    assert (got - want).abs().max().item() < 2e-2 * want.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("bits", "group", "symmetric"), [(4, 128, True), (4, 128, False),
                                                          (8, None, True)])  # fmt: skip
@pytest.mark.parametrize("m", [1, 16, 300])
def test_kernel_matches_the_reference(dtype, bits, group, symmetric, m):
    n = k = 4096
    g = group or k
    gen = torch.Generator(device="cuda").manual_seed(0)
    packed = torch.randint(-(2**31), 2**31 - 1, (n, k * bits // 32), dtype=torch.int32,
                           device="cuda", generator=gen)  # fmt: skip
    scale = (torch.rand(n, k // g, device="cuda", generator=gen) * 0.02).to(dtype)
    zero = None if symmetric else torch.randint(-8, 8, (n, k // g), dtype=torch.int8,
                                                device="cuda", generator=gen)  # fmt: skip
    x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
    got = int_gemm(x, packed, scale, zero, bits, g).float()
    want = int_gemm_reference(x.float(), packed, scale.float(), zero, bits, g)
    scale_of = want.abs().max().item()
    assert (got - want).abs().max().item() < 2e-2 * scale_of


@pytest.mark.parametrize("k", [4096, 14336])
def test_int8_one_row_gemv_is_the_int_mm_path_to_the_bit(k):
    """One row (batch-1 decode) runs the int8 GEMV (`fp8_gemv`'s int8 mode): its exact int32
    sums and float32 epilogue are what torch._int_mm's path gives, bit for bit."""
    import torch.nn.functional as F

    from engine.layers.int8 import int8_linear
    from kernels.fp8_gemm import quantize_rows_int8_triton

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, k, device="cuda", generator=gen).bfloat16()
    w = torch.randint(-128, 128, (4096, k), dtype=torch.int8, device="cuda", generator=gen)
    scale = torch.rand(4096, device="cuda", generator=gen) * 1e-3
    bias = torch.randn(4096, device="cuda", generator=gen).bfloat16()
    q, s = quantize_rows_int8_triton(x)
    acc = torch._int_mm(F.pad(q, (0, 0, 0, 16)), w.t())[:1].float()
    want = (acc * s[:, None] * scale[None, :] + bias.float()).bfloat16()
    assert torch.equal(int8_linear(x, w, scale, bias), want)


@pytest.mark.parametrize("m", [1, 16, 300])
def test_int8_w8a8_on_torch_int_mm_matches_the_float_path(m):
    """W8A8 int8 (engine/layers/int8.py) on CUDA: torch._int_mm, its rows padded past 16,
    against the same integers multiplied in float32 on the CPU."""
    from engine.layers.int8 import int8_linear

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, 4096, device="cuda", generator=gen).bfloat16()
    w = torch.randint(-128, 128, (4096, 4096), dtype=torch.int8, device="cuda", generator=gen)
    scale = torch.rand(4096, device="cuda", generator=gen) * 1e-3
    got = int8_linear(x, w, scale).float().cpu()
    want = int8_linear(x.cpu().float(), w.cpu(), scale.cpu())
    assert (got - want).abs().max().item() < 1e-2 * want.abs().max().item()
    # the one-launch quantization the GPU runs is the torch one, bit for bit (compiled here:
    # its round-half-to-even is arithmetic that fast-math would break)
    from engine.layers.int8 import quantize_rows_int8
    from kernels.fp8_gemm import quantize_rows_int8_triton

    q, s = quantize_rows_int8_triton(x)
    want_q, want_s = quantize_rows_int8(x.cpu())
    assert torch.equal(q.cpu(), want_q) and torch.equal(s.cpu(), want_s)


@pytest.mark.parametrize(("bits", "symmetric", "act_order"),
                         [(4, False, False), (8, True, False), (4, True, True),
                          (4, False, "part")])  # fmt: skip
@pytest.mark.parametrize("tokens", [4, 300])
def test_integer_experts_match_the_torch_path(bits, symmetric, act_order, tokens):
    """(act_order: GPTQ's activation ordering, each expert's input columns gathered in its
    own order; the torch path puts each dequantized expert's columns back. "part": a rank's
    half of such a down projection, each column's group gathered from all of them.)"""
    from engine.layers.int_experts import IntExperts
    from engine.layers.moe import fused_experts_torch, select_experts
    from kernels.fused_moe import fused_experts_triton

    experts, top_k, hidden, inter = 16, 8, 2048, 768
    gen = torch.Generator(device="cuda").manual_seed(0)

    def packed(n: int, k: int, part: bool = False) -> IntExperts:
        group = 128 if bits == 4 else k
        groups = 2 * k // group if part else k // group  # (a half: all groups' scales)
        words = torch.randint(-(2**31), 2**31 - 1, (experts, n, k * bits // 32),
                              dtype=torch.int32, device="cuda", generator=gen)  # fmt: skip
        scale = (torch.rand(experts, n, groups, device="cuda", generator=gen) * 0.01
                 + 0.001).bfloat16()  # fmt: skip
        zero = None if symmetric else torch.randint(-8, 8, (experts, n, groups),
                                                    dtype=torch.int8, device="cuda",
                                                    generator=gen)  # fmt: skip
        if part:
            gidx = torch.randint(0, groups, (experts, k), dtype=torch.int32, device="cuda",
                                 generator=gen)  # fmt: skip
            return IntExperts(words, scale, zero, bits, group, k, gidx=gidx)
        perm = None
        if act_order:
            perm = torch.stack([torch.randperm(k, device="cuda", generator=gen)
                                for _ in range(experts)]).to(torch.int32)  # fmt: skip
        return IntExperts(words, scale, zero, bits, group, k, perm)

    part = act_order == "part"
    inter = inter // 2 if part else inter  # (a rank's half of the intermediate features)
    w13, w2 = packed(2 * inter, hidden), packed(hidden, inter, part)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16()
    weights, ids = select_experts(torch.randn(tokens, experts, device="cuda", generator=gen),
                                  top_k, True)  # fmt: skip
    got = fused_experts_triton(x, w13, w2, weights, ids).float()
    want = fused_experts_torch(x.float(), _float(w13), _float(w2), weights, ids)
    assert (got - want).abs().max().item() < 3e-2 * want.abs().max().item()


def _float(experts):
    """Integer experts' weights in float32 (each expert dequantized)."""
    return torch.stack([experts[e].float() for e in range(experts.shape[0])])


@pytest.mark.parametrize("layout", ["compressed-tensors", "gptq-act-order"])
def test_engine_gives_transformers_greedy_tokens(layout, tmp_path):
    from engine.engine import Engine
    from engine.layers.int_weight import IntWeightLinear
    from tests.factories import (
        assert_greedy_match,
        dequantized_copy,
        hf_greedy,
        mixed_prompts,
        tiny_gptq_model,
        tiny_int_weight_model,
    )

    path = reference = tiny_int_weight_model("llama", 4, 16, True)
    if layout == "gptq-act-order":
        path = tiny_gptq_model("llama", 4, 16, True, act_order=True)
        source = tiny_int_weight_model("llama", 4, 16, True, act_order=True)
        reference = dequantized_copy(source, str(tmp_path / "reference"), act_order=True)
    prompts = mixed_prompts(1500, n=4, max_len=40, seed=5)
    greedy = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    with Engine(model_path=path, device="cuda", dtype="float32", attention_backend="triton",
                disable_overlap_schedule=True) as engine:  # fmt: skip
        model = engine.scheduler.model_runner.model
        assert any(isinstance(m, IntWeightLinear) for m in model.modules())
        outs = engine.generate(input_ids=prompts, sampling_params=[greedy] * len(prompts))
    for prompt, out in zip(prompts, outs, strict=True):
        assert_greedy_match(reference, prompt, out["output_ids"],
                            hf_greedy(reference, prompt, 10))  # fmt: skip

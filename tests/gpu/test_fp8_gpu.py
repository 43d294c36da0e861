"""FP8 on the GPU (needs CUDA; the runbook's `fp8` step):

* the two CUDA paths of `fp8_linear`, `torch._scaled_mm` (per-channel, bfloat16) and the
  Triton block kernel, against the torch reference on the same float8 operands, at real
  layer shapes;
* models with 128 x 128 block FP8 checkpoints and `--quantization fp8`, teacher-forced through
  the model runner against transformers computing the same W8A8 arithmetic
  (tests/fp8_reference.py): in float32 (the Triton FP8 GEMM, multiplying in float32 for a
  float32 output, Triton attention) to the 0.99 bar of the bf16 parity test; in bfloat16
  (`torch._scaled_mm` and the GEMM with bf16 outputs, flashinfer) against the float32
  reference, no further from it than transformers' own bfloat16 W8A8 is;
* the engine with CUDA graphs against eager: the same greedy tokens.

Why bfloat16 is not held to 0.99 against transformers' bfloat16: W8A8 rounds every
projection's input to float8 (steps of 6-12%), so a bf16-sized difference between two correct
engines flips roundings that compound over the layers. The third GPU session measured 0.51
(online) and blamed neither side; the same comparison on the CPU (benchmarks/fp8_noise.py,
fp8_noise.json), where sluice's FP8 layer is the reference's float32 arithmetic to the letter,
gives the same: sluice's bf16 against transformers' bf16 0.48-0.50 (llama, qwen3; query / key
scale 2) and 0.74-0.78 (scale 1), transformers' bf16 against its own float32 0.33-0.39 and
0.68-0.72, while sluice's float32 agrees with transformers' float32 on 0.985-0.992 (tie-aware
0.992-0.996). The models are float32 checkpoints with the parity models' query / key scale
(tests/teacher_forcing.py `BF16_QK_SCALE`): transformers dequantizes a bf16 FP8 checkpoint into
bf16, which in float32 left its reference 0.60 away.

The fourth GPU session's float32 run agreed on only 0.84 (mean |delta logprob| 0.22, 0.014 on
the CPU): the GEMM then multiplied float32 models' tiles on the float8 tensor cores, whose
wgmma accumulates with about 14 bits (tests/unit/test_fp8.py bounds it); float32 outputs now
multiply in float32 (`kernels.fp8_gemm.upcast`), not yet rerun on a GPU.
"""

from __future__ import annotations

import functools
import tempfile

import pytest
import torch

from tests.fp8_reference import fp8_models, fp8_sequences, w8a8_ours, w8a8_reference
from tests.teacher_forcing import BF16_QK_SCALE, score_logits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

_ROOT = tempfile.mkdtemp(prefix="sluice-gpu-fp8-")


@functools.cache
def _models(arch: str) -> tuple[str, str]:
    """(float32 model, the same as a 128 x 128 block FP8 checkpoint)."""
    return fp8_models(_ROOT, arch, BF16_QK_SCALE)


@pytest.mark.parametrize("rows,cols,group", [(7, 2048, (1, 2048)), (300, 2048, (1, 128)),
                                             (2560, 2048, (128, 128))])
def test_quantization_is_the_same_on_cuda_and_cpu(rows, cols, group):
    """Bit for bit: the H100 once quantized an ulp-different scale (a division by a Python
    scalar is a multiplication by its reciprocal on CUDA), flipping float8 roundings, and the
    GEMMs then missed the CPU reference by 5x their tolerance (the Triton GEMM itself matched
    it given the same quantized inputs)."""
    from kernels.fp8_gemm import quantize_groups

    x = (torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows)) * 3).bfloat16()
    q, s = quantize_groups(x, *group)
    q_cuda, s_cuda = quantize_groups(x.cuda(), *group)
    assert torch.equal(s_cuda.cpu(), s)
    assert torch.equal(q_cuda.cpu().view(torch.uint8), q.view(torch.uint8))


@pytest.mark.parametrize("rows,cols,group_cols", [(1, 2048, 2048), (7, 8192, 128),
                                                   (300, 2048, 128), (64, 3000, 3000)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_launch_quantization_is_the_cpus_to_the_bit(rows, cols, group_cols, dtype):
    """`quantize_rows` (fp8_linear's activations on CUDA, one Triton launch) against the
    CPU's torch `quantize_groups`: the same float32 scales and float8 bits."""
    from kernels.fp8_gemm import quantize_groups, quantize_rows

    g = torch.Generator().manual_seed(rows + cols)
    x = (torch.randn(rows, cols, generator=g) * 3).to(dtype)
    q, s = quantize_groups(x, 1, group_cols)
    q_cuda, s_cuda = quantize_rows(x.cuda(), group_cols)
    assert torch.equal(s_cuda.cpu(), s)
    assert torch.equal(q_cuda.cpu().view(torch.uint8), q.view(torch.uint8))


@pytest.mark.parametrize("m", [1, 7, 64, 300])
@pytest.mark.parametrize(
    "n,k,group", [(4096, 2048, (1, 2048)), (2560, 2048, (128, 128)), (2048, 8192, (128, 128))]
)
def test_cuda_paths_match_reference(m, n, k, group):
    from engine.layers.fp8 import fp8_linear
    from kernels.fp8_gemm import fp8_gemm_reference, quantize_groups

    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) * k**-0.5).bfloat16()
    w_q, w_s = quantize_groups(w, *group)
    x_q, x_s = quantize_groups(x, 1, group[1])
    want = fp8_gemm_reference(x_q, x_s, w_q, w_s, group, None, torch.float32)
    got = fp8_linear(x.cuda(), w_q.cuda(), w_s.cuda(), group).float().cpu()
    # bfloat16 output: half an ulp is 2^-9 relative
    torch.testing.assert_close(got, want, rtol=2**-8, atol=1e-3 * want.abs().max().item())


@functools.cache
def _ours(arch: str, kind: str, dtype: str) -> list[torch.Tensor]:
    backend = "triton" if dtype == "float32" else "flashinfer"
    return w8a8_ours(_models(arch), kind, len(arch), "cuda", backend, dtype)


@functools.cache
def _reference(arch: str, kind: str, dtype: str) -> list[torch.Tensor]:
    return w8a8_reference(_models(arch), kind, len(arch), "cuda", dtype)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("kind", ["checkpoint", "online"])
def test_fp8_teacher_forced_against_transformers_in_float32(arch, kind):
    """The same W8A8 arithmetic as transformers' to float32 rounding: wrong scales, shards
    or block layouts would show here."""
    stats = score_logits(_ours(arch, kind, "float32"), _reference(arch, kind, "float32"))
    print(f"\n{arch} {kind} float32: {stats}")
    assert stats["agreement_tie_aware"] >= 0.99, stats
    assert stats["agreement"] >= 0.95, stats


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("kind", ["checkpoint", "online"])
def test_bf16_fp8_no_further_from_float32_than_transformers_bf16(arch, kind):
    """sluice's bfloat16 W8A8 (`torch._scaled_mm` for the online per-channel weights, the
    Triton GEMM for the blocks, flashinfer) agrees with the float32 reference on no fewer
    positions than transformers' bfloat16 W8A8 does, less 0.05 (about three standard
    deviations of the difference over these ~850 positions; on the CPU it was -0.018 to
    +0.015: benchmarks/results/fp8_noise.json). Against transformers' bf16 it is recorded,
    not held to a bar (see the module docstring)."""
    ref32 = _reference(arch, kind, "float32")
    ours = score_logits(_ours(arch, kind, "bfloat16"), ref32)
    theirs = score_logits(_reference(arch, kind, "bfloat16"), ref32)
    each_other = score_logits(_ours(arch, kind, "bfloat16"), _reference(arch, kind, "bfloat16"))
    print(f"\n{arch} {kind} bf16 vs float32 reference: ours {ours}, transformers' {theirs}; "
          f"ours vs transformers' bf16 {each_other}")  # fmt: skip
    assert ours["agreement"] >= theirs["agreement"] - 0.05, (ours, theirs)


def test_cuda_graphs_match_eager_with_fp8():
    from engine.engine import Engine

    _, fp8 = _models("llama")
    seqs, _ = fp8_sequences(seed=3)
    prompts = [s[:40] for s in seqs]
    params = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    outs = []
    for graph in (True, False):
        with Engine(model_path=fp8, device="cuda", dtype="bfloat16", disable_cuda_graph=not graph,
                    max_total_tokens=1 << 15, max_running_requests=16) as engine:  # fmt: skip
            outs.append(
                [
                    o["output_ids"]
                    for o in engine.generate(input_ids=prompts, sampling_params=params)
                ]
            )
    same = sum(a == b for a, b in zip(*outs))
    assert same >= len(prompts) - 1, outs  # one near-tie may flip on a different GEMM split


@pytest.mark.parametrize("block", [True, False, "part"], ids=["block-128", "tensor", "part"])
@pytest.mark.parametrize("tokens", [4, 300])
def test_float8_experts_match_the_torch_path(block, tokens):
    """Float8 experts (engine/layers/fp8_experts.py) through the fused MoE's grouped GEMMs
    (compiled: each float8 tile converted and scaled in registers) against the torch path on
    their dequantized weights: 16 experts of Qwen3-30B-A3B's shape, top 8, bf16 activations;
    128-column block scales or one per row; "part": rank 1 of 8's (96 intermediate features,
    its down projection's columns starting 96 into a block: K steps of 32)."""
    from engine.layers.fp8_experts import Fp8Experts
    from engine.layers.moe import fused_experts_torch, select_experts
    from kernels.fused_moe import fused_experts_triton

    experts, top_k, hidden, inter = 16, 8, 2048, 768
    offset = 0
    if block == "part":
        inter = offset = 96
    gen = torch.Generator(device="cuda").manual_seed(0)

    def of(n: int, k: int, offset: int = 0) -> Fp8Experts:
        group = 128 if block else k
        data = (torch.randn(experts, n, k, device="cuda", generator=gen) * 64).to(
            torch.float8_e4m3fn
        )
        groups = -(-(offset + k) // group)
        scale = torch.rand(experts, n, groups, device="cuda", generator=gen) * 1e-3 + 1e-4
        return Fp8Experts(data, scale, group, torch.bfloat16, offset)

    w13, w2 = of(2 * inter, hidden), of(hidden, inter, offset)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16()
    weights, ids = select_experts(torch.randn(tokens, experts, device="cuda", generator=gen),
                                  top_k, True)  # fmt: skip
    got = fused_experts_triton(x, w13, w2, weights, ids).float()
    w13_f = torch.stack([w13[e].float() for e in range(experts)])
    w2_f = torch.stack([w2[e].float() for e in range(experts)])
    want = fused_experts_torch(x.float(), w13_f, w2_f, weights, ids)
    assert (got - want).abs().max().item() < 3e-2 * want.abs().max().item()

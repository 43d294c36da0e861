"""Teacher forcing: the model runner's logits at every position of given sequences (one
prefill with every position's logits, then decode steps fed the sequences' own tokens), the
same from transformers, and their agreement. The GPU parity tests and the FP8 tests use it;
on a CPU it runs with torch_native."""

from __future__ import annotations

import functools
import os
import random
from typing import Any

import torch

TIE_ULPS = 2
# the CPU tests' sequences (tests/integration/test_fp8.py, test_kv_fp8.py): prompts of these
# lengths, then DECODE teacher-forced decode steps, tokens from a tiny model's vocabulary
CPU_PROMPT_LENS = [40, 7, 90, 1]
CPU_DECODE = 12
CLOSE = 1e-3  # |delta logit| of a position that computed the same (rounded) operands
MIN_CLOSE_POSITIONS = 0.98
# The bf16 parity models (tests/gpu/test_parity_gpu.py, benchmarks/bf16_noise.py): head_dim 64
# (flashinfer's kernels take 64/128/256), teacher forced on four sequences. Queries and keys
# at transformers' init (qk_scale 1): the tiny models' default 2 makes attention so sharp that
# transformers' own bf16 agrees with its float32 on 0.83 of positions (Llama), a measure of
# the random model's sensitivity to rounding rather than of either engine; with 1, 0.96.
BF16_SHAPE = dict(hidden_size=512, num_layers=4, num_heads=8, intermediate_size=1024,
                  vocab_size=4096)  # fmt: skip
BF16_QK_SCALE = 1.0
BF16_PROMPT_LENS = [200, 37, 513, 1]
BF16_DECODE = 40


def hf_logits(path: str, seqs: list[list[int]], device: str, dtype: torch.dtype) -> list:
    """transformers' logits at every position of each sequence (float32, on the CPU)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    with torch.inference_mode():
        out = [model(torch.tensor([s], device=device)).logits[0].float().cpu() for s in seqs]
    del model
    return out


def runner_teacher_forced(
    path: str,
    seqs: list[list[int]],
    prompt_lens: list[int],
    device: str,
    backend: str,
    dtype: str = "bfloat16",
    page_size: int = 1,
    **engine_kwargs: Any,
) -> list[torch.Tensor]:
    """The model runner on `seqs`: one prefill of each prompt with every position's logits,
    then decode steps fed the sequences' own next tokens. Row p of sequence i's result is the
    logits after seqs[i][: p + 1] (float32, on the CPU)."""
    from engine.config import EngineArgs, ModelConfig
    from engine.forward_batch import ForwardMode
    from engine.model_runner import ModelRunner
    from engine.sampling.sampling_params import SamplingParams
    from engine.scheduler.schedule_batch import ModelWorkerBatch

    args = EngineArgs(
        model_path=path,
        device=device,
        dtype=dtype,
        attention_backend=backend,
        page_size=page_size,
        max_total_tokens=8192,
        max_running_requests=8,
        disable_cuda_graph=True,
        **engine_kwargs,
    )
    runner = ModelRunner(ModelConfig.from_pretrained(path), args)
    rows = runner.req_to_token_pool.alloc(len(seqs))
    table = runner.req_to_token_pool.req_to_token
    n = len(seqs)

    def forward(mode: ForwardMode, lens: list[int], new: list[int], all_logits: bool) -> Any:
        last = [int(table[r, p - 1]) if p else 0 for r, p in zip(rows, lens)]
        slots = runner.allocator.alloc_extend(lens, [p + k for p, k in zip(lens, new)], last)
        start = 0
        for r, p, k in zip(rows, lens, new):
            table[r, p : p + k] = slots[start : start + k].to(table.dtype)
            start += k
        extend = mode == ForwardMode.EXTEND
        mwb = ModelWorkerBatch(
            forward_mode=mode,
            input_ids=[t for s, p, k in zip(seqs, lens, new) for t in s[p : p + k]],
            positions=[p + j for p, k in zip(lens, new) for j in range(k)],
            out_cache_loc=slots,
            req_pool_indices=list(rows),
            seq_lens=[p + k for p, k in zip(lens, new)],
            extend_prefix_lens=list(lens) if extend else None,
            extend_seq_lens=list(new) if extend else None,
            sampling_params=[SamplingParams(temperature=0.0)] * n,
            output_ids=[[] for _ in seqs],
            prompt_ids=[s[:p] for s, p in zip(seqs, prompt_lens)],
        )
        fb = runner.build_forward_batch(mwb)
        fb.return_all_logits = all_logits
        return runner.forward(fb).float().cpu()

    num_decode = {len(s) - p for s, p in zip(seqs, prompt_lens)}
    assert len(num_decode) == 1, "every sequence decodes the same number of tokens"
    try:
        prefill = forward(ForwardMode.EXTEND, [0] * n, prompt_lens, True)
        out = list(torch.split(prefill, prompt_lens))
        for step in range(num_decode.pop()):
            lens = [p + step for p in prompt_lens]
            logits = forward(ForwardMode.DECODE, lens, [1] * n, False)
            out = [torch.cat([o, logits[i : i + 1]]) for i, o in enumerate(out)]
    finally:
        runner.stop_tensor_parallel()  # (the other ranks' processes, with tp_size > 1)
    return out


def score(tokens: torch.Tensor, logprobs: torch.Tensor, ref_logits: torch.Tensor) -> dict:
    """Our chosen tokens and their logprobs [N] against the reference's logits [N, V].

    `agreement`: our token is the reference's argmax. `agreement_tie_aware` also accepts a
    token whose reference logit is within TIE_ULPS bfloat16 ulps of the reference's top logit
    (the engine-core rule's tie, at bf16 resolution: logits are rounded to bf16 by lm_head in
    both engines, so such tokens are tied to within rounding)."""
    top = ref_logits.max(-1).values
    ours = ref_logits.gather(1, tokens[:, None]).squeeze(1)
    ulp = 2.0 ** (torch.floor(torch.log2(top.abs().clamp(min=1e-6))) - 7)
    raw = tokens == ref_logits.argmax(-1)
    tied = ours >= top - TIE_ULPS * ulp
    ref_lp = torch.log_softmax(ref_logits, -1).gather(1, tokens[:, None]).squeeze(1)
    delta = (logprobs - ref_lp).abs()
    return {
        "positions": len(tokens),
        "agreement": float(raw.float().mean()),
        "agreement_tie_aware": float((raw | tied).float().mean()),
        "max_abs_dlogprob": float(delta.max()),
        "mean_abs_dlogprob": float(delta.mean()),
    }


def score_logits(ours: list[torch.Tensor], ref: list[torch.Tensor]) -> dict:
    """`score` of our argmax at every row of each sequence's logits."""
    ours_all = torch.cat(ours)
    tokens = ours_all.argmax(-1)
    logprobs = torch.log_softmax(ours_all, -1).gather(1, tokens[:, None]).squeeze(1)
    return score(tokens, logprobs, torch.cat([r[: o.shape[0]] for o, r in zip(ours, ref)]))


def score_pairs(
    runs: dict[str, list[torch.Tensor]], pairs: dict[str, tuple[str, str]], keys: tuple[str, ...]
) -> dict:
    """`score_logits` of each pair of `runs` (label -> (ours, ref) run names), flat:
    "label.key" for each of `keys`, and "positions" (benchmarks/bf16_noise.py, fp8_noise.py)."""
    row = {}
    for label, (ours, ref) in pairs.items():
        stats = score_logits(runs[ours], runs[ref])
        row["positions"] = stats["positions"]
        row.update({f"{label}.{k}": stats[k] for k in keys})
    return row


def bf16_parity_model(root: str, arch: str, qk_scale: float = BF16_QK_SCALE) -> str:
    """The bf16 parity model of `arch` (or a name in tests.factories.WINDOWED_MODELS) under
    `root`, built once."""
    from services.tiny_model import make_tiny_model
    from tests.factories import WINDOWED_MODELS

    path = os.path.join(root, f"{arch}-bf16-qk{qk_scale:g}")
    base, window = WINDOWED_MODELS.get(arch, (arch, None))
    extra = {} if arch == "gpt2" else {"num_kv_heads": 4, "head_dim": 64}
    if not os.path.exists(os.path.join(path, "config.json")):
        make_tiny_model(path, arch=base, sliding_window=window, qk_scale=qk_scale, **BF16_SHAPE,
                        **extra)  # fmt: skip
    return path


def bf16_sequences(seed: int, decode: int = BF16_DECODE) -> tuple[list[list[int]], list[int]]:
    """Four random sequences of the parity models' vocabulary: BF16_PROMPT_LENS prompts, then
    `decode` teacher-forced decode steps each."""
    rng = random.Random(seed)
    vocab = BF16_SHAPE["vocab_size"]
    seqs = [[rng.randrange(8, vocab) for _ in range(p + decode)] for p in BF16_PROMPT_LENS]
    return seqs, list(BF16_PROMPT_LENS)


@functools.cache
def cpu_sequences(seed: int = 0) -> tuple[tuple[int, ...], ...]:
    rng = random.Random(seed)
    return tuple(
        tuple(rng.randrange(8, 1536) for _ in range(p + CPU_DECODE)) for p in CPU_PROMPT_LENS
    )


def cpu_teacher_forced(path: str, backend: str = "torch_native", **engine_kwargs: Any) -> list:
    """`runner_teacher_forced` on `cpu_sequences()` in float32 on the CPU."""
    seqs = [list(s) for s in cpu_sequences()]
    return runner_teacher_forced(
        path, seqs, CPU_PROMPT_LENS, "cpu", backend, dtype="float32", **engine_kwargs
    )


def close_positions(ours: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """The fraction of positions whose logits are all within CLOSE of the reference's."""
    worst = torch.cat([(o - r).abs().amax(-1) for o, r in zip(ours, ref)])
    return float((worst < CLOSE).float().mean())


def assert_same_arithmetic(ours: list[torch.Tensor], ref: list[torch.Tensor]) -> dict:
    """Float32 rounding apart, the same logits at every position of `cpu_sequences()`: a
    quantized operand is discontinuous, so a float32 difference that moves a value across a
    float8 rounding boundary may change a position by more (2% of them allowed)."""
    stats = score_logits(ours, ref)
    stats["close_positions"] = close_positions(ours, ref)
    assert stats["positions"] == sum(CPU_PROMPT_LENS) + len(CPU_PROMPT_LENS) * CPU_DECODE
    assert stats["close_positions"] >= MIN_CLOSE_POSITIONS, stats
    assert stats["agreement_tie_aware"] >= 0.99, stats
    return stats

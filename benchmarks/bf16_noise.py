"""How far bfloat16 alone moves the random parity models, by their attention's sharpness.

    python benchmarks/bf16_noise.py [--archs llama qwen3 ...] [--qk-scales 2 1]
        [--device cpu|cuda] [--backend torch_native] [--name bf16_noise]

The GPU parity test (tests/gpu/test_parity_gpu.py) holds sluice's bf16 logits to transformers'
bf16 on >= 99% of teacher-forced positions. On a random model the bar is only meaningful if
bf16 rounding by itself rarely changes the argmax: where transformers' own bf16 disagrees with
its float32 on a sixth of the positions, two correct bf16 engines that round in different
orders disagree often too. This measures that floor on the parity models (tests/
teacher_forcing.py: BF16_SHAPE, the same four sequences per arch) for each query / key scale of
`sluice make-tiny-model --qk-scale` (the tiny models' default 2, transformers' init 1):

* `hf16_vs_hf32`: transformers in bf16 against itself in float32 (the floor);
* `ours16_vs_hf16`: sluice's model runner in bf16 (`--backend`, torch_native by default)
  against transformers in bf16: what the parity test scores (on the GPU with flashinfer);
* `ours16_vs_hf32`: sluice in bf16 against transformers in float32.

Each: argmax agreement, tie-aware agreement (`tests.teacher_forcing.score`) and the mean and
max |delta logprob| of the chosen token. On a CPU both engines mostly run the same torch ops,
so `ours16_vs_hf16` is close to 1 there; the floor is what carries over to the GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from benchmarks.common import parse_noise_args, print_table, write_noise_result  # noqa: E402
from tests.teacher_forcing import (  # noqa: E402
    bf16_parity_model,
    bf16_sequences,
    hf_logits,
    runner_teacher_forced,
    score_pairs,
)

ARCHS = ("llama", "qwen3", "gpt2", "qwen3_moe", "qwen2_moe-sliding", "gemma2", "gemma3_text")
KEYS = ("agreement", "agreement_tie_aware", "mean_abs_dlogprob", "max_abs_dlogprob")
PAIRS = {
    "hf16_vs_hf32": ("hf16", "hf32"),
    "ours16_vs_hf16": ("ours16", "hf16"),
    "ours16_vs_hf32": ("ours16", "hf32"),
}


def measure(arch: str, qk_scale: float, seed: int, args: argparse.Namespace,
            root: str) -> dict[str, Any]:  # fmt: skip
    path = bf16_parity_model(root, arch, qk_scale)
    seqs, prompt_lens = bf16_sequences(seed)
    runs = {
        "hf32": hf_logits(path, seqs, args.device, torch.float32),
        "hf16": hf_logits(path, seqs, args.device, torch.bfloat16),
        "ours16": runner_teacher_forced(path, seqs, prompt_lens, args.device, args.backend),
    }
    return {"arch": arch, "qk_scale": qk_scale, **score_pairs(runs, PAIRS, KEYS)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="torch_native")
    args = parse_noise_args(ap, list(ARCHS), "bf16_noise", argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="sluice-bf16-noise-") as root:
        for arch in args.archs:
            seed = ARCHS.index(arch) if arch in ARCHS else 0  # (the parity test's seed)
            for qk in args.qk_scales:
                rows.append(measure(arch, qk, seed, args, root))
                print(rows[-1], flush=True)
    print_table(rows, ["arch", "qk_scale", "positions", "hf16_vs_hf32.agreement",
                       "hf16_vs_hf32.agreement_tie_aware", "hf16_vs_hf32.mean_abs_dlogprob",
                       "ours16_vs_hf16.agreement", "ours16_vs_hf32.agreement"])  # fmt: skip
    summary: dict[str, Any] = {}
    for qk in args.qk_scales:
        mine = [r for r in rows if r["qk_scale"] == qk]
        for key in ("hf16_vs_hf32.agreement", "hf16_vs_hf32.agreement_tie_aware",
                    "ours16_vs_hf16.agreement"):  # fmt: skip
            summary[f"min_{key.replace('.', '_')}_qk{qk:g}"] = min(r[key] for r in mine)
    write_noise_result(args, rows, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())

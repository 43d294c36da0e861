"""The Triton kernels compile for the H100 (sm_90a) without spilling or overflowing shared memory.

The other kernel tests run in the interpreter, which compiles nothing; this one runs
`kernels.compile_check` (the real Triton compiler and ptxas, no GPU needed) in a child process,
because this process's Triton was imported in interpreter mode (tests/conftest.py) and stays so.
The expected variants are listed here, not taken from the module, so a case that stops being
compiled fails the test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# (the decode kernel merges its splits itself; the merge kernel is the "merge kernel" case's)
ATTENTION_KERNELS = ("_decode_split_kernel", "_extend_kernel")
DTYPES = ("float32", "float16", "bfloat16")
HEAD_DIMS = (64, 128)
HEAD_SHAPES = ((12, 12), (32, 8), (28, 4))
WINDOW_HEAD_SHAPES = ((32, 8), (28, 4))  # sliding-window attention, a window of 4096
# head_dim 256: gemma-2-2b's full and local layers (scores soft-capped at 50), gemma-3-1b's
GEMMA_CASES = (
    (8, 4, "gemma cap 50"), (8, 4, "gemma window 4096 cap 50"), (4, 1, "gemma"),
    (4, 1, "gemma window 512"),
)  # fmt: skip
# attention sinks at gpt-oss-20b's heads (64 over 8, head_dim 64), full and windowed at 128
SINK_CASES = ("sinks", "sinks window 128")
# the fused MoE at Qwen3-30B-A3B's and Mixtral-8x7B's shapes, decode and prefill row blocks
MOE_CASES = [
    f"moe {shape} T{tokens}"
    for shape in ("H2048 E128 k8 I768", "H4096 E8 k2 I14336")
    for tokens in (4, 1024)
]
MOE_CASES += [f"moe gpt-oss T{tokens}" for tokens in (4, 1024)]  # biases, [E, in, out] weights
# integer experts (engine/layers/int_experts.py) at Qwen3-30B-A3B's shape: W4A16 in groups of
# 128 (with zero points too; with GPTQ's activation ordering, on one rank or a rank's half
# of the down projection's columns), W8A16 per channel
MOE_CASES += [f"moe int {kind} T{tokens}"
              for kind in ("w4 g128", "w4 g128 asym", "w4 g128 act order",
                           "w4 g128 act order part", "w8 channel")
              for tokens in (4, 1024)]  # fmt: skip
# float8 experts (engine/layers/fp8_experts.py) at that shape: a block checkpoint's scales
# (128 columns a scale) and a per-tensor one's, held per row; a rank's part of 8 that starts
# inside a block
MOE_CASES += [f"moe fp8 {kind} T{tokens}" for kind in ("block 128", "tensor", "block 128 part")
              for tokens in (4, 1024)]  # fmt: skip
# the FP8 W8A8 GEMM of a 4096 x 4096 layer: 128 x 128 block scales and per-channel ones
FP8_CASES = [f"fp8 gemm group {g} T{t}" for g in ((128, 128), (1, 4096)) for t in (4, 1024)]
# weight-only integer GEMMs (kernels/int_gemm.py): W4A16 in groups of 128 (16- and 64-row
# blocks; with zero points), W8A16 per channel
INT_CASES = ("int w4 g128 T4", "int w4 g128 T1024", "int w4 g128 asym T1024",
             "int w8 channel T1024",
             "int w4 g128 act order part T1024")  # (a row-parallel part: each column's group)
# their one-row GEMV: 4 rows a program, 1024 columns a step (2048 from K 8192: Llama-3-8B's
# down projection, K 14336)
INT_GEMV_CASES = ("int gemv w4 g128", "int gemv w4 g128 asym", "int gemv w4 g128 K14336",
                  "int gemv w8 channel", "int gemv w8 channel K14336",
                  "int gemv w4 g128 act order part")  # fmt: skip
# one token: the float8 GEMV (a block checkpoint's and per channel; K steps of 1024 and 2048)
FP8_GEMV_CASES = [f"fp8 gemv group {g} K{k}" for k in (4096, 8192) for g in (128, 1)]
# its activations' quantization: per token (K 4096) and in 128-column groups (K 8192)
FP8_QUANT_CASES = ("fp8 quantize K4096 group 4096", "fp8 quantize K8192 group 128",
                   "int8 quantize K4096")  # (and W8A8 int8's per-token rows)
# an FP8 KV cache: bf16/fp16 queries over float8 pools (GQA shapes), store_kv of float8 rows
FP8_KV_CASES = ("kv e4m3", "kv e5m2")
# the elementwise kernels: RMSNorm (with the residual add or not) up to the widest row it takes,
# LayerNorm (GPT-2 / BERT widths), SiLU-and-mul, gelu_new, rotary of q and k stacked (and with
# the K/V store)
NORM_CASES = [f"{add}rms_norm H{h}" for h in (128, 2048, 4096, 8192, 16384) for add in ("", "add_")]
NORM_CASES += [f"{add}layer_norm H{h}" for h in (768, 1024) for add in ("", "add_")]
# the small-batch GEMV at Llama 3.2 1B's projections (one row and four), the down projection
# with the MLP's activation in its prologue, qkv and gate_up with the add + RMSNorm in theirs;
# greedy sampling's argmax over 128256 logits
GEMV_CASES = [f"gemv M{m} N{n} K{k}" for n, k in ((3072, 2048), (16384, 2048), (2048, 8192),
                                                (128256, 2048)) for m in (1, 4)]  # fmt: skip
GEMV_CASES += [f"gemv silu_mul M{m} N2048 K8192" for m in (1, 4)]
GEMV_CASES += [f"gemv add_rms_norm M{m} N{n} K2048" for n in (3072, 16384) for m in (1, 4)]
SILU_CASES = ("silu_and_mul I8192", "silu_and_mul I14336")
SHARED_LIMIT_SM90 = 232448  # 227 KB, the most one block may opt into on an H100
# every kernel once more as --enable-pdl compiles it (bf16 at the engine's decode shapes):
# griddepcontrol.wait before any global memory access (kernels.jit.pdl_prologue)
PDL_VARIANTS = [
    ("_decode_split_kernel", "bfloat16", 128, 32, 8, "pdl"),
    ("_extend_kernel", "bfloat16", 128, 32, 8, "pdl"),
    ("_decode_split_kernel", "bfloat16", 128, 32, 8, "pdl merge kernel"),
    ("_decode_merge_kernel", "bfloat16", 128, 32, 8, "pdl merge kernel"),
    ("_rotary_kernel", "bfloat16", 128, 32, 8, "pdl rotary store"),
    ("_decode_split_kernel", "bfloat16", 64, 12, 12, "pdl store kv"),
    ("_store_kv_kernel", "bfloat16", 128, None, 8, "pdl"),
    ("_norm_kernel", "bfloat16", None, None, None, "pdl add_rms_norm H2048"),
    ("_norm_kernel", "bfloat16", None, None, None, "pdl add_layer_norm H768"),
    ("_silu_and_mul_kernel", "bfloat16", None, None, None, "pdl silu_and_mul I8192"),
    ("_gelu_new_kernel", "bfloat16", None, None, None, "pdl gelu_new"),
    ("_argmax_chunks_kernel", "float32", None, None, None, "pdl argmax"),
    ("_argmax_rows_kernel", "float32", None, None, None, "pdl argmax"),
    ("_resolve_kernel", "int64", None, None, None, "pdl resolve"),
    ("_page_ids_kernel", "int32", None, None, None, "pdl page 16 bs256"),
    ("_grouped_gemm_kernel", "bfloat16", None, None, None, "pdl moe H2048 E128 k8 I768 T4 #1"),
    ("_grouped_gemm_kernel", "bfloat16", None, None, None, "pdl moe H2048 E128 k8 I768 T4 #2"),
    ("_fp8_gemm_kernel", "bfloat16", None, None, None, "pdl fp8 gemm group (128, 128) T4"),
    ("_quantize_rows_kernel", "bfloat16", None, None, None, "pdl fp8 quantize K2048"),
    ("_fp8_gemv_kernel", "bfloat16", None, None, None, "pdl fp8 gemv group 128 K4096"),
    ("_int_gemm_kernel", "bfloat16", None, None, None, "pdl int w4 g128 T4"),
    ("_int_gemv_kernel", "bfloat16", None, None, None, "pdl int gemv w4 g128"),
    ("_fp8_gemv_kernel", "bfloat16", None, None, None, "pdl int8 gemv K4096"),
    ("_gemv_kernel", "bfloat16", None, None, None, "pdl gemv add_rms_norm M1 N3072 K2048"),
    ("_gemv_kernel", "bfloat16", None, None, None, "pdl gemv silu_mul M1 N2048 K8192"),
    ("_gemv_kernel", "bfloat16", None, None, None, "pdl gemv M4 N2048 K2048"),
]


def expected_variants() -> list[tuple]:
    """(kernel, dtype, head_dim, Hq, Hk, case) for every kernel the launchers must have
    compiled."""
    rows = [
        (kernel, dtype, head_dim, hq, hk)
        for dtype in DTYPES
        for head_dim in HEAD_DIMS
        for hq, hk in HEAD_SHAPES
        for kernel in ATTENTION_KERNELS
    ]
    rows += [("_store_kv_kernel", dtype, d, None, 8) for dtype in DTYPES for d in (*HEAD_DIMS, 256)]
    rows = [(*row, None) for row in rows]
    rows += [
        (kernel, dtype, head_dim, 32, 8, "merge kernel")
        for dtype in DTYPES
        for head_dim in HEAD_DIMS
        for kernel in ("_decode_split_kernel", "_decode_merge_kernel")
    ]
    rows += [
        ("_extend_kernel", dtype, head_dim, 32, 8, case)
        for dtype in DTYPES
        for head_dim in HEAD_DIMS
        for case in ("tree mask", "tree mask window 4096")
    ]
    rows += [
        ("_decode_split_kernel", dtype, head_dim, 12, 12, "store kv")
        for dtype in DTYPES
        for head_dim in HEAD_DIMS
    ]
    rows += [
        (kernel, dtype, 256, hq, hk, case)
        for dtype in DTYPES
        for hq, hk, case in GEMMA_CASES
        for kernel in ATTENTION_KERNELS
    ]
    rows += [
        (kernel, dtype, 64, 64, 8, case)
        for dtype in DTYPES
        for case in SINK_CASES
        for kernel in ATTENTION_KERNELS
    ]
    rows += [
        (kernel, dtype, head_dim, hq, hk, "window 4096")
        for dtype in DTYPES
        for head_dim in HEAD_DIMS
        for hq, hk in WINDOW_HEAD_SHAPES
        for kernel in ATTENTION_KERNELS
    ]
    rows += [
        ("_grouped_gemm_kernel", dtype, None, None, None, f"{case} #{gemm}")
        for dtype in DTYPES
        for case in MOE_CASES
        for gemm in (1, 2)
    ]
    rows += [
        ("_fp8_gemm_kernel", dtype, None, None, None, case)
        for dtype in DTYPES
        for case in FP8_CASES
    ]
    rows += [
        ("_fp8_gemv_kernel", dtype, None, None, None, case)
        for dtype in DTYPES
        for case in FP8_GEMV_CASES
    ]
    rows += [
        ("_int_gemm_kernel", dtype, None, None, None, case)
        for dtype in DTYPES
        for case in INT_CASES
    ]
    rows += [
        ("_int_gemv_kernel", dtype, None, None, None, case)
        for dtype in DTYPES
        for case in INT_GEMV_CASES
    ]
    rows += [  # W8A8 int8's one-row GEMV (the float8 one's int8 mode), out in each dtype
        ("_fp8_gemv_kernel", dtype, None, None, None, f"int8 gemv K{k}")
        for dtype in DTYPES
        for k in (4096, 8192)
    ]
    rows += [
        ("_quantize_rows_kernel", dtype, None, None, None, case)
        for dtype in DTYPES
        for case in FP8_QUANT_CASES
    ]
    rows += [
        (kernel, dtype, head_dim, hq, hk, case)
        for case in FP8_KV_CASES
        for dtype in ("bfloat16", "float16")
        for head_dim in HEAD_DIMS
        for hq, hk in HEAD_SHAPES[1:]
        for kernel in ATTENTION_KERNELS
    ]
    rows += [
        ("_store_kv_kernel", "bfloat16", d, None, 8, case)
        for case in FP8_KV_CASES
        for d in (*HEAD_DIMS, 256)
    ]
    rows += [("_resolve_kernel", "int64", None, None, None, None)]
    rows += [
        ("_page_ids_kernel", "int32", None, None, None, f"page {page} bs{bs}{prefix}")
        for page in (1, 16)
        for bs in (1, 256)
        for prefix in ("", " prefix")
    ]
    for dtype in DTYPES:
        rows += [("_norm_kernel", dtype, None, None, None, case) for case in NORM_CASES]
        rows += [("_gemv_kernel", dtype, None, None, None, case) for case in GEMV_CASES]
        rows += [("_silu_and_mul_kernel", dtype, None, None, None, case) for case in SILU_CASES]
        rows += [("_gelu_new_kernel", dtype, None, None, None, "gelu_new")]
        rows += [
            ("_rotary_kernel", dtype, head_dim, hq, hk, case)
            for head_dim in HEAD_DIMS
            for hq, hk in HEAD_SHAPES
            for case in ("rotary", "rotary store")
        ]
    rows += [
        (kernel, dtype, None, None, None, "argmax")
        for dtype in ("float32", "bfloat16")
        for kernel in ("_argmax_chunks_kernel", "_argmax_rows_kernel")
    ]
    return rows + PDL_VARIANTS


def _key(variant: dict) -> tuple:
    keys = ("kernel", "dtype", "head_dim", "num_heads", "num_kv_heads", "case")
    return tuple(variant.get(k) for k in keys)


def _require_nvidia_compiler() -> None:
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = get_ptxas(90).path
    except Exception as exc:  # ImportError, or knobs failing to locate the binary
        pytest.skip(f"triton's NVIDIA backend or its ptxas is missing: {exc!r}")
    if not os.access(ptxas, os.X_OK):
        pytest.skip(f"triton's bundled ptxas is missing or not executable: {ptxas}")


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    _require_nvidia_compiler()
    tmp = tmp_path_factory.mktemp("compile_check")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp / "triton-cache")
    out = tmp / "report.json"
    cmd = [sys.executable, "-m", "kernels.compile_check", "--arch", "90", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    # exit status 1 means "problems found"; the tests below say which
    assert proc.returncode in (0, 1) and out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def variants_by_key(report: dict) -> dict[tuple, dict]:
    return {_key(v): v for v in report["variants"]}


@pytest.mark.slow
def test_every_variant_compiles_within_the_sm90_limits(report: dict) -> None:
    assert report["target"]["arch"] == 90
    found = variants_by_key(report)
    missing = [k for k in expected_variants() if k not in found]
    assert not missing, f"variants not compiled: {missing}"
    for key in expected_variants():
        v = found[key]
        assert v["registers"] is not None, f"{key}: {v['problems']}"
        assert v["shared"] <= SHARED_LIMIT_SM90, f"{key}: {v['shared']} B of shared memory"
        assert v["registers"] * v["num_warps"] * 32 <= 65536, f"{key}: register file"


@pytest.mark.slow
def test_no_compiled_variant_has_a_problem(report: dict) -> None:
    """Every variant the launchers compiled, listed here or not (a case added to
    kernels/compile_cases.py before this list: "32 kv splits" had spilled 4 B unseen), is
    within the limits and spills nothing."""
    bad = [(_key(v), v["problems"]) for v in report["variants"] if v["problems"]]
    assert not bad, bad


@pytest.mark.slow
@pytest.mark.parametrize(
    "key",
    expected_variants(),
    ids=lambda k: "-".join(str(x) for x in k if x is not None),
)
def test_no_register_spills(report: dict, key: tuple) -> None:
    v = variants_by_key(report).get(key)
    assert v is not None and v["registers"] is not None, f"{key} did not compile"
    assert (v["spill_stores"], v["spill_loads"]) == (0, 0), f"{key}: stack {v['stack']} B"


@pytest.mark.slow
def test_pdl_kernels_wait_before_they_touch_memory(report: dict) -> None:
    """With --enable-pdl a kernel may start while the one before it still writes: its PTX
    must have griddepcontrol.wait before any global load, store or atomic, and
    launch_dependents after it (`compile_check.pdl_problems`); without PDL, no griddepcontrol
    at all. A kernel missing from PDL_VARIANTS fails here too."""
    found = variants_by_key(report)
    kernels = {v["kernel"] for v in report["variants"]}
    assert kernels == {key[0] for key in PDL_VARIANTS}, "a kernel without a PDL variant"
    for key in PDL_VARIANTS:
        assert key in found and found[key]["pdl"], f"{key}: not compiled with PDL"
    for v in report["variants"]:
        assert v["pdl"] == (v["case"] or "").startswith("pdl"), _key(v)
        ordering = [p for p in v["problems"] if "griddepcontrol" in p or "PDL" in p]
        assert not ordering, f"{_key(v)}: {ordering}"

"""The cases `kernels.compile_check` compiles: every Triton kernel at the shapes, dtypes and
variants the engine launches (attention with GQA, windows and soft-caps, the float8 cache, the
fused MoE, the FP8 GEMM, the layers' elementwise kernels, the GEMV with its prologues, argmax,
the page table). Each case is (labels, launch): launching runs the kernel's own launcher on
CPU tensors, which `compile_check.offline_compiler` turns into a compile for the target.
The quantized weights' kernels (integer and float8 experts, the FP8 and integer GEMMs and
GEMVs, W8A8) are kernels/compile_cases_quant.py's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from kernels.activation import gelu_new, silu_and_mul
from kernels.argmax import argmax_rows
from kernels.compile_cases_quant import (
    QWEN3_MOE,
    launch_fp8,
    launch_int,
    launch_int8_gemv,
    quantized_weight_cases,
)
from kernels.decode_attention import decode_attention, merge_counters
from kernels.extend_attention import extend_attention
from kernels.fp8_gemm import quantize_rows
from kernels.fused_moe import fused_experts_triton
from kernels.fused_norm import fused_add_layer_norm, fused_add_rms_norm, rms_norm
from kernels.future_tokens import resolve_future_tokens_triton
from kernels.gemv import RMSNormInput, gemv
from kernels.jit import use_pdl
from kernels.kv_store import store_kv
from kernels.page_table import page_ids
from kernels.rotary import KVStore, apply_rotary

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
HEAD_DIMS = (64, 128)
HEAD_SHAPES = ((12, 12), (32, 8), (28, 4))  # (Hq, Hk): GPT-2, Llama-3.2-1B, Qwen2 (group 7)
# sliding-window attention (its own kernel variants): Mistral-7B-v0.1's window and heads, and
# Qwen2's heads
WINDOW = 4096
WINDOW_HEAD_SHAPES = ((32, 8), (28, 4))
# head_dim 256 (Gemma 2 and 3), (Hq, Hk, window, attention soft-cap): gemma-2-2b's full and
# local layers (window 4096, scores capped at 50), gemma-3-1b's (window 512, no cap)
GEMMA_HEAD_DIM = 256
GEMMA_CASES = ((8, 4, None, 50.0), (8, 4, 4096, 50.0), (4, 1, None, None), (4, 1, 512, None))
# attention sinks (gpt-oss-20b's heads: 64 over 8 KV heads of 64; every other layer windowed
# at 128 keys)
SINK_CASES = ((64, 8, None), (64, 8, 128))
STORE_KV_HEADS = 8
# an FP8 KV cache (bf16 / fp16 models): the attention kernels read float8, store_kv copies it
FP8_KV_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
# (hidden, experts, top_k, expert intermediate): Qwen3-30B-A3B, Mixtral-8x7B
MOE_SHAPES = (QWEN3_MOE, (4096, 8, 2, 14336))
# the elementwise kernels: RMSNorm rows (a per-head q/k norm up to the widest hidden the
# kernel takes), SiLU-and-mul of Llama-3.2-1B's and Mistral-7B's intermediate sizes
NORM_HIDDEN = (128, 2048, 4096, 8192, 16384)
SILU_INTER = (8192, 14336)


def _launch(
    dtype: torch.dtype, hq: int, hk: int, head_dim: int, attention: bool, window_left: int = -1,
    logit_cap: float = 0.0, kv_dtype: torch.dtype | None = None, num_splits: int = 8,
    extend: bool = True, merge: str = "fused", store: bool = False, sinks: bool = False,
    tree: bool = False,
) -> None:
    """Call the attention launchers (or store_kv) on a small batch in the engine's layouts: q/k/v
    are column slices of a fused qkv, req_to_token is int32 with 4096 columns. Nothing is read.
    `kv_dtype` (float8): an FP8 KV cache, whose new k/v arrive quantized ([N, Hk, D]).
    `store`: the decode kernel writes the new K/V (16-bit pools where no rotary kernel did)."""
    batch, tokens, slots = 4, 64, 4096
    qkv = torch.empty(tokens, (hq + 2 * hk) * head_dim, dtype=dtype)
    q, k, v = qkv.split([hq * head_dim, hk * head_dim, hk * head_dim], dim=-1)
    if kv_dtype is not None:
        k, v = torch.empty(2, tokens, hk, head_dim, dtype=kv_dtype)
    k_buf, v_buf = torch.empty(2, slots, hk, head_dim, dtype=kv_dtype or dtype)
    if not attention:
        store_kv(k_buf, v_buf, torch.arange(tokens), k, v)
        return
    q = q.reshape(tokens, hq, head_dim)
    r2t, rows = torch.zeros(16, 4096, dtype=torch.int32), torch.arange(batch)
    lens = torch.full((batch,), tokens // batch)
    prefix_lens, start_loc, scale = lens + 100, torch.cumsum(lens, 0) - lens, head_dim**-0.5
    counts = merge_counters(batch, hk, q.device) if merge == "fused" else None
    new_kv = (k[:batch], v[:batch], torch.arange(batch)) if store else None
    head_sinks = torch.zeros(hq, dtype=dtype) if sinks else None
    decode_attention(q[:batch], k_buf, v_buf, r2t, rows, prefix_lens + 1, scale,
                     num_splits=num_splits, window_left=window_left, logit_cap=logit_cap,
                     merge_counter=counts, new_kv=new_kv, sinks=head_sinks)  # fmt: skip
    if not extend:
        return
    n = tokens // batch  # (a draft tree's masks: `tree`, a verify step's)
    masks = (torch.ones(batch * n * n, dtype=torch.uint8), torch.arange(batch) * n * n)
    extend_attention(
        q, k, v, k_buf, v_buf, r2t, rows, prefix_lens, lens, start_loc, n, scale,
        window_left=window_left, logit_cap=logit_cap, sinks=head_sinks,
        tree_mask=masks if tree else None,
        positions=torch.zeros(tokens, dtype=torch.int64) if tree and window_left >= 0 else None,
    )


def gemma_case(window: int | None, cap: float | None) -> str:
    return " ".join(
        ["gemma"] + ([f"window {window}"] if window else []) + ([f"cap {cap:g}"] if cap else [])
    )


def moe_case(shape: tuple[int, int, int, int], tokens: int) -> str:
    hidden, experts, top_k, inter = shape
    return f"moe H{hidden} E{experts} k{top_k} I{inter} T{tokens}"


def _launch_moe(dtype: torch.dtype, shape: tuple[int, int, int, int], tokens: int) -> None:
    """Both grouped GEMMs of the fused MoE at `tokens` tokens (decode or prefill blocks)."""
    hidden, experts, top_k, inter = shape
    x = torch.empty(tokens, hidden, dtype=dtype)
    w13 = torch.empty(experts, 2 * inter, hidden, dtype=dtype)
    w2 = torch.empty(experts, hidden, inter, dtype=dtype)
    ids = torch.arange(tokens * top_k).remainder(experts).view(tokens, top_k)
    fused_experts_triton(x, w13, w2, torch.full(ids.shape, 1.0 / top_k), ids)


def _launch_moe_gpt_oss(dtype: torch.dtype, tokens: int) -> None:
    """gpt-oss-20b's experts (32, top 4, 2880 wide): weights stored [E, in, out] (transposed
    views for the kernels), biases, an activation of interleaved gate and up columns."""
    hidden = inter = 2880
    x = torch.empty(tokens, hidden, dtype=dtype)
    w13 = torch.empty(32, hidden, 2 * inter, dtype=dtype).transpose(1, 2)
    w2 = torch.empty(32, inter, hidden, dtype=dtype).transpose(1, 2)
    b13, b2 = torch.empty(32, 2 * inter, dtype=dtype), torch.empty(32, hidden, dtype=dtype)
    ids = torch.arange(tokens * 4).remainder(32).view(tokens, 4)
    fused_experts_triton(x, w13, w2, torch.full(ids.shape, 0.25), ids, b13, b2,
                         lambda gate_up: gate_up[:, ::2] * gate_up[:, 1::2])  # fmt: skip


def _launch_norm(dtype: torch.dtype, hidden: int, residual: bool) -> None:
    """RMSNorm of 64 rows, with the residual add or without."""
    x, res = torch.empty(2, 64, hidden, dtype=dtype)
    weight = torch.empty(hidden, dtype=dtype)
    if residual:
        fused_add_rms_norm(x, res, weight, 1e-6)
    else:
        rms_norm(x, weight, 1e-6)


def _launch_rotary(dtype: torch.dtype, hq: int, hk: int, head_dim: int, store: bool) -> None:
    """q and k stacked, a view of a fused qkv, as llama.py rotates them; with `store`, K and V
    written into a pool by the same kernel (`rotate_and_store`)."""
    tokens = 64
    qkv = torch.empty(tokens, (hq + 2 * hk) * head_dim, dtype=dtype)
    qk = qkv[:, : (hq + hk) * head_dim].view(tokens, hq + hk, head_dim)
    cache = torch.empty(4096, head_dim, dtype=dtype)
    kv_store = None
    if store:
        k_buf, v_buf = torch.empty(2, 1024, hk, head_dim, dtype=dtype)
        loc = torch.zeros(tokens, dtype=torch.int64)
        kv_store = KVStore(k_buf, v_buf, loc, qkv[:, (hq + hk) * head_dim :], hq)
    apply_rotary(torch.zeros(tokens, dtype=torch.int64), qk, cache, head_dim, kv_store)


def _elementwise_cases() -> Iterator[tuple[dict[str, Any], Callable[[], None]]]:
    for name, dtype in DTYPES.items():
        for hidden in NORM_HIDDEN:
            for residual in (False, True):
                case = f"{'add_' if residual else ''}rms_norm H{hidden}"
                yield {"dtype": name, "case": case}, functools.partial(
                    _launch_norm, dtype, hidden, residual
                )
        for inter in SILU_INTER:
            x = torch.empty(64, 2 * inter, dtype=dtype)
            yield {"dtype": name, "case": f"silu_and_mul I{inter}"}, functools.partial(
                silu_and_mul, x
            )
        x = torch.empty(64, 3072, dtype=dtype)  # GPT-2's MLP width
        yield {"dtype": name, "case": "gelu_new"}, functools.partial(gelu_new, x)
        for hidden in (768, 1024):  # GPT-2 / BERT-base, BERT-large: LayerNorm, the add fused
            x, w = torch.empty(64, hidden, dtype=dtype), torch.empty(hidden, dtype=dtype)
            for res in (None, x):
                case = f"{'add_' if res is not None else ''}layer_norm H{hidden}"
                yield {"dtype": name, "case": case}, functools.partial(
                    fused_add_layer_norm, x, res, w, w, 1e-5
                )
        for head_dim in HEAD_DIMS:
            for hq, hk in HEAD_SHAPES:
                for store in (False, True):
                    case = "rotary store" if store else "rotary"
                    labels = {"dtype": name, "head_dim": head_dim, "num_heads": hq,
                              "num_kv_heads": hk, "case": case}  # fmt: skip
                    launch = functools.partial(_launch_rotary, dtype, hq, hk, head_dim, store)
                    yield labels, launch


def cases() -> Iterator[tuple[dict[str, Any], Callable[[], None]]]:
    """(labels, launch) for every case the check covers."""
    for name, dtype in DTYPES.items():
        for head_dim in HEAD_DIMS:
            for hq, hk in HEAD_SHAPES:
                labels = {"dtype": name, "head_dim": head_dim, "num_heads": hq, "num_kv_heads": hk}
                yield labels, functools.partial(_launch, dtype, hq, hk, head_dim, attention=True)
                if (hq, hk) == (32, 8):  # the Triton backend's most splits (batch 1)
                    yield {**labels, "case": "32 kv splits"}, functools.partial(
                        _launch, dtype, hq, hk, head_dim, attention=True, num_splits=32,
                        extend=False,
                    )  # fmt: skip
                    # --triton-decode-merge kernel: stage 1 without the merge, then stage 2
                    yield {**labels, "case": "merge kernel"}, functools.partial(
                        _launch, dtype, hq, hk, head_dim, attention=True, extend=False,
                        merge="kernel",
                    )  # fmt: skip
                if (hq, hk) == (32, 8):  # speculative verify steps of draft trees
                    yield {**labels, "case": "tree mask"}, functools.partial(
                        _launch, dtype, hq, hk, head_dim, attention=True, tree=True
                    )
                if (hq, hk) == (12, 12):  # GPT-2: no rotary, the decode kernel stores K/V
                    yield {**labels, "case": "store kv"}, functools.partial(
                        _launch, dtype, hq, hk, head_dim, attention=True, extend=False,
                        store=True,
                    )  # fmt: skip
            for hq, hk in WINDOW_HEAD_SHAPES:
                labels = {"dtype": name, "head_dim": head_dim, "num_heads": hq, "num_kv_heads": hk,
                          "case": f"window {WINDOW}"}  # fmt: skip
                yield labels, functools.partial(
                    _launch, dtype, hq, hk, head_dim, attention=True, window_left=WINDOW - 1
                )
                if (hq, hk) == (32, 8):  # draft trees in a window: the tokens' positions
                    yield {**labels, "case": f"tree mask window {WINDOW}"}, functools.partial(
                        _launch, dtype, hq, hk, head_dim, attention=True,
                        window_left=WINDOW - 1, tree=True,
                    )  # fmt: skip
        for head_dim in (*HEAD_DIMS, GEMMA_HEAD_DIM):
            kv = STORE_KV_HEADS  # store_kv's code depends on dtype and head_dim only
            labels = {"dtype": name, "head_dim": head_dim, "num_kv_heads": kv}
            yield labels, functools.partial(_launch, dtype, kv, kv, head_dim, attention=False)
        for hq, hk, window, cap in GEMMA_CASES:
            labels = {"dtype": name, "head_dim": GEMMA_HEAD_DIM, "num_heads": hq,
                      "num_kv_heads": hk, "case": gemma_case(window, cap)}  # fmt: skip
            yield labels, functools.partial(
                _launch, dtype, hq, hk, GEMMA_HEAD_DIM, attention=True,
                window_left=(window or 0) - 1, logit_cap=cap or 0.0,
            )  # fmt: skip
        for hq, hk, window in SINK_CASES:
            labels = {"dtype": name, "head_dim": 64, "num_heads": hq, "num_kv_heads": hk,
                      "case": "sinks" + (f" window {window}" if window else "")}  # fmt: skip
            yield labels, functools.partial(
                _launch, dtype, hq, hk, 64, attention=True, window_left=(window or 0) - 1,
                sinks=True,
            )  # fmt: skip
    for name, kv_dtype in FP8_KV_DTYPES.items():
        for model_dtype in ("bfloat16", "float16"):
            for head_dim in HEAD_DIMS:
                for hq, hk in HEAD_SHAPES[1:]:
                    labels = {"dtype": model_dtype, "head_dim": head_dim, "num_heads": hq,
                              "num_kv_heads": hk, "case": f"kv {name}"}  # fmt: skip
                    yield labels, functools.partial(
                        _launch, DTYPES[model_dtype], hq, hk, head_dim, attention=True,
                        kv_dtype=kv_dtype,
                    )  # fmt: skip
        for head_dim in (*HEAD_DIMS, GEMMA_HEAD_DIM):
            kv = STORE_KV_HEADS  # float8 in, float8 stored
            labels = {"dtype": "bfloat16", "head_dim": head_dim, "num_kv_heads": kv,
                      "case": f"kv {name}"}  # fmt: skip
            yield labels, functools.partial(
                _launch, torch.bfloat16, kv, kv, head_dim, attention=False, kv_dtype=kv_dtype
            )
    for name, dtype in DTYPES.items():
        for shape in MOE_SHAPES:
            for tokens in (4, 1024):  # 16-row and 64-row blocks
                labels = {"dtype": name, "case": moe_case(shape, tokens)}
                yield labels, functools.partial(_launch_moe, dtype, shape, tokens)
        for tokens in (4, 1024):
            labels = {"dtype": name, "case": f"moe gpt-oss T{tokens}"}
            yield labels, functools.partial(_launch_moe_gpt_oss, dtype, tokens)
    yield from quantized_weight_cases(DTYPES)
    ids, future = torch.zeros(300, dtype=torch.int64), torch.zeros(512, dtype=torch.int64)
    yield {"dtype": "int64"}, lambda: resolve_future_tokens_triton(ids, future)
    for name in ("float32", "bfloat16"):  # greedy sampling's logits (float32 in the engine)
        logits = torch.zeros(2, 128256, dtype=DTYPES[name])
        yield {"dtype": name, "case": "argmax"}, functools.partial(argmax_rows, logits)
    yield from _page_table_cases()
    yield from _elementwise_cases()
    yield from _gemv_cases()
    yield from _pdl_cases()


def _with_pdl(launch: Callable[[], None]) -> Callable[[], None]:
    """`launch` as under --enable-pdl (`kernels.jit.use_pdl`)."""

    def run() -> None:
        use_pdl(True)
        try:
            launch()
        finally:
            use_pdl(False)

    return run


def _pdl_cases() -> Iterator[tuple[dict[str, Any], Callable[[], None]]]:
    """Every kernel once more as --enable-pdl launches it (bf16, the engine's decode shapes):
    `compile_check.pdl_problems` reads the PTX for a memory access before the wait."""
    bf16, part = torch.bfloat16, functools.partial
    heads = {"dtype": "bfloat16", "head_dim": 128, "num_heads": 32, "num_kv_heads": 8}
    gpt2 = {"dtype": "bfloat16", "head_dim": 64, "num_heads": 12, "num_kv_heads": 12}
    store = {"dtype": "bfloat16", "head_dim": 128, "num_kv_heads": STORE_KV_HEADS, "case": "pdl"}
    attention = [
        ({**heads, "case": "pdl"}, part(_launch, bf16, 32, 8, 128, attention=True)),
        ({**heads, "case": "pdl merge kernel"}, part(
            _launch, bf16, 32, 8, 128, attention=True, extend=False, merge="kernel")),
        ({**heads, "case": "pdl rotary store"}, part(_launch_rotary, bf16, 32, 8, 128, True)),
        ({**gpt2, "case": "pdl store kv"}, part(
            _launch, bf16, 12, 12, 64, attention=True, extend=False, store=True)),
        (store, part(_launch, bf16, STORE_KV_HEADS, STORE_KV_HEADS, 128, attention=False)),
    ]  # fmt: skip
    for labels, launch in attention:
        yield labels, _with_pdl(launch)
    x, w = torch.empty(64, 768, dtype=bf16), torch.empty(768, dtype=bf16)
    others = {
        "add_rms_norm H2048": part(_launch_norm, bf16, 2048, True),
        "add_layer_norm H768": part(fused_add_layer_norm, x, x, w, w, 1e-5),
        "silu_and_mul I8192": part(silu_and_mul, torch.empty(1, 16384, dtype=bf16)),
        "gelu_new": part(gelu_new, torch.empty(1, 3072, dtype=bf16)),
        "argmax": part(argmax_rows, torch.zeros(1, 128256)),
        "resolve": part(resolve_future_tokens_triton, *torch.zeros(2, 64, dtype=torch.int64)),
        "page 16 bs256": part(
            page_ids, torch.zeros(260, 64, dtype=torch.int32), torch.arange(256),
            torch.ones(256, dtype=torch.int64), 16, torch.zeros(256, dtype=torch.int32), None,
        ),
        moe_case(MOE_SHAPES[0], 4): part(_launch_moe, bf16, MOE_SHAPES[0], 4),
        "fp8 gemm group (128, 128) T4": part(launch_fp8, bf16, (128, 128), 4),
        "fp8 quantize K2048": part(quantize_rows, torch.empty(1, 2048, dtype=bf16), 2048),
        "fp8 gemv group 128 K4096": part(launch_fp8, bf16, (128, 128), 1),
        "int w4 g128 T4": part(launch_int, bf16, 4, 128, 4),
        "int gemv w4 g128": part(launch_int, bf16, 4, 128, 1),
        "int8 gemv K4096": part(launch_int8_gemv, bf16),
    }  # fmt: skip
    x1 = torch.zeros(1, 2048, dtype=bf16)
    norm = RMSNormInput(torch.zeros(2048, dtype=bf16), 1e-5, x1, torch.zeros_like(x1))
    gemvs = {  # one row: the reduction (with each prologue), four: the dot
        "gemv add_rms_norm M1 N3072 K2048": part(gemv, x1, torch.zeros(3072, 2048, dtype=bf16),
                                                 norm=norm),
        "gemv silu_mul M1 N2048 K8192": part(gemv, torch.zeros(1, 16384, dtype=bf16),
                                             torch.zeros(2048, 8192, dtype=bf16), act="silu_mul"),
        "gemv M4 N2048 K2048": part(gemv, torch.zeros(4, 2048, dtype=bf16),
                                    torch.zeros(2048, 2048, dtype=bf16)),
    }  # fmt: skip
    for case, launch in {**others, **gemvs}.items():
        dtype = "float32" if case == "argmax" else "int64" if case == "resolve" else "bfloat16"
        dtype = "int32" if case.startswith("page") else dtype
        yield {"dtype": dtype, "case": f"pdl {case}"}, _with_pdl(launch)


def _gemv_cases() -> Iterator[tuple[dict[str, Any], Callable[[], None]]]:
    """The small-batch GEMV at Llama 3.2 1B's projections and lm_head: one row (reduction) and
    four (dot), with gemv_config's tiles; the down projection also with act="silu_mul"."""
    for name, dtype in DTYPES.items():
        for n, k in ((3072, 2048), (16384, 2048), (2048, 8192), (128256, 2048)):
            for rows in (1, 4):
                x, w = torch.zeros(rows, k, dtype=dtype), torch.zeros(n, k, dtype=dtype)
                labels = {"dtype": name, "case": f"gemv M{rows} N{n} K{k}"}
                yield labels, functools.partial(gemv, x, w)
        for rows in (1, 4):  # the down projection with the MLP's activation in its prologue
            x, w = torch.zeros(rows, 16384, dtype=dtype), torch.zeros(2048, 8192, dtype=dtype)
            labels = {"dtype": name, "case": f"gemv silu_mul M{rows} N2048 K8192"}
            yield labels, functools.partial(gemv, x, w, act="silu_mul")
        for n in (3072, 16384):  # qkv and gate_up with the add + RMSNorm before them
            for rows in (1, 4):
                x, w = torch.zeros(rows, 2048, dtype=dtype), torch.zeros(n, 2048, dtype=dtype)
                norm = RMSNormInput(torch.zeros(2048, dtype=dtype), 1e-5, x, torch.zeros_like(x))
                labels = {"dtype": name, "case": f"gemv add_rms_norm M{rows} N{n} K2048"}
                yield labels, functools.partial(gemv, x, w, norm=norm)


def _page_table_cases() -> Iterator[tuple[dict[str, Any], Callable[[], None]]]:
    """flashinfer's page ids: page sizes 1 and 16, a small and a large batch (the block of
    lengths each program sums), with and without the prefix subtraction."""
    table = torch.zeros(260, 64, dtype=torch.int32)
    for page in (1, 16):
        for batch in (1, 256):
            rows, lens = torch.arange(batch), torch.ones(batch, dtype=torch.int64)
            out = torch.zeros(batch, dtype=torch.int32)
            for sub in (None, lens):
                case = f"page {page} bs{batch}{' prefix' if sub is not None else ''}"
                yield {"dtype": "int32", "case": case}, functools.partial(
                    page_ids, table, rows, lens, page, out, sub
                )

"""The KV store kernel and the FutureMap resolve kernel against their torch references (in
the Triton interpreter on CPU, compiled on CUDA); the torch fallback of
`resolve_future_tokens`, which needs no triton."""

from __future__ import annotations

import pytest
import torch

from kernels.reference import store_kv_ref
from kernels.testing import triton_test_device

DEVICE, SKIP_REASON = triton_test_device()  # before anything below imports triton
needs_triton = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")

from kernels.future_tokens import (  # noqa: E402
    resolve_future_tokens,
    resolve_future_tokens_torch,
    resolve_future_tokens_triton,
)


@needs_triton
@pytest.mark.parametrize(
    "kv_dtype,pool_dtype",
    # float32 -> bfloat16 is left out: the interpreter truncates where CUDA rounds to nearest
    [(torch.float32, torch.float32), (torch.float32, torch.float16), (torch.bfloat16,) * 2],
)
def test_store_kv_writes_only_the_given_slots(kv_dtype, pool_dtype):
    from kernels.kv_store import store_kv

    num_slots, heads, head_dim, num_tokens = 40, 3, 64, 7
    gen = torch.Generator().manual_seed(0)
    k_buf = torch.randn(num_slots, heads, head_dim, generator=gen).to(pool_dtype)
    v_buf = torch.randn(num_slots, heads, head_dim, generator=gen).to(pool_dtype)
    # k/v as column slices of a fused projection, cast on store when the dtypes differ
    qkv = torch.randn(num_tokens, 5 * heads * head_dim, generator=gen).to(kv_dtype)
    loc = torch.randperm(num_slots - 1, generator=gen)[:num_tokens] + 1
    k_buf, v_buf, loc, qkv = (x.to(DEVICE) for x in (k_buf, v_buf, loc, qkv))
    k = qkv[:, heads * head_dim : 2 * heads * head_dim]
    v = qkv[:, 3 * heads * head_dim : 4 * heads * head_dim]
    want_k, want_v = k_buf.clone(), v_buf.clone()
    store_kv(k_buf, v_buf, loc, k, v, block=64)  # several blocks per row
    store_kv_ref(want_k, want_v, loc, k, v)
    assert torch.equal(k_buf, want_k)
    assert torch.equal(v_buf, want_v)


def _future_case(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    future = torch.randint(0, 30000, (64,), generator=gen)
    ids = torch.randint(0, 30000, (2500,), generator=gen)
    pending = torch.rand(2500, generator=gen) < 0.3
    ids[pending] = -torch.randint(1, 64, (int(pending.sum()),), generator=gen)
    want = torch.where(ids < 0, future[(-ids).clamp_min(0)], ids)
    return ids.to(dtype), future, want.to(dtype)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_resolve_future_tokens_kernel(dtype):
    ids, future, want = (x.to(DEVICE) for x in _future_case(dtype))
    got = resolve_future_tokens_triton(ids, future, block=1024)  # 3 programs, last partial
    assert got is ids and torch.equal(ids, want)


def test_resolve_future_tokens_on_cpu():
    """CPU tensors take the torch path (with or without triton)."""
    ids, future, want = _future_case(torch.int64)
    got = resolve_future_tokens(ids, future)
    assert got is ids and torch.equal(ids, want)
    assert torch.equal(resolve_future_tokens_torch(want.clone(), future), want)  # idempotent


@needs_triton
def test_a_triton_without_grid_dependency_control_still_runs_the_kernels():
    """Triton before 3.3 has no `gdc_wait`: the kernels still import and run (their prologue
    a no-op) and PDL is never supported, rather than Triton counting as missing."""
    import os
    import subprocess
    import sys

    code = (
        "import sys, triton; sys.modules['triton.language.extra.cuda'] = None\n"
        "import torch\n"
        "import kernels.jit as j\n"
        "assert j.HAS_TRITON and not j.HAS_GDC\n"
        "assert not j.pdl_supported(torch.device('cuda'))\n"
        "from kernels.fused_norm import rms_norm\n"
        "x, w = torch.randn(3, 64), torch.rand(64)\n"
        "want = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))\n"
        "torch.testing.assert_close(rms_norm(x, w, 1e-6), want)\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]

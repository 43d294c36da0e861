"""benchmarks/gpu_gemv.py on CPU in quick mode (the kernel in the Triton interpreter): the
torch / gemv_config / sweep rows and the fused activation's rows are all there and the file
is written, before GPU time is spent
on it. The timings mean nothing here."""

from __future__ import annotations

import json

import pytest

from kernels.testing import triton_test_device

DEVICE, SKIP_REASON = triton_test_device()  # before anything below imports triton
pytestmark = pytest.mark.skipif(SKIP_REASON is not None or DEVICE != "cpu",
                                reason=SKIP_REASON or "the quick mode is the CPU's")


def test_quick_run_writes_every_row(tmp_path, monkeypatch):
    from benchmarks import common, gpu_gemv

    monkeypatch.setattr(common, "RESULTS_DIR", str(tmp_path))
    summary = gpu_gemv.main(["--quick", "--device", "cpu"])
    with open(tmp_path / "gpu_gemv_quick.json") as f:
        doc = json.load(f)
    rows = doc["results"]["rows"]
    assert [(r["shape"], r["rows"]) for r in rows] == [
        ("qkv", 1), ("qkv", 4), ("down", 1), ("down", 4)
    ]
    for r in rows:
        assert r["torch_us"] > 0 and r["gemv_us"] > 0 and r["best_us"] > 0
        assert r["swept"] == 2 and r["wrong"] == 0  # every tile tried agreed with F.linear
    assert summary["gemv_qkv_m1_speedup"] == rows[0]["speedup"]
    fused = doc["results"]["fused"]
    assert [(r["shape"], r["rows"]) for r in fused] == [
        ("down+silu", 1), ("down+silu", 4), ("qkv+norm", 1), ("qkv+norm", 4)
    ]  # (the quick shapes have no gate_up)
    for r in fused:
        assert r["torch_us"] > 0 and r["gemv_us"] > 0 and r["fused_us"] > 0
    assert summary["gemv_down_silu_m4_fused_vs_gemv"] == fused[1]["fused_vs_gemv"]
    assert summary["gemv_qkv_norm_m1_fused_vs_torch"] == fused[2]["fused_vs_torch"]

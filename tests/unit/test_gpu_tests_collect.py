"""The GPU tests (tests/gpu), which CI skips and only a session lent a GPU runs, are at least
importable and well formed: collected here with CUDA reported as available
(tests/gpu_collect.py), every module imports and every parametrization matches its test's
arguments. (A misplaced parametrize decorator sat in tests/gpu/test_int_weight_gpu.py for a
session: the GPU run would have lost two of its tests to a collection error.)"""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_gpu_tests_collect() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "tests.gpu_collect",
         "-p", "no:cacheprovider", "tests/gpu"],
        cwd=ROOT, env={**env, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    collected = [line for line in out.stdout.splitlines() if line.startswith("tests/gpu/")]
    files = {line.split("::")[0] for line in collected}
    want = {f"tests/gpu/{f}" for f in os.listdir(os.path.join(ROOT, "tests", "gpu"))
            if f.startswith("test_") and f.endswith(".py")}  # fmt: skip
    assert files == want, sorted(want - files)

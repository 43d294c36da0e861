"""A pytest plugin for collecting tests/gpu on a machine without a GPU
(tests/unit/test_gpu_tests_collect.py): it reports CUDA as available (and GPUs enough), so
the GPU modules' "needs a CUDA GPU" skips pass and their imports and parametrizations run.
Collection only: nothing may run under it."""

from __future__ import annotations

import pytest
import torch

# flashinfer probes the device when it is imported: imported before the patch, it sees none
try:
    import flashinfer  # noqa: F401
except ImportError:  # (its GPU module then skips itself)
    pass
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 8  # (the tensor-parallel module wants two)


def pytest_collection_finish(session: pytest.Session) -> None:
    if not session.config.option.collectonly:
        raise pytest.UsageError("tests/gpu_collect.py is for --collect-only runs")

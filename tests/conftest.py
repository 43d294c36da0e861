from __future__ import annotations

import os

import pytest

# Deterministic, single-threaded-friendly defaults for 2-core CI machines.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Test models are tiny: one intra-op thread is as fast and does not spin against the services
# the tests start (on a loaded 2-core machine two OpenMP threads made small matmuls ~20x
# slower). Children inherit the variable.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Triton fixes interpreter mode when it is first imported (torch._dynamo imports it too), so
# without a GPU it must be set before anything else loads: kernels then run on CPU tensors.
try:
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:
    pass


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

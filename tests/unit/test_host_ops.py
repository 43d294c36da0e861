"""The host's torch ops per decode step (benchmarks/host_ops.py) stay few: a guard against
reintroducing per-step device work on the GPU path (schedule, allocate, load the graph's
inputs, plan, sample), counted on CPU through the flashinfer stand-in and the eager graph
double, in a child process (the count patches modules)."""

from __future__ import annotations

import os

import pytest

from benchmarks.host_ops import measure

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("page_size,most", [(1, 17), (16, 24)])
def test_decode_step_ops(page_size, most):
    got = measure(ROOT, 8, page_size)
    # 44 and 105 before the page-table kernel, packed graph inputs and alloc_decode
    assert got["ops"] <= most, got["by_op"]
    assert got["triton_launches"] == 1  # the page ids (the K/V store runs inside the model)
    for op in ("repeat_interleave", "cumsum", "item", "is_nonzero"):  # host reads, gathers
        assert op not in got["by_op"], got["by_op"]


@pytest.mark.parametrize("page_size,loop", [(1, "plain"), (16, "plain"), (16, "overlap")])
def test_serving_steps_read_nothing_from_the_device(page_size, loop):
    """Requests arriving, prefilled in chunks that end inside pages, finishing at different
    steps, with the prefix cache, with or without the overlap scheduler (its CUDA executor's
    host path): no step reads device memory on the host (on CUDA each read waits for the
    device) but for its sampled tokens. Before free_runs, the device tensor
    last slots and deferred checks, page size 16 made 315 reads over 62 steps."""
    got = measure(ROOT, 24, page_size, reads=loop)
    assert got["steps"] > 40
    assert got["reads"] == 0, got["by_site"]

"""The KV allocator on CUDA (engine/mem_cache/allocator.py): the same slots as on the CPU for
the same calls (extends continuing pages from last slots held on the device, decode steps,
page-aligned frees), its checks deferred by default there and raised by `verify`."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from engine.mem_cache.allocator import DoubleFreeError, TokenToKVPoolAllocator  # noqa: E402


@pytest.mark.parametrize("ps", [1, 16])
def test_cuda_allocator_hands_out_what_the_cpu_one_does(ps: int) -> None:
    rng = random.Random(ps)
    cpu, gpu = TokenToKVPoolAllocator(256 * ps, ps), TokenToKVPoolAllocator(256 * ps, ps, "cuda")
    assert gpu.defer_checks and not cpu.defer_checks
    lens = [0] * 6
    held: list[list[torch.Tensor]] = [[] for _ in lens]
    for _ in range(40):
        grow = [rng.choice([0, 1, rng.randint(1, 3 * ps)]) for _ in lens]
        seq = [n + g for n, g in zip(lens, grow)]
        last = [int(h[-1][-1]) if h and h[-1].numel() else -1 for h in held]
        want = cpu.alloc_extend(lens, seq, last)
        got = gpu.alloc_extend(lens, seq, torch.tensor(last, device="cuda"))
        assert want is not None and torch.equal(got.cpu(), want)
        offset = 0
        for i, g in enumerate(grow):
            if g:
                held[i].append(want[offset : offset + g])
            offset += g
        lens = seq
        done = rng.randrange(len(lens))
        if rng.random() < 0.3 and held[done]:
            run = torch.cat(held[done])
            cpu.free_runs([run])
            gpu.free_runs([run.cuda()])
            held[done], lens[done] = [], 0
        assert cpu.available_size() == gpu.available_size()
    gpu.verify()


def test_cuda_double_free_is_raised_by_verify() -> None:
    alloc = TokenToKVPoolAllocator(8 * 16, 16, "cuda")
    out = alloc.alloc_extend([0], [32], None)
    alloc.free_runs([out[:16]])
    alloc.free_runs([out[:16]])  # flagged on the device, no host read
    with pytest.raises(DoubleFreeError, match="deferred"):
        alloc.verify()

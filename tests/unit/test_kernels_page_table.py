"""The one-launch page-id kernel (kernels/page_table.py) against its per-request reference and
against the torch gather of engine/attention/page_table.py (in the Triton interpreter on CPU,
compiled on CUDA), and `build_page_table` taking either path with the same host tables.

The batches have shuffled rows and pages, empty requests (an extend without a cached prefix),
one-key pages and partial last pages, and more pages per request than one block of the
kernel's inner loop, so that a wrong start, stride, mask or loop bound shows as a wrong id.
"""

from __future__ import annotations

import random

import pytest
import torch

from kernels.testing import make_paged_case, triton_test_device

DEVICE, SKIP_REASON = triton_test_device()  # before anything below imports triton
pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")

from engine.attention import page_table  # noqa: E402
from kernels.page_table import page_ids, page_ids_ref  # noqa: E402


def _case(seed: int, page_size: int, batch: int):
    rng = random.Random(seed)
    prefix = [rng.choice([0, 0, page_size, 2 * page_size + 3, rng.randint(1, 90)])
              for _ in range(batch)]  # fmt: skip
    extend = [rng.randint(1, 40) for _ in range(batch)]
    case = make_paged_case(prefix, extend, 1, 1, 8, page_size, seed=seed)
    req_to_token = case.req_to_token.to(torch.int32).to(DEVICE)
    return case, req_to_token, case.req_pool_indices.to(DEVICE)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("page_size,block_pages", [(1, 4), (1, 128), (16, 2), (16, 128)])
def test_page_ids_match_reference(seed, page_size, block_pages):
    case, req_to_token, rows = _case(seed, page_size, batch=9)
    seq, extend = case.seq_lens.to(DEVICE), case.extend_lens.to(DEVICE)
    # a decode's whole context, and an extend's prefix given as context minus new tokens
    for sub in (None, extend):
        want = page_ids_ref(req_to_token, rows, seq, page_size, sub)
        out = torch.full((want.numel() + 5,), -7, dtype=torch.int32, device=DEVICE)
        page_ids(req_to_token, rows, seq, page_size, out, sub, block_pages=block_pages)
        assert out[: want.numel()].tolist() == want.tolist()
        assert out[want.numel() :].tolist() == [-7] * 5, "wrote past the total"


def test_page_ids_reference_is_the_per_token_table():
    """The reference itself, against slot-by-slot reading (one page per P keys)."""
    case, req_to_token, rows = _case(5, 4, batch=6)
    want = []
    for row, n in zip(rows.tolist(), case.seq_lens.tolist()):
        want += [int(req_to_token[row, j]) // 4 for j in range(0, n, 4)]
    assert page_ids_ref(req_to_token, rows, case.seq_lens.to(DEVICE), 4).tolist() == want


def test_page_ids_of_an_empty_batch_write_nothing():
    out = torch.full((3,), -1, dtype=torch.int32, device=DEVICE)
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    page_ids(torch.zeros(2, 8, dtype=torch.int32, device=DEVICE), empty, empty, 4, out)
    assert out.tolist() == [-1, -1, -1]


@pytest.mark.parametrize("page_size", [1, 16])
def test_build_page_table_kernel_and_torch_paths_agree(page_size):
    case, req_to_token, rows = _case(11, page_size, batch=7)
    seq_cpu, prefix_cpu = case.seq_lens.tolist(), case.prefix_lens.tolist()
    seq, extend = case.seq_lens.to(DEVICE), case.extend_lens.to(DEVICE)
    for lens_cpu, sub in ((seq_cpu, None), (prefix_cpu, extend)):
        tables = []
        for use_kernel in (True, False):
            host = torch.full((2 * len(lens_cpu) + 1 + 3,), -9, dtype=torch.int32)
            out = torch.zeros(2000, dtype=torch.int32, device=DEVICE) if use_kernel else None
            table = page_table.build_page_table(
                req_to_token, rows, lens_cpu, page_size, seq, sub, host=host, indices_out=out,
                use_kernel=use_kernel,
            )  # fmt: skip
            # the host tables are views of the caller's buffer, the rest of it untouched
            assert table.indptr.data_ptr() == host.data_ptr()
            assert host[-3:].tolist() == [-9] * 3
            if out is not None:
                assert table.indices.data_ptr() == out.data_ptr()
            tables.append([t.tolist() for t in (table.indptr, table.indices, table.last_page_len)])
        assert tables[0] == tables[1]
        ref = page_ids_ref(req_to_token, rows, seq, page_size, sub).tolist()
        assert tables[0][1] == ref


def test_qo_indptr_into_a_host_buffer():
    host = torch.full((6,), -1, dtype=torch.int32)
    indptr = page_table.build_qo_indptr([3, 1, 20], host)
    assert indptr.tolist() == [0, 3, 4, 24] and indptr.data_ptr() == host.data_ptr()
    assert host[4:].tolist() == [-1, -1]

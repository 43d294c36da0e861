"""Re-planning flashinfer's decode and paged prefill wrappers without its Python overhead.

A decode batch is planned before every forward and every graph replay, so the host time of
`BatchDecodeWithPagedKVCacheWrapper.plan` is host time per decode step, which the overlap
scheduler must hide behind the GPU's. With `use_tensor_cores=True` (the kernel the backend
picks for GQA groups of 4 or more: Llama 3, Qwen 2.5, Mistral...) that plan finds the longest
context with Python's builtin `max` over a CPU tensor, one 0-d tensor per request: with
flashinfer's C++ planner stubbed out, it cost 117 us at batch 64 and 380 us at batch 256 on this
repository's 2-core CPU machine; the CUDA-core wrapper's plan, 20 us at any batch
(`benchmarks/flashinfer_plan.py`). SGLang and vLLM re-plan their decode wrappers with fast plan
functions of their own for the same reason.

`DecodePlanner.plan` plans a wrapper through flashinfer's `plan` the first time, and again
whenever anything but the batch's page table changes. Otherwise it repeats, for the new table,
only what that `plan` would do:

* into a CUDA graph's buffers: copy indptr and the last page lengths (the page ids are written
  in place by the page-table kernel; flashinfer's copy of them onto themselves, a device copy,
  is skipped); outside graphs: move the tables to the device;
* call the planning module `plan` loaded (the same JIT module, which flashinfer caches per
  configuration) with the same arguments, the tensor-core planner taking the context lengths
  from the batch (numpy) instead of from the page table, and store its plan.

`PrefillPlanner` does the same for the paged prefill wrapper of extend batches (every batch
with a cached prefix, a later prefill chunk or decode rows mixed in), whose `plan` finds the
longest context with the same Python `max`: 384 us at batch 256 on this machine, though the
backend passes the longest query run (`max_token_per_sequence`); and for the prefill wrappers
of speculative verify graphs (engine/speculative/verify_graphs.py), re-planned before every
replay, into their buffers as for a decode graph.

That reproduces private details of flashinfer's wrapper, so it runs only on the flashinfer
versions it has been checked against (`VALIDATED_VERSIONS`):
`tests/unit/test_flashinfer_plan.py` plans real wrappers of the installed flashinfer (its C++
planners replaced by a recorder) both ways and requires the same planner calls and the same
wrapper state after every plan. Elsewhere, and for wrappers it does not cover (other
backends, custom JIT modules, the stand-in of the CPU tests), every plan is flashinfer's own.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from engine.host_tensors import int64_array

VALIDATED_VERSIONS = ("0.6.18", "0.6.18.post1")


def fast_replan_supported(fi: Any) -> bool:
    """The loaded flashinfer is a version whose decode plans `DecodePlanner` reproduces."""
    return getattr(fi, "__version__", None) in VALIDATED_VERSIONS


class _Replanner:
    """Which wrappers may be re-planned the fast way: those whose last full plan (flashinfer's
    own) had the same configuration, on a validated flashinfer."""

    def __init__(self, fi: Any, enabled: bool | None = None) -> None:
        self.enabled = fast_replan_supported(fi) if enabled is None else enabled
        # wrapper -> the configuration of its last full plan (None: never re-plan it fast)
        self._planned: dict[int, tuple | None] = {}
        self.fast_plans = 0  # (counted for the tests and the benchmark)

    def _fast(self, wrapper: Any, config: tuple) -> bool:
        return self.enabled and self._planned.get(id(wrapper)) == config

    def _planned_fully(self, wrapper: Any, config: tuple) -> None:
        self._planned[id(wrapper)] = config if _covered(wrapper) else None


class DecodePlanner(_Replanner):
    """Plans decode wrappers, re-planning them the fast way (module docstring)."""

    def __init__(self, fi: Any, enabled: bool | None = None) -> None:
        super().__init__(fi, enabled)
        self._qo_indptr = torch.arange(1, dtype=torch.int32)
        self._empties: dict[torch.dtype, torch.Tensor] = {}

    def plan(
        self,
        wrapper: Any,
        table: Any,
        kv_lens: list[int],
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        window_left: int = -1,
        **scalars: Any,
    ) -> None:
        """Plans `wrapper` over `table` (a PageTable whose request i has `kv_lens[i]` keys),
        with flashinfer's plan arguments."""
        config = (num_qo_heads, num_kv_heads, head_dim, page_size, window_left,
                  tuple(sorted(scalars.items())))  # fmt: skip
        if self._fast(wrapper, config):
            self._replan(wrapper, table, kv_lens, config, scalars)
            return
        wrapper.plan(
            table.indptr, table.indices, table.last_page_len, num_qo_heads, num_kv_heads,
            head_dim, page_size, window_left=window_left, **scalars,
        )  # fmt: skip
        self._planned_fully(wrapper, config)

    def _replan(
        self, wrapper: Any, table: Any, kv_lens: list[int], config: tuple, scalars: dict
    ) -> None:
        num_qo_heads, num_kv_heads, head_dim, page_size, window_left, _ = config
        indptr, indices, last = table.indptr, table.indices, table.last_page_len
        batch = len(last)
        qo_indptr = self._qo_range(batch)
        if wrapper.is_cuda_graph_enabled:
            if batch != wrapper._fixed_batch_size:
                raise ValueError(
                    f"a graph's decode wrapper plans {wrapper._fixed_batch_size} requests, "
                    f"not {batch}"
                )
            if len(indices) > len(wrapper._paged_kv_indices_buf):
                raise ValueError("the page ids do not fit in the graph's buffer")
            wrapper._paged_kv_indptr_buf.copy_(indptr, non_blocking=True)
            wrapper._paged_kv_last_page_len_buf.copy_(last, non_blocking=True)
            if indices.data_ptr() != wrapper._paged_kv_indices_buf.data_ptr():
                wrapper._paged_kv_indices_buf[: len(indices)].copy_(
                    indices, non_blocking=indices.device == wrapper.device
                )
        else:
            _tables_to_device(wrapper, qo_indptr, table)
        wrapper._batch_size = batch
        graph = wrapper.is_cuda_graph_enabled
        if wrapper.use_tensor_cores:
            known = table.kv_lens  # (converted already by the table's build, when it was)
            lens = (int64_array(kv_lens) if known is None else known).astype(np.int32)
            wrapper._max_kv_len = int(lens.max())
            _plan_fa2_prefill(
                wrapper, qo_indptr, indptr, torch.from_numpy(lens),
                batch,  # rows: one query per request
                num_qo_heads, num_kv_heads, page_size, head_dim, graph,
                False,  # not causal: one query sees the whole context
                window_left,
            )  # fmt: skip
        else:
            q_dtype = scalars["q_data_type"]
            kv_dtype = scalars.get("kv_data_type") or q_dtype
            wrapper._plan_info = wrapper._cached_module.plan(
                *_workspaces(wrapper), indptr, batch, num_qo_heads, num_kv_heads, page_size,
                graph, window_left, scalars.get("logits_soft_cap") or 0.0, head_dim, head_dim,
                self._empty(q_dtype), self._empty(kv_dtype),
            )  # fmt: skip
        self.fast_plans += 1

    def _empty(self, dtype: torch.dtype) -> torch.Tensor:
        """An empty host tensor of `dtype` (how the CUDA-core planner is told the dtypes)."""
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        if dtype not in self._empties:
            self._empties[dtype] = torch.empty(0, dtype=dtype)
        return self._empties[dtype]

    def _qo_range(self, batch: int) -> torch.Tensor:
        """[0, 1, ..., batch] int32 on the host (one query per request)."""
        if len(self._qo_indptr) < batch + 1:
            self._qo_indptr = torch.arange(max(batch + 1, 2 * len(self._qo_indptr)),
                                           dtype=torch.int32)  # fmt: skip
        return self._qo_indptr[: batch + 1]


class PrefillPlanner(_Replanner):
    """Plans the paged prefill wrappers of extend batches (eager), re-planning them the fast
    way (module docstring)."""

    def plan(
        self,
        wrapper: Any,
        qo_indptr: torch.Tensor,
        table: Any,
        qo_lens: list[int],
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        causal: bool,
        window_left: int = -1,
        **scalars: Any,
    ) -> None:
        """Plans `wrapper` for queries `qo_indptr` (host int32; request i has `qo_lens[i]`)
        over the pages of `table` (a PageTable on the host), with flashinfer's plan
        arguments."""
        longest = max(qo_lens)
        config = (num_qo_heads, num_kv_heads, head_dim, page_size, causal, window_left,
                  tuple(sorted(scalars.items())))  # fmt: skip
        if self._fast(wrapper, config):
            self._replan(wrapper, qo_indptr, table, longest, config)
            return
        wrapper.plan(
            qo_indptr, table.indptr, table.indices, table.last_page_len, num_qo_heads,
            num_kv_heads, head_dim, page_size, causal=causal, window_left=window_left,
            max_token_per_sequence=longest, **scalars,
        )  # fmt: skip
        self._planned_fully(wrapper, config)

    def _replan(
        self, wrapper: Any, qo_indptr: torch.Tensor, table: Any, longest: int, config: tuple
    ) -> None:
        num_qo_heads, num_kv_heads, head_dim, page_size, causal, window_left, _ = config
        indptr, last = table.indptr, table.last_page_len
        batch = len(last)
        # each request's keys, as flashinfer's `get_seq_lens` counts them from the table
        pages = np.diff(indptr.numpy())
        kv_lens = torch.from_numpy(
            (np.maximum(pages - 1, 0) * page_size + last.numpy()).astype(np.int32)
        )
        rows = int(qo_indptr[-1])
        graph = wrapper.is_cuda_graph_enabled
        if graph:  # (flashinfer's checks of a graph's wrapper, before it changes anything)
            if rows > wrapper._max_total_num_rows:
                raise ValueError(f"a graph's prefill wrapper plans at most "
                                 f"{wrapper._max_total_num_rows} queries, not {rows}")  # fmt: skip
            if batch != wrapper._fixed_batch_size:
                raise ValueError(f"a graph's prefill wrapper plans {wrapper._fixed_batch_size} "
                                 f"requests, not {batch}")  # fmt: skip
            if len(table.indices) > len(wrapper._paged_kv_indices_buf):
                raise ValueError("the page ids do not fit in the graph's buffer")
        wrapper._batch_size = batch
        wrapper._qo_indptr_last = rows
        wrapper._max_q_len = longest
        if batch > wrapper._kv_lens_buffer.shape[0]:
            wrapper._kv_lens_buffer = torch.empty(batch, dtype=torch.int32, device=wrapper.device)
        wrapper._kv_lens_buffer[:batch].copy_(kv_lens, non_blocking=True)
        wrapper._max_kv_len = int(kv_lens.max())
        if graph:  # into the buffers the graph reads (the page ids: unless already there)
            wrapper._qo_indptr_buf.copy_(qo_indptr, non_blocking=True)
            wrapper._paged_kv_indptr_buf.copy_(indptr, non_blocking=True)
            wrapper._paged_kv_last_page_len_buf.copy_(last, non_blocking=True)
            indices = table.indices
            if indices.data_ptr() != wrapper._paged_kv_indices_buf.data_ptr():
                wrapper._paged_kv_indices_buf[: len(indices)].copy_(
                    indices, non_blocking=indices.device == wrapper.device
                )
        else:
            _tables_to_device(wrapper, qo_indptr, table)
        _plan_fa2_prefill(wrapper, qo_indptr, indptr, kv_lens, wrapper._max_total_num_rows or rows,
                          num_qo_heads, num_kv_heads, page_size, head_dim, graph, causal,
                          window_left)  # fmt: skip
        self.fast_plans += 1


def _workspaces(wrapper: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A wrapper's float, int and pinned int workspaces: every planner's first arguments."""
    return (wrapper._float_workspace_buffer, wrapper._int_workspace_buffer,
            wrapper._pin_memory_int_workspace_buffer)  # fmt: skip


def _tables_to_device(wrapper: Any, qo_indptr: torch.Tensor, table: Any) -> None:
    """An eager wrapper's tables, moved to its device as flashinfer's `plan` moves them."""
    device = wrapper.device
    wrapper._qo_indptr_buf = qo_indptr.to(device, non_blocking=True)
    wrapper._paged_kv_indptr_buf = table.indptr.to(device, non_blocking=True)
    wrapper._paged_kv_indices_buf = table.indices.to(device, non_blocking=True)
    wrapper._paged_kv_last_page_len_buf = table.last_page_len.to(device, non_blocking=True)


def _plan_fa2_prefill(
    wrapper: Any,
    qo_indptr: torch.Tensor,
    indptr: torch.Tensor,
    kv_lens: torch.Tensor,
    rows: int,
    num_qo_heads: int,
    num_kv_heads: int,
    page_size: int,
    head_dim: int,
    graph: bool,
    causal: bool,
    window_left: int,
) -> None:
    """The FA2 prefill planner's call, as flashinfer's `plan` makes it (the paged prefill
    wrapper, and the decode wrapper on tensor cores), and its plan stored."""
    wrapper._plan_info = wrapper._cached_module.plan(
        *_workspaces(wrapper), qo_indptr, indptr, kv_lens, rows, len(kv_lens), num_qo_heads,
        num_kv_heads, page_size, graph, head_dim, head_dim, causal, window_left,
        -1,  # no fixed split size
        False,  # split-KV allowed
        0,  # colocated CTAs
        0,  # no uniform query length
    )  # fmt: skip


def _covered(wrapper: Any) -> bool:
    """A wrapper whose plan the planners' `_replan` reproduces: flashinfer's FA2 kernels
    (decode: tensor cores or CUDA cores, one query per request), no custom module or mask;
    and planned (its module is loaded)."""
    try:
        return (
            wrapper._backend == "fa2"
            and wrapper._jit_module is None
            and wrapper._cached_module is not None
            and getattr(wrapper, "_q_len_per_req", 1) == 1
            and getattr(wrapper, "_custom_mask_buf", None) is None
            and getattr(wrapper, "_prefix_len_ptr", None) is None
            and getattr(wrapper, "_seq_lens_kv", None) is None
            and wrapper._kv_layout == "NHD"
        )
    except AttributeError:  # not flashinfer's wrapper (the CPU tests' stand-in)
        return False

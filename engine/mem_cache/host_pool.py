"""Host memory for the hierarchical prefix cache (SGLang's HiCache host tier).

Two halves, as for device memory (the allocator with the scheduler, the buffers with the
model runner):

* `TransferQueue`, on the scheduler's side: the copies the cache decides on (a node backed up
  to host memory, a node loaded back), in order. `take()` hands them to the next forward
  batch (`ModelWorkerBatch.kv_transfers`).
* `HostKVPool`, beside the device's KV pool: the K/V of host slots, one buffer
  [layers, 2 (K, V), slots, kv_heads, head_dim]; `apply` runs a batch's copies before its
  forward.

Why order is enough: every copy runs on the device's queue (the forward thread, the device
process, the CUDA stream), before the forward of the batch it came with and after every
batch launched before. The K/V a store reads was written by a batch launched earlier (the
tree only holds computed K/V); the device slots a load fills, and host slots a store fills,
are free until the copy is queued, and anything that reuses them later is queued after it.
Consecutive copies of one kind are merged into one (their destinations disjoint, so the
merged copy does what they did one by one).

On CUDA the host buffer is pinned. A load gathers on the host and copies to the device
asynchronously on the forward stream; a store gathers on the device and copies to a pinned
staging buffer asynchronously, and is scattered into the host buffer once its event has
completed: at an `apply` that finds it done, or before a load that reads a slot it writes
(which then waits for it).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

STORE = "store"  # device slots -> host slots (a backup)
LOAD = "load"  # host slots -> device slots (a load back)

Transfer = tuple[str, torch.Tensor, torch.Tensor]  # (kind, source slots, destination slots)

HICACHE_WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


@dataclass
class _Pending:
    kind: str
    src: list[torch.Tensor] = field(default_factory=list)
    dst: list[torch.Tensor] = field(default_factory=list)
    dst_set: set[int] = field(default_factory=set)


class TransferQueue:
    """The copies decided since the last `take`, in order."""

    def __init__(self) -> None:
        self._ops: list[_Pending] = []
        self.stored_tokens = 0  # totals, for the stats
        self.loaded_tokens = 0

    def add(self, kind: str, src: torch.Tensor, dst: torch.Tensor) -> None:
        assert kind in (STORE, LOAD) and src.numel() == dst.numel()
        if kind == STORE:
            self.stored_tokens += dst.numel()
        else:
            self.loaded_tokens += dst.numel()
        targets = dst.tolist()
        last = self._ops[-1] if self._ops else None
        if last is None or last.kind != kind or not last.dst_set.isdisjoint(targets):
            last = _Pending(kind)
            self._ops.append(last)
        last.src.append(src)
        last.dst.append(dst)
        last.dst_set.update(targets)

    def take(self) -> list[Transfer] | None:
        if not self._ops:
            return None
        ops = [(p.kind, torch.cat(p.src), torch.cat(p.dst)) for p in self._ops]
        self._ops = []
        return ops

    def clear(self) -> None:
        """Drop what is queued (the cache was emptied: nothing reads those slots)."""
        self._ops = []

    def __len__(self) -> int:
        return len(self._ops)


def host_pool_tokens(
    device_tokens: int, bytes_per_token: int, ratio: float, size_gb: float, page_size: int
) -> int:
    """Host slots: `size_gb` (10^9 bytes) of K/V when given, else `ratio` x the device
    pool's tokens; whole pages, and more than the device pool (everything on the device is
    backed up there under write-through)."""
    if size_gb > 0:
        tokens = int(size_gb * 1e9 // bytes_per_token)
        what = f"hicache_size {size_gb} GB"
    else:
        tokens = int(device_tokens * ratio)
        what = f"hicache_ratio {ratio}"
    tokens -= tokens % page_size
    if tokens <= device_tokens:
        raise ValueError(
            f"hierarchical cache: the host pool ({what}: {tokens} tokens) must be larger than "
            f"the device KV pool ({device_tokens} tokens)"
        )
    return tokens


def available_host_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _raw(t: torch.Tensor) -> torch.Tensor:
    """Byte-sized floats as uint8 (indexing float8 is not implemented everywhere)."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


class HostKVPool:
    """K/V of `num_slots` host slots for `kv_pool`'s layers (slot 0's page is padding, as on
    the device). `beside`: holders of other per-slot device state that goes with the K/V
    (their `buffer` [slots, ...], read at each copy: an EAGLE model's kept hidden states,
    engine/speculative/eagle.py), kept on the host with it."""

    def __init__(
        self, kv_pool, num_slots: int, device: torch.device, beside: tuple = ()
    ) -> None:
        if kv_pool.swa_layers:
            raise ValueError("hierarchical cache: not with hybrid sliding-window memory")
        self.kv_pool = kv_pool
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        shape = (kv_pool.num_layers, 2, num_slots, kv_pool.num_kv_heads, kv_pool.head_dim)
        nbytes = num_slots * kv_pool.bytes_per_token(
            kv_pool.num_layers, kv_pool.num_kv_heads, kv_pool.head_dim, kv_pool.dtype
        )
        self.beside = beside
        beside_rows = [h.buffer[0] for h in beside]
        nbytes += num_slots * sum(r.numel() * r.element_size() for r in beside_rows)
        free = available_host_bytes()
        if free is not None and nbytes > free and not os.environ.get("SLUICE_HICACHE_NO_CHECK"):
            raise ValueError(
                f"hierarchical cache: the host pool needs {nbytes / 1e9:.2f} GB, and the "
                f"machine has {free / 1e9:.2f} GB available; lower --hicache-ratio or "
                "--hicache-size"
            )
        # (torch.empty: pages are only touched when written, so an idle pool costs little)
        self.buffer = torch.empty(shape, dtype=kv_pool.dtype, device="cpu", pin_memory=self.cuda)
        self.num_slots = num_slots
        self._raw = _raw(self.buffer)
        self.beside_host = [torch.empty((num_slots, *r.shape), dtype=r.dtype, device="cpu",
                                        pin_memory=self.cuda) for r in beside_rows]  # fmt: skip
        # CUDA: stores copied to the host but not yet scattered into the buffers (the K/V's
        # staging, then each `beside` buffer's)
        self._pending: list[tuple[torch.cuda.Event, torch.Tensor, list[torch.Tensor]]] = []
        logger.info(
            "hierarchical cache: host KV pool of %d tokens (%.2f GB)", num_slots, nbytes / 1e9
        )

    def _layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        pool = self.kv_pool
        return [(_raw(pool.k_buffer[i]), _raw(pool.v_buffer[i])) for i in range(pool.num_layers)]

    @torch.inference_mode()
    def apply(self, ops: list[Transfer]) -> None:
        """Run the copies in order (on the current stream on CUDA: the forward's)."""
        self._finish_stores(done_only=True)
        for kind, src, dst in ops:
            if kind == STORE:
                self._store(self._on_device(src), dst.to("cpu", torch.int64))
            else:
                self._load(src.to("cpu", torch.int64), self._on_device(dst))

    def _on_device(self, slots: torch.Tensor) -> torch.Tensor:
        """Slot indices on the device. On CUDA through pinned memory, asynchronously: a
        pageable copy would wait for the stream, i.e. for the forward in flight."""
        slots = slots.to(torch.int64)
        if not self.cuda or slots.device.type == "cuda":
            return slots.to(self.device)
        return slots.pin_memory().to(self.device, non_blocking=True)

    def _store(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        layers = self._layers()
        if not self.cuda:
            for i, (k, v) in enumerate(layers):
                self._raw[i, 0].index_copy_(0, dst, k.index_select(0, src))
                self._raw[i, 1].index_copy_(0, dst, v.index_select(0, src))
            for holder, host in zip(self.beside, self.beside_host, strict=True):
                host.index_copy_(0, dst, holder.buffer.index_select(0, src).cpu())
            return
        gathered = [torch.stack(
            [torch.stack([k.index_select(0, src), v.index_select(0, src)]) for k, v in layers]
        )] + [holder.buffer.index_select(0, src) for holder in self.beside]  # fmt: skip
        stagings = []
        for g in gathered:
            staging = torch.empty(g.shape, dtype=g.dtype, pin_memory=True)
            staging.copy_(g, non_blocking=True)
            stagings.append(staging)
        done = torch.cuda.Event()
        done.record()
        self._pending.append((done, dst, stagings))

    def _load(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        if self._pending:
            self._finish_stores(src)
        if not self.cuda:
            for i, (k, v) in enumerate(self._layers()):
                k.index_copy_(0, dst, self._raw[i, 0].index_select(0, src))
                v.index_copy_(0, dst, self._raw[i, 1].index_select(0, src))
            for holder, host in zip(self.beside, self.beside_host, strict=True):
                holder.buffer.index_copy_(0, dst, host.index_select(0, src).to(self.device))
            return
        gathered = self._raw.index_select(2, src).pin_memory()
        on_device = gathered.to(self.device, non_blocking=True)
        for i, (k, v) in enumerate(self._layers()):
            k.index_copy_(0, dst, on_device[i, 0])
            v.index_copy_(0, dst, on_device[i, 1])
        for holder, host in zip(self.beside, self.beside_host, strict=True):
            rows = host.index_select(0, src).pin_memory().to(self.device, non_blocking=True)
            holder.buffer.index_copy_(0, dst, rows)

    def _finish_stores(self, reading: torch.Tensor | None = None, done_only: bool = False):
        """Scatter stores into the host buffer, in order (a later store may write a slot an
        earlier one wrote): those whose copies are done (`done_only`; waits for none), or
        those up to the last that writes one of the slots a load is `reading` (waiting for
        their copies)."""
        n = len(self._pending)
        if done_only:
            n = 0
            while n < len(self._pending) and self._pending[n][0].query():
                n += 1
        elif reading is not None:
            hits = [i for i, (_, dst, _) in enumerate(self._pending)
                    if bool(torch.isin(dst, reading).any())]  # fmt: skip
            n = hits[-1] + 1 if hits else 0
        for done, dst, stagings in self._pending[:n]:
            done.synchronize()
            self._raw.index_copy_(2, dst, stagings[0])
            for host, staging in zip(self.beside_host, stagings[1:], strict=True):
                host.index_copy_(0, dst, staging)
        del self._pending[:n]

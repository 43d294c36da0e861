"""Process groups without a default group, and the tensor-parallel group of a model's ranks.

`rendezvous` + `group_on` build a torch process group the way RL trainers build theirs (a TCP
store served by rank 0, torch's own group construction over a prefix of it), so several groups
can live in one process without `init_process_group`: the trainers' weight-sync groups
(engine/weight_groups.py) and the tensor-parallel group of an engine's ranks.

`TensorParallel` is one rank's view of its tensor-parallel group (SGLang's and vLLM's
`get_tensor_model_parallel_rank()` and friends, held by the layers that need it rather than in
process-wide state, so a test process can hold engines of several sizes). `device_group`
carries the forwards' collectives (NCCL on CUDA, gloo on CPU); `cpu_group` (gloo) carries the
objects rank 0 sends its followers (the same group on CPU). Model code picks it up while the
model is built, inside `building_with(tp)` (`current_tp()`).
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

COLLECTIVE_TIMEOUT_S = 1800.0  # torch's default: a collective waits this long for the others


def free_port() -> int:
    """A TCP port free on the loopback interface now (a group's rank 0 serves its store there)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rendezvous(
    master_address: str, master_port: int, rank: int, world_size: int, timeout_s: float
) -> Any:
    """The TCP store of a group at `master_address:master_port` (rank 0 serves it; blocks until
    every rank has come, RuntimeError after `timeout_s`)."""
    from torch.distributed import distributed_c10d as c10d

    wait = datetime.timedelta(seconds=timeout_s)
    store, _, _ = next(
        c10d.rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=wait)
    )
    store.set_timeout(wait)
    return store


def group_on(
    store: Any,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float = COLLECTIVE_TIMEOUT_S,
) -> torch.distributed.ProcessGroup:
    """A process group `group_name` over `store` (under that prefix), its ranks its own."""
    from torch.distributed import distributed_c10d as c10d

    group, _ = c10d._new_process_group_helper(
        world_size, rank, [], backend, c10d.PrefixStore(group_name, store),
        group_name=group_name, timeout=datetime.timedelta(seconds=timeout_s),
    )  # fmt: skip
    # ranks of the group are its own (no default group maps them): src=0 is the group's rank 0
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


@dataclass(eq=False)
class TensorParallel:
    """One rank of a tensor-parallel group of `size` ranks (size 1: no group at all)."""

    rank: int = 0
    size: int = 1
    device_group: Any = None
    cpu_group: Any = None
    ep_size: int = 1  # expert parallelism: the experts split into this many groups of ranks

    def experts(self, total: int) -> tuple[int, int]:
        """(first, count) of the experts this rank's expert group holds: with `ep_size` E the
        ranks form E groups of size / E consecutive ranks, group g holding experts
        [g * total / E, (g + 1) * total / E) (ValueError if E does not divide `total`)."""
        if total % self.ep_size:
            raise ValueError(f"expert parallelism: {total} experts do not split into "
                             f"{self.ep_size} equal groups (--ep-size)")  # fmt: skip
        count = total // self.ep_size
        return (self.rank // (self.size // self.ep_size)) * count, count

    def expert_part(self, total: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's part of each of its experts' `total` `what`: the
        size / ep_size ranks of an expert group split every expert of it as tensor
        parallelism splits a dense MLP."""
        parts = self.size // self.ep_size
        if total % parts:
            raise ValueError(f"tensor parallelism: {total} {what} do not split into {parts} "
                             "equal parts")  # fmt: skip
        return (self.rank % parts) * (total // parts), total // parts

    def shard(self, total: int, what: str = "rows") -> tuple[int, int]:
        """(start, length) of this rank's equal part of `total` `what` (which `size` divides;
        ValueError otherwise)."""
        if total % self.size:
            raise ValueError(
                f"tensor parallelism: {total} {what} do not split into {self.size} equal parts"
            )
        part = total // self.size
        return self.rank * part, part

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks, in place (`x` itself with one rank)."""
        if self.size > 1:
            torch.distributed.all_reduce(x, group=self.device_group)
        return x

    def all_gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """[N, C] on each rank -> [N, size * C]: rank r's columns at r * C."""
        if self.size == 1:
            return x
        rows, cols = x.shape
        out = torch.empty(self.size * rows, cols, dtype=x.dtype, device=x.device)
        _all_gather(out, x.contiguous(), group=self.device_group)
        return out.view(self.size, rows, cols).permute(1, 0, 2).reshape(rows, self.size * cols)

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (the KV pool's tokens: each rank's free memory
        gives its own)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def destroy(self) -> None:
        for group in {id(g): g for g in (self.device_group, self.cpu_group) if g}.values():
            with contextlib.suppress(Exception):
                torch.distributed.destroy_process_group(group)
        self.device_group = self.cpu_group = None


# (torch 2.13 renamed all_gather_into_tensor, which it still has but warns about on every call)
_all_gather = getattr(torch.distributed, "all_gather_single", None) or getattr(
    torch.distributed, "all_gather_into_tensor", None
)
SINGLE = TensorParallel()  # (shared: never given a group)
_building: contextvars.ContextVar[TensorParallel] = contextvars.ContextVar("tp", default=SINGLE)


def current_tp() -> TensorParallel:
    """The group of the model being built (`building_with`); one rank outside it."""
    return _building.get()


@contextlib.contextmanager
def building_with(tp: TensorParallel) -> Iterator[None]:
    token = _building.set(tp)
    try:
        yield
    finally:
        _building.reset(token)

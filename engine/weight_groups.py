"""Process groups through which an RL trainer broadcasts new weights to the served model
(SGLang's `init_weights_update_group`, `update_weights_from_distributed` and
`destroy_weights_update_group`; OpenRLHF's and verl's vLLM worker extensions do the same).

The trainer is rank 0 of a group of `world_size`; the engine joins as `rank` (the caller's
`rank_offset`, plus the worker's index when a router fans the call out). The group is built
the way the trainers build theirs (`init_custom_process_group` in SGLang, verl, slime, AReaL):
a TCP store at `master_address:master_port`, served by rank 0, under a prefix of the group's
name, and torch's own process-group construction over it, so the two sides meet without a
default process group on either. The trainer then calls `torch.distributed.broadcast(t,
src=0, group=...)` for each tensor of a bucket, in the order of the `names` it sends in
the update request; the engine receives them in that order into fresh tensors of the
declared dtypes and shapes, and loads them as `update_weights_from_tensor` does
(engine/weight_update.py: checked on a meta copy first; nothing changed if they do not fit).
With SGLang's load_format "flattened_bucket" the trainer broadcasts a bucket as one uint8
tensor, each tensor's bytes after the previous one's (`FlattenedTensorBucket`): one
collective per bucket instead of one per tensor.

A bucket is always received in full, even when it is then refused (a name the model lacks, a
shape that does not fit, requests still running): the trainer's broadcast would otherwise
wait until its own timeout. "nccl" needs the model on a CUDA device; "gloo" works on any.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch

from engine.distributed import COLLECTIVE_TIMEOUT_S, group_on, rendezvous

logger = logging.getLogger(__name__)

BACKENDS = ("nccl", "gloo")
# dtype names a trainer sends (`str(t.dtype)` without "torch."); shared/messages/worker.py
# keeps the same tuple for the router's checks (the engine does not import it)
WEIGHT_DTYPES = (
    "float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2", "int8",
    "uint8", "int16", "int32", "int64", "bool",
)  # fmt: skip
JOIN_TIMEOUT_S = 300.0  # the trainer's side of the rendezvous must come within this


def weight_dtype(name: str) -> torch.dtype:
    """The torch dtype named `name` ("bfloat16" or "torch.bfloat16"); ValueError if unknown."""
    bare = name.removeprefix("torch.")
    if bare not in WEIGHT_DTYPES:
        raise ValueError(f"dtype {name!r} is not a weight dtype (use one of "
                         f"{', '.join(WEIGHT_DTYPES)})")  # fmt: skip
    return getattr(torch, bare)


def join_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float = JOIN_TIMEOUT_S,
) -> torch.distributed.ProcessGroup:
    """This process as `rank` of the trainer's group `group_name` (blocks until every rank
    has joined; RuntimeError after `timeout_s`); broadcast's src=0 is the trainer's."""
    store = rendezvous(master_address, master_port, rank, world_size, timeout_s)
    return group_on(store, rank, world_size, group_name, backend, COLLECTIVE_TIMEOUT_S)


def unflatten(
    flat: torch.Tensor,
    names: Sequence[str],
    kinds: Sequence[torch.dtype],
    shapes: Sequence[Sequence[int]],
) -> list[tuple[str, torch.Tensor]]:
    """The tensors whose bytes `flat` (uint8) holds end to end, in order (views where the
    offset suits the dtype, copies where it does not)."""
    named, offset = [], 0
    for name, kind, shape in zip(names, kinds, shapes):
        size = math.prod(shape) * kind.itemsize
        piece = flat[offset:offset + size]
        if offset % kind.itemsize:
            piece = piece.clone()
        named.append((str(name), piece.view(kind).view(tuple(shape))))
        offset += size
    if offset != flat.numel():
        raise ValueError(f"the flattened bucket has {flat.numel()} bytes; the tensors named "
                         f"take {offset}")  # fmt: skip
    return named


class WeightGroups:
    """The trainers' groups this process has joined, by name."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.groups: dict[str, torch.distributed.ProcessGroup] = {}

    def init(
        self,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        group_name: str,
        backend: str,
        timeout_s: float = JOIN_TIMEOUT_S,
    ) -> None:
        """Join the trainer's group (ValueError for a name in use, a bad rank or backend;
        RuntimeError if the rendezvous fails)."""
        if not torch.distributed.is_available():
            raise ValueError("this torch build has no torch.distributed")
        if group_name in self.groups:
            raise ValueError(f"a weights update group named {group_name!r} exists: destroy it "
                             "first")  # fmt: skip
        if backend not in BACKENDS:
            raise ValueError(f"backend {backend!r}: use one of {', '.join(BACKENDS)}")
        if backend == "nccl" and self.device.type != "cuda":
            raise ValueError(f"backend nccl needs the model on a CUDA device (it is on "
                             f"{self.device.type}): use backend gloo")  # fmt: skip
        if not 0 < rank < world_size:
            raise ValueError(f"rank {rank} of a group of {world_size}: rank 0 is the trainer's, "
                             "the engine's must be between 1 and world_size - 1")  # fmt: skip
        try:
            group = join_group(master_address, master_port, rank, world_size, group_name,
                               backend, timeout_s)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - torch raises many kinds; answered with it
            raise RuntimeError(f"joining group {group_name!r} at {master_address}:"
                               f"{master_port} as rank {rank} of {world_size} failed: "
                               f"{exc}") from exc  # fmt: skip
        self.groups[group_name] = group
        logger.info("joined weights update group %r (%s) as rank %d of %d", group_name,
                    backend, rank, world_size)  # fmt: skip

    def destroy(self, group_name: str) -> None:
        group = self.groups.pop(self._known(group_name))
        torch.distributed.destroy_process_group(group)
        logger.info("left weights update group %r", group_name)

    def receive(
        self,
        group_name: str,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        flattened: bool = False,
    ) -> list[tuple[str, torch.Tensor]]:
        """The tensors the trainer broadcasts, in the order of `names` (all of them are
        received before anything else is checked): one broadcast each, or, `flattened`
        (SGLang's load_format "flattened_bucket"), one uint8 tensor of their bytes end to
        end. ValueError for an unknown group or mismatched lists, before any is received."""
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(f"{len(names)} names, {len(dtypes)} dtypes and {len(shapes)} "
                             "shapes: one of each per tensor")  # fmt: skip
        kinds = [weight_dtype(d) for d in dtypes]
        group = self.groups[self._known(group_name)]
        if flattened:
            nbytes = sum(math.prod(s) * k.itemsize for k, s in zip(kinds, shapes))
            flat = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            torch.distributed.broadcast(flat, src=0, group=group)
            return unflatten(flat, names, kinds, shapes)
        named = [(str(n), torch.empty(tuple(s), dtype=k, device=self.device))
                 for n, k, s in zip(names, kinds, shapes)]  # fmt: skip
        works = [torch.distributed.broadcast(t, src=0, group=group, async_op=True)
                 for _, t in named]  # fmt: skip
        for work in works:
            work.wait()
        return named

    def close(self) -> None:
        for name in list(self.groups):
            try:
                self.destroy(name)
            except Exception:  # noqa: BLE001 - closing: the others still go
                logger.exception("leaving weights update group %r", name)

    def _known(self, group_name: str) -> str:
        if group_name not in self.groups:
            known = ", ".join(sorted(self.groups)) or "none"
            raise ValueError(f"no weights update group named {group_name!r} (joined: {known}); "
                             "call init_weights_update_group first")  # fmt: skip
        return group_name

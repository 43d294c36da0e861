"""`FutureMap`: next-token ids that are still being computed, in a device-resident ring.

With overlap scheduling, batch N+1 is launched before batch N's sampled tokens reach the
host. Every row of a launched batch gets a slot `i >= 1` of the ring; wherever that token is
needed as an input (the request's next decode step) the scheduler writes the placeholder
`-i`. The sampling of batch N writes its tokens into its slots (`store_to_map`) and the
forward of a later batch replaces the placeholders in its `input_ids` on the device
(`resolve_future`), so the token never has to travel through the host first. Slot 0 is never
handed out: placeholders are strictly negative and real token ids are >= 0.

Ring size. A placeholder of batch N is only ever read by the forward of the batch launched
right after N: the scheduler processes N's results before it launches anything later and
from then on feeds the host copy of the token. Device work runs in launch order (one forward
stream, or one forward thread), and the next store after N's is the sampling of N+1, which
comes after that forward. So correctness only needs N's slots to outlive N+1's forward.
We nevertheless keep `limit = 3 * max_bs` slots in rotation, as SGLang does: any three
consecutive batches then hold pairwise disjoint slots, which leaves a whole batch of margin
should results ever be processed two batches late. `max_bs` is the number of request rows:
every row of a batch holds its own row of the request pool, so no batch is larger. A batch
takes contiguous slots `[cursor + 1, cursor + bs]` with `cursor < limit`, hence the buffer
of `limit + max_bs + 1` slots.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

LIMIT_BATCHES = 3  # batches' worth of slots in rotation (see the module docstring)


@dataclass(frozen=True)
class FutureSlots:
    """The slots `start .. start + size - 1` of one launched batch, row i at `start + i`."""

    start: int
    size: int

    def placeholders(self) -> list[int]:
        """The negative ids standing for each row's token until it is resolved."""
        return list(range(-self.start, -self.start - self.size, -1))


class FutureMap:
    def __init__(self, max_bs: int, device: torch.device | str = "cpu") -> None:
        if max_bs < 1:
            raise ValueError(f"FutureMap: max_bs must be >= 1, got {max_bs}")
        self.max_bs = max_bs
        self.limit = LIMIT_BATCHES * max_bs
        self.device = torch.device(device)
        self.token_ids = torch.zeros(self.limit + max_bs + 1, dtype=torch.int64, device=device)
        self._cursor = 0  # slots up to here were handed out last; the next batch starts after
        self.num_wraps = 0
        self._resolve = _device_resolver(self.device)

    def alloc_future_indices(self, bs: int) -> FutureSlots:
        """Contiguous slots for a batch of `bs` rows (host bookkeeping only, no device work)."""
        if not 0 < bs <= self.max_bs:
            raise ValueError(f"alloc_future_indices: batch of {bs}, at most {self.max_bs}")
        slots = FutureSlots(self._cursor + 1, bs)
        self._cursor += bs
        if self._cursor >= self.limit:
            self._cursor -= self.limit
            self.num_wraps += 1
        return slots

    def store_to_map(self, slots: FutureSlots, next_token_ids: torch.Tensor) -> None:
        """Write a batch's sampled tokens into its slots (on the device, in stream order)."""
        self.token_ids[slots.start : slots.start + slots.size] = next_token_ids

    def resolve_future(self, input_ids: torch.Tensor) -> torch.Tensor:
        """In place: every negative id `-i` of `input_ids` becomes `token_ids[i]`."""
        return self._resolve(input_ids, self.token_ids)


def _resolve_torch(input_ids: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """One gather and one select, no host sync (the placeholders' slots are all < len)."""
    resolved = token_ids.index_select(0, (-input_ids).clamp_(min=0))
    return input_ids.copy_(torch.where(input_ids < 0, resolved, input_ids))


def _device_resolver(device: torch.device) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The Triton kernel on CUDA when the kernels package provides it, else plain torch."""
    if device.type == "cuda":
        try:
            from kernels.future_tokens import resolve_future_tokens
        except ImportError:
            return _resolve_torch
        return resolve_future_tokens
    return _resolve_torch

"""Changing the model of a running scheduler: loading and unloading LoRA adapters (vLLM's
`/v1/load_lora_adapter` and `/v1/unload_lora_adapter`, SGLang's `/load_lora_adapter` and
`/unload_lora_adapter`), and replacing the weights with another checkpoint's (SGLang's
`update_weights_from_disk`, engine/weight_update.py), from tensors handed over in memory, or
from tensors an RL trainer broadcasts through a process group the runner joined (SGLang's
`init_weights_update_group` / `update_weights_from_distributed`; engine/weight_groups.py).

Called between steps, on the scheduler's thread. The work on the model goes to the model
runner through `_on_device`: directly without overlap, and in launch order through the overlap
executor otherwise (its forward thread, or its device process), so it never runs beside a
forward. The names and ids are `LoRARegistry`'s (engine/lora/registry.py): an
unloaded adapter's requests finish on it, and its weights are dropped once none is left
(`release_loras`, after every step).
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

from engine.lora.registry import LoRARegistry
from engine.scheduler.req import Req
from engine.weight_groups import JOIN_TIMEOUT_S

logger = logging.getLogger(__name__)


class ModelUpdates:
    loras: LoRARegistry
    waiting_queue: list[Req]
    running_batch: Any
    grammar_queue: Any
    model_runner: Any
    tree_cache: Any
    weights_path: str  # the checkpoint the model's weights are from now
    _in_flight_reqs: Any
    holds_kv: Any
    released_memory: frozenset[str]
    weights_missing: int

    def load_lora_adapter(self, name: str, path: str, replace: bool = False) -> None:
        """Serve the PEFT adapter in `path` as `name` from the next step on; `replace`: a
        loaded adapter of that name is replaced (its running requests finish on the old
        weights). ValueError, with the reason, if it cannot be loaded; nothing changes then."""
        spec = self.loras.prepare(name, path, replace)
        self._on_device("add_lora_adapter", spec)
        self.loras.commit(spec)
        self.release_loras()
        logger.info("LoRA adapter %r loaded from %s (rank %d, id %d)", name, path, spec.rank,
                    spec.id)  # fmt: skip

    def unload_lora_adapter(self, name: str) -> None:
        """Stop serving `name` (ValueError if it is not loaded); requests admitted with it
        finish on it, and its weights go once they have."""
        self.loras.remove(name)
        self.release_loras()
        logger.info("LoRA adapter %r unloaded", name)

    def release_loras(self) -> None:
        """Drop the weights of unloaded adapters that no request uses any more."""
        if not self.loras.draining:
            return
        for adapter_id in self.loras.release(self._lora_ids_in_use()):
            self._on_device("remove_lora_adapter", adapter_id)

    def update_weights_from_disk(self, path: str) -> None:
        """The weights of the checkpoint in `path` (the same model's) from the next step on;
        the prefix cache is emptied (its K/V are the old weights'). Only with no request
        holding K/V (ValueError otherwise: the worker holds new requests back and lets the
        running ones finish first, or a paused one has sent them back to waiting); waiting
        requests run on the new weights. Released weights (engine/memory_occupation.py) are
        taken back for it. ValueError with the reason, nothing changed, if the checkpoint
        does not fit the model."""
        if self.holds_kv():
            raise ValueError("requests are running: update the weights when none holds K/V")
        self._on_device("update_weights_from_disk", path)
        self.tree_cache.reset()
        self.weights_path = path
        self.released_memory -= {"weights"}  # (taken back for the update, if released)
        self.weights_missing = 0

    def update_weights_from_tensor(
        self, named: list[tuple[str, Any]], flush_cache: bool = True
    ) -> None:
        """`named` (checkpoint names and shapes: any part of the model) into the weights from
        the next step on (SGLang's `update_weights_from_tensor`); the prefix cache emptied
        with `flush_cache` (its K/V are the old weights'). Only with no request holding K/V
        (ValueError otherwise); ValueError with the reason, nothing changed, if a tensor is
        not the model's or does not fit. Released weights are taken back for it."""
        if self.holds_kv():
            raise ValueError("requests are running: update the weights when none holds K/V")
        self.weights_missing = self._on_device("update_weights_from_tensor", named)
        if flush_cache:
            self.tree_cache.reset()
        self.released_memory -= {"weights"}

    def init_weights_update_group(
        self, master_address: str, master_port: int, rank: int, world_size: int,
        group_name: str = "weight_update_group", backend: str = "nccl",
        timeout_s: float = JOIN_TIMEOUT_S,
    ) -> None:  # fmt: skip
        """Join the trainer's process group `group_name` as `rank` (blocks until all ranks
        have joined). ValueError for a bad rank, backend or a name in use; RuntimeError if
        the rendezvous fails."""
        self._on_device("init_weights_update_group", master_address, master_port, rank,
                        world_size, group_name, backend, timeout_s)  # fmt: skip

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        self._on_device("destroy_weights_update_group", group_name)

    def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]],
        group_name: str = "weight_update_group", flush_cache: bool = True,
        flattened: bool = False,
    ) -> None:  # fmt: skip
        """The tensors the trainer broadcasts in `group_name` (checkpoint names, in the order
        of `names`; `flattened`: one uint8 buffer of their bytes) into the weights from the
        next step on, as `update_weights_from_tensor`.
        The bucket is received even when refused (requests holding K/V, tensors that do not
        fit: ValueError, nothing changed), so that the trainer's broadcast ends."""
        if self.holds_kv():
            self.discard_distributed(names, dtypes, shapes, group_name, flattened)
            raise ValueError("requests are running: update the weights when none holds K/V "
                             "(the tensors sent were received and dropped)")  # fmt: skip
        self.weights_missing = self._on_device(
            "update_weights_from_distributed", names, dtypes, shapes, group_name, flattened
        )
        if flush_cache:
            self.tree_cache.reset()
        self.released_memory -= {"weights"}

    def discard_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str,
        flattened: bool = False,
    ) -> None:  # fmt: skip
        """Receive a bucket the trainer broadcasts and drop it (an update refused: the
        trainer's broadcast must end). Nothing if the group is unknown or the lists do not
        match (ValueError swallowed: nothing can be received then)."""
        try:
            self._on_device("discard_distributed", names, dtypes, shapes, group_name, flattened)
        except ValueError as exc:
            logger.warning("tensors of group %r not received: %s", group_name, exc)

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[float]:
        """The first `truncate_size` served values of checkpoint tensor (or parameter)
        `name`, flattened (SGLang's call; engine/weight_read.py)."""
        return self._on_device("get_weights_by_name", name, truncate_size)

    def _lora_ids_in_use(self) -> set[int]:
        reqs = itertools.chain(
            self.waiting_queue,
            self.grammar_queue.reqs(),
            self.running_batch.reqs,
            self._in_flight_reqs(),  # (RequestIntake's: the last batch's, the chunked one)
        )
        return {r.lora_id for r in reqs if not r.finished}

    def _on_device(self, method: str, *args: Any) -> Any:
        """`model_runner.<method>(*args)` where the model is, between forwards."""
        return getattr(self.model_runner, method)(*args)

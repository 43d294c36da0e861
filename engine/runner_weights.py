"""The model runner's weights changed while serving (a mixin of `ModelRunner`,
engine/model_runner.py): another checkpoint's from disk (SGLang's `update_weights_from_disk`),
tensors handed over in memory (SGLang's `update_weights_from_tensor`: an RL trainer's new
weights, any part at a time; engine/weight_update.py) or broadcast through a trainer's process
group (SGLang's `update_weights_from_distributed`; engine/weight_groups.py), and the device
memory given back while idle and taken again (engine/memory_occupation.py).

Weights discarded at a release are read again before the next forward: from the checkpoint
served when they are its (`weights_on_disk`); after tensor updates they are on no disk, and
every tensor of the checkpoint must be sent again (`unsent` holds the names still to come;
`missing_weights`), as SGLang and vLLM expect of their callers: sluice refuses to run on
weights that were not (engine/engine.py) where they would run on garbage.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from typing import Any

import torch

from engine.distributed import TensorParallel
from engine.memory_occupation import MemoryOccupation, occupied_bytes
from engine.weight_groups import WeightGroups

logger = logging.getLogger(__name__)


class RunnerWeights:
    model: Any
    model_config: Any
    dtype: torch.dtype
    device: torch.device
    quantization: Any
    lora: Any
    kv_pool: Any
    graph_runner: Any
    verify_graph_runner: Any
    weights_path: str
    weights_on_disk: bool
    unsent: set[str] | None
    memory: MemoryOccupation
    weight_groups: WeightGroups
    tp: TensorParallel
    tp_link: Any
    _graphs_stale: bool
    # a runner whose weights are part of this model's checkpoint (an MTP head,
    # engine/models/mtp.py, on rank 0): its tensors follow the model's updates
    weights_companion: Any = None

    def _every_rank(self, method: str, *args: Any, every_result: bool = False) -> Any:
        """`self.method(*args)`, on every rank of a tensor-parallel group: rank 0's result, or
        with `every_result` every rank's, in rank order."""
        link = self.tp_link
        if link is None or self.tp.rank != 0:
            result = getattr(self, method)(*args)
            return [result] if every_result else result
        return link.on_every_rank(self, method, *args, every_result=every_result)

    # -- weights from another checkpoint, or from tensors --------------------------------------
    def update_weights_from_disk(self, path: str) -> None:
        """The checkpoint in `path` into the model, in place (between forwards; the caller
        flushes the prefix cache). ValueError, nothing changed, if it is not one of this
        model; a failure while copying reloads the previous checkpoint and raises. Weights
        released are taken back for it; a failed update leaves them released as they were.
        With tensor parallelism every rank reads its part."""
        self._every_rank("_update_weights_from_disk", path)

    def _update_weights_from_disk(self, path: str) -> None:
        companion = self.weights_companion
        if companion is not None:  # (checked first: nothing changed if it does not fit)
            from engine.weight_update import check_checkpoint

            check_checkpoint(companion.model_config, path, companion.dtype,
                             companion.quantization)  # fmt: skip
        self._with_weights_back(lambda: self._read_weights(path))
        if companion is not None:
            companion._read_weights(path)

    def _companion_reads(self, name: str) -> bool:
        """Whether checkpoint tensor `name` is one the weights companion reads."""
        companion = self.weights_companion
        if companion is None:
            return False
        from engine.loader import tensors_to_read

        reads = tensors_to_read(companion.model, companion.model_config)
        return reads is not None and name in reads

    def update_weights_from_tensor(self, named: list[tuple[str, torch.Tensor]]) -> int:
        """`named` (checkpoint names and shapes, any part of the model) into the weights, in
        place (between forwards; the caller flushes the prefix cache, or not); the number of
        checkpoint tensors still to be sent (`missing_weights`). ValueError, nothing changed,
        if a name is not the model's or a tensor does not fit. Weights released are taken
        back for it; discarded ones that are the checkpoint's on disk are read first (the
        tensors may be a part only). With tensor parallelism every rank gets the tensors (over
        gloo, from host memory) and takes its part."""
        if self.tp.size > 1:
            named = [(name, t.detach().cpu()) for name, t in named]
        return self._every_rank("_update_weights_from_tensor", named)

    def _update_weights_from_tensor(self, named: list[tuple[str, torch.Tensor]]) -> int:
        companion = self.weights_companion
        theirs = [(n, t) for n, t in named if self._companion_reads(n)]
        if theirs:  # (the companion's tensors: checked first, loaded after the model's)
            from engine.weight_update import check_tensors

            check_tensors(companion.model_config, theirs, companion.dtype,
                          companion.quantization)  # fmt: skip

        def load() -> None:
            if self.memory.stale_weights and self.unsent is None:
                self._read_weights(self.weights_path)
            self._load_tensors(named)

        self._with_weights_back(load)
        if theirs:
            companion._load_tensors(theirs)
        return self.missing_weights()

    # -- weights broadcast by a trainer (engine/weight_groups.py) -------------------------------
    # With tensor parallelism every rank is a rank of the trainer's group, rank r of this
    # engine as `rank + r` (SGLang's rank_offset + tp_rank): each receives every broadcast and
    # keeps its part, so nothing is sent twice between the ranks.
    def init_weights_update_group(
        self, master_address: str, master_port: int, rank: int, world_size: int,
        group_name: str, backend: str, timeout_s: float,
    ) -> None:  # fmt: skip
        if self.tp.size > 1 and rank + self.tp.size > world_size:
            raise ValueError(f"the engine's {self.tp.size} tensor-parallel ranks join as ranks "
                             f"{rank}..{rank + self.tp.size - 1}: world_size {world_size} is too "
                             "small")  # fmt: skip
        self._every_rank("_init_weights_update_group", master_address, master_port, rank,
                         world_size, group_name, backend, timeout_s)  # fmt: skip

    def _init_weights_update_group(
        self, master_address: str, master_port: int, rank: int, world_size: int,
        group_name: str, backend: str, timeout_s: float,
    ) -> None:  # fmt: skip
        self.weight_groups.init(master_address, master_port, rank + self.tp.rank, world_size,
                                group_name, backend, timeout_s)  # fmt: skip

    def destroy_weights_update_group(self, group_name: str) -> None:
        self._every_rank("_destroy_weights_update_group", group_name)

    def _destroy_weights_update_group(self, group_name: str) -> None:
        self.weight_groups.destroy(group_name)

    def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str,
        flattened: bool = False,
    ) -> int:  # fmt: skip
        """The tensors the trainer broadcasts in group `group_name` (one by one, or
        `flattened` into one buffer) into the weights (as `update_weights_from_tensor`); the
        checkpoint tensors still to be sent."""
        return self._every_rank("_update_weights_from_distributed", names, dtypes, shapes,
                                group_name, flattened)  # fmt: skip

    def _update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str,
        flattened: bool,
    ) -> int:  # fmt: skip
        named = self.weight_groups.receive(group_name, names, dtypes, shapes, flattened)
        return self._update_weights_from_tensor(named)

    def discard_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str,
        flattened: bool = False,
    ) -> None:  # fmt: skip
        """Receive a bucket the trainer broadcasts and drop it (an update refused: the
        trainer's broadcast ends either way)."""
        self._every_rank("_discard_distributed", names, dtypes, shapes, group_name, flattened)

    def _discard_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str,
        flattened: bool,
    ) -> None:  # fmt: skip
        self.weight_groups.receive(group_name, names, dtypes, shapes, flattened)

    def get_weights_by_name(self, name: str, truncate_size: int) -> list[float]:
        """The first `truncate_size` values of the served checkpoint tensor (or parameter)
        `name`, flattened (engine/weight_read.py). ValueError if there is none, if it cannot
        be read back, or while the weights are released."""
        if self._companion_reads(name):  # (an MTP layer's tensor: its head's)
            return self.weights_companion.get_weights_by_name(name, truncate_size)
        if self.tp.size == 1:
            return self._weight_part(name, truncate_size)[0].float().tolist()
        # (tensor parallelism: each rank's part, put together; a parameter's own name is rank
        # 0's part of it)
        parts = self._every_rank("_weight_part", name, truncate_size, every_result=True)
        values, filled = parts[0]
        for part, where in parts[1:]:
            values = torch.where(where & ~filled, part, values)
            filled = filled | where
        assert bool(filled.all()), f"{name!r}: the ranks' parts do not cover it"
        return values.float().tolist()

    def _weight_part(self, name: str, truncate_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's first `truncate_size` values of `name` and where it has them."""
        from engine.weight_read import read_weight_part

        assert self.model is not None, "a host-only runner has no weights"
        if self.memory.weights is not None or self.memory.stale_weights:
            raise ValueError("the weights are released (or were discarded and are not read "
                             "again yet): resume them and generate first")  # fmt: skip
        with self._unwrapped():
            value, filled = read_weight_part(
                self.model, self.model_config, self.weights_path, self.dtype, self.quantization,
                name, self.tp,
            )  # fmt: skip
        return value.flatten()[:truncate_size], filled.flatten()[:truncate_size]

    def missing_weights(self) -> int:
        """How many checkpoint tensors were discarded (weights not on disk) and not sent
        again."""
        return len(self.unsent or ())

    def read_stale_weights(self) -> None:
        """Weights discarded at a release, before a forward: from the checkpoint served."""
        if self.unsent:
            raise RuntimeError(f"{len(self.unsent)} weights were discarded and not sent "
                               f"again, e.g. {sorted(self.unsent)[:3]}")  # fmt: skip
        self.update_weights_from_disk(self.weights_path)

    def _with_weights_back(self, change: Any) -> None:
        """`change()` on the weights, taken back first if released (and released again, as
        they were, if it fails)."""
        released = self.memory.weights
        if released is None:
            change()
            return
        backup = released.backups is not None
        self.memory.resume_weights()
        try:
            change()
        except Exception:
            self.memory.release_weights(self.model, backup, self.device)
            raise

    def _read_weights(self, path: str) -> None:
        from engine.weight_update import reload_weights

        assert self.model is not None, "a host-only runner has no weights"
        with self._unwrapped():
            try:
                scales = reload_weights(
                    self.model, self.model_config, path, self.dtype, self.quantization
                )
            except ValueError:
                raise
            except Exception as exc:
                logger.exception("loading the weights of %s; reloading %s", path,
                                 self.weights_path)  # fmt: skip
                reload_weights(self.model, self.model_config, self.weights_path, self.dtype,
                               self.quantization)  # fmt: skip
                self._on_disk()
                why = (f"reading {path} failed ({exc}); the previous weights were reloaded "
                       f"(from {self.weights_path})")  # fmt: skip
                raise RuntimeError(why) from exc
        self.weights_path = path
        self._on_disk()
        self._set_kv_scales(scales, replace=True)
        logger.info("weights updated from %s", path)

    def _load_tensors(self, named: list[tuple[str, torch.Tensor]]) -> None:
        from engine.weight_update import load_tensors

        assert self.model is not None, "a host-only runner has no weights"
        with self._unwrapped():
            scales = load_tensors(self.model, self.model_config, named, self.dtype,
                                  self.quantization)  # fmt: skip
        self.weights_on_disk = False
        if self.unsent is not None:
            self.unsent.difference_update(name for name, _ in named)
            if not self.unsent:
                self.unsent = None
                self.memory.stale_weights = False
        self._set_kv_scales(scales, replace=False)
        logger.info("weights updated from %d tensor(s)", len(named))

    def _on_disk(self) -> None:
        self.weights_on_disk = True
        self.unsent = None
        self.memory.stale_weights = False

    def _unwrapped(self) -> Any:
        """The model with its own layers where LoRA wraps them (checkpoint names)."""
        return self.lora.unwrapped() if self.lora is not None else contextlib.nullcontext()

    def _set_kv_scales(self, scales: dict[int, tuple[float, float]], replace: bool) -> None:
        """An FP8 KV cache's scales from the weights loaded: all of them (`replace`: layers
        not given get 1.0), or the layers given."""
        pool = self.kv_pool
        if not getattr(pool, "quantized", False) or not (scales or replace):
            return
        before = (list(pool.k_scales), list(pool.v_scales))
        if not replace:
            kept = {i: (k, v) for i, (k, v) in enumerate(zip(pool.k_scales, pool.v_scales))}
            scales = kept | scales
        pool.set_scales(scales)
        self._graphs_stale = before != (list(pool.k_scales), list(pool.v_scales))

    # -- device memory given back while idle (engine/memory_occupation.py) ---------------------
    def release_memory_occupation(self, tags: tuple[str, ...], backup_weights: bool) -> int:
        """Give back the memory of `tags` (`check_tags`'; released ones are left as they
        are), the weights copied to host memory first with `backup_weights`; the bytes freed.
        Between forwards, with no K/V in use. ValueError, nothing released, if weights that
        cannot be read again would be discarded. Weights not on disk (tensor updates) may be
        discarded: every checkpoint tensor must then be sent again."""
        return self._every_rank("_release_memory_occupation", tags, backup_weights)

    def _release_memory_occupation(self, tags: tuple[str, ...], backup_weights: bool) -> int:
        assert self.model is not None and self.kv_pool is not None, "a host-only runner"
        memory = self.memory
        discard = "weights" in tags and memory.weights is None and not backup_weights
        if discard and self.quantization is not None and not self.quantization.checkpoint:
            raise ValueError("the weights were quantized to FP8 as they loaded and "
                             "cannot be read again: release them with a host backup "
                             "(vLLM's sleep level 1, SGLang's "
                             "--enable-weights-cpu-backup)")  # fmt: skip
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # (no forward in flight reads them)
        freed = 0
        if "kv_cache" in tags:
            freed += memory.release_kv(self._kv_buffers())
        if "weights" in tags:
            freed += memory.release_weights(self.model, backup_weights, self.device)
            if discard and not self.weights_on_disk:
                from engine.weight_update import checkpoint_names

                self.unsent = checkpoint_names(self.weights_path)
        if "cuda_graph" in tags or freed:  # (graphs hold the old addresses)
            self.graph_runner = self.verify_graph_runner = None
        if self.device.type == "cuda":  # (see `release_memory`)
            gc.collect()
            torch.cuda.empty_cache()
        logger.info("released %s: %.1f MB", ", ".join(tags), freed / 2**20)
        return freed

    def resume_memory_occupation(self, tags: tuple[str, ...]) -> int:
        """Take the memory of `tags` again (see engine/memory_occupation.py); the bytes (rank
        0's, with tensor parallelism; every rank takes its own back)."""
        return self._every_rank("_resume_memory_occupation", tags)

    def _resume_memory_occupation(self, tags: tuple[str, ...]) -> int:
        taken = 0
        if "weights" in tags:
            taken += self.memory.resume_weights()
        if "kv_cache" in tags:
            taken += self.memory.resume_kv()
        logger.info("resumed %s: %.1f MB", ", ".join(tags), taken / 2**20)
        return taken

    def memory_occupied(self) -> dict[str, int]:
        """The bytes the weights and the K/V buffers hold now."""
        assert self.model is not None and self.kv_pool is not None, "a host-only runner"
        return {
            "weights": occupied_bytes(self.model.parameters()),
            "kv_cache": occupied_bytes(self._kv_buffers()),
        }

    def _kv_buffers(self) -> list[torch.Tensor]:
        """The K/V pool's buffers, and the hidden states kept beside them by KV slot (EAGLE
        speculation: engine/speculative/eagle.py)."""
        capture = getattr(self, "hidden_capture", None)
        return self.kv_pool.buffers() + ([capture.buffer] if capture is not None else [])

"""`LoRAManager`: the adapters a worker serves, their device slots, and each batch's masks.

The adapters (`lora_paths` at start; `add` and `remove` while the engine runs, between
forwards) are kept in host memory; `max_loras_per_batch` slots on the device hold the ones
batches use (SGLang's LoRA memory pool). Before a forward, `prepare` puts the batch's adapters
into slots (replacing the least recently used adapters that the batch does not use; the
scheduler admits no batch with more adapters than slots) and builds the per-token mask that
every `LoRALinear` reads (engine/lora/layers.py). A CUDA graph records the layers over every
slot with its own static mask rows (`bind_graph_rows`), which a replay's `prepare` fills.

The adapted modules are the attention and MLP projections of the decoder layers (PEFT's
q/k/v/o_proj and gate/up/down_proj, into the model's fused projections); an adapter naming any
other module is refused.
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from collections.abc import Hashable, Iterator

import torch
from torch import nn

from engine.forward_batch import ForwardBatch
from engine.layers.fp8 import Fp8Linear
from engine.layers.int_weight import IntWeightLinear
from engine.lora.adapter import AdapterSpec, load_adapter_weights
from engine.lora.layers import LoRALinear
from engine.models.interleaved_rope import deinterleave_rows

logger = logging.getLogger(__name__)

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRAManager:
    def __init__(
        self,
        model: nn.Module,
        specs: list[AdapterSpec],
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        why = getattr(model, "lora_unsupported", None)
        if why:
            raise ValueError(f"LoRA adapters cannot be served on {type(model).__name__}: {why}")
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.device = device
        self.dtype = dtype
        self.specs: dict[int, AdapterSpec] = {}
        # of this forward: the slots its adapters are in (lo, hi), and which of their rank
        # columns each token reads ([num_tokens, (hi - lo + 1) * max_rank]; None: no adapter)
        self.slot_range = (0, num_slots - 1)
        self.mask: torch.Tensor | None = None
        self.layers: dict[str, LoRALinear] = {}
        # adapter id -> {our module path: {shard: (A, B)}}, on the host
        self.weights: dict[int, dict[str, dict[Hashable, tuple[torch.Tensor, torch.Tensor]]]] = {}
        self.model = model
        for spec in specs:
            self.add(spec)
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, LRU first
        self._column_slot = torch.arange(num_slots, device=device).repeat_interleave(max_rank)
        logger.info(
            "LoRA: %d adapter(s) %s, %d slots, max rank %d, %d modules adapted",
            len(specs), [s.name for s in specs], num_slots, max_rank, len(self.layers),
        )  # fmt: skip

    # -- adapters --------------------------------------------------------------------------------
    def add(self, spec: AdapterSpec) -> None:
        """Read an adapter into host memory (at start, or into a running engine: between
        forwards); ValueError, naming the adapter, if it cannot be served. A module no adapter
        named before is wrapped now (its slots all zero, as for adapters that do not adapt it)."""
        if spec.rank > self.max_rank:
            raise ValueError(
                f"LoRA adapter {spec.name!r}: rank {spec.rank} > max_lora_rank {self.max_rank}"
            )
        if spec.id in self.specs:
            raise ValueError(f"LoRA adapter id {spec.id} is taken ({self.specs[spec.id].name!r})")
        tensors = load_adapter_weights(spec, self.dtype)
        self.weights[spec.id] = self._place(self.model, spec, tensors)
        self.specs[spec.id] = spec

    def remove(self, adapter_id: int) -> None:
        """Forget an adapter no request uses any more (between forwards); its slot is free."""
        self.specs.pop(adapter_id, None)
        self.weights.pop(adapter_id, None)
        self.slot_of.pop(adapter_id, None)

    def _place(
        self, model: nn.Module, spec: AdapterSpec, tensors: dict[str, tuple[torch.Tensor, ...]]
    ) -> dict[str, dict[Hashable, tuple[torch.Tensor, torch.Tensor]]]:
        """Map the adapter's PEFT module paths to the model's (fused) modules, wrapping each
        module in a `LoRALinear` the first time an adapter names it."""
        stacked = getattr(model, "stacked_weights", ())
        # interleaved rope (GLM-4, ERNIE 4.5): q/k rows reordered at load, B's rows alike
        interleaved = getattr(model, "interleaved_rows", None)
        placed: dict[str, dict[Hashable, tuple[torch.Tensor, torch.Tensor]]] = {}
        for path, (a, b) in sorted(_unfused(model, spec, tensors).items()):
            leaf = path.rsplit(".", 1)[-1]
            if leaf not in TARGET_MODULES:
                raise ValueError(
                    f"LoRA adapter {spec.name!r} adapts {path}; only {list(TARGET_MODULES)} "
                    "can be adapted"
                )
            if interleaved is not None and leaf in ("q_proj", "k_proj"):
                head_dim, rotated = interleaved
                if b.shape[0] % head_dim:
                    raise ValueError(
                        f"LoRA adapter {spec.name!r}: {path} has B {tuple(b.shape)}, not whole "
                        f"heads of {head_dim} (is it an adapter of another base model?)"
                    )
                b = deinterleave_rows(b, head_dim, 0, rotated)
            ours, shard = path, None
            for fused, theirs, shard_id in stacked:
                if theirs in path + ".":
                    ours, shard = (path + ".").replace(theirs, fused).rstrip("."), shard_id
                    break
            layer = self._wrap(model, ours, spec, path)
            try:
                _, size = layer.shard_of(shard)
            except KeyError as e:
                raise ValueError(f"LoRA adapter {spec.name!r}: {path}: {e}") from None
            a, b = layer.part(shard, a, b)  # (tensor parallelism: this rank's part)
            if a.shape[1] != layer.base.in_features or b.shape[0] != size:
                raise ValueError(
                    f"LoRA adapter {spec.name!r}: {path} has A {tuple(a.shape)}, B "
                    f"{tuple(b.shape)}; the model's layer takes {layer.base.in_features} "
                    f"inputs to {size} outputs (is it an adapter of another base model?)"
                )
            placed.setdefault(ours, {})[shard] = (a, b)
        return placed

    def _wrap(self, model: nn.Module, path: str, spec: AdapterSpec, theirs: str) -> LoRALinear:
        if path in self.layers:
            return self.layers[path]
        try:
            module = model.get_submodule(path)
        except AttributeError:
            module = None
        if not isinstance(module, nn.Linear | Fp8Linear | IntWeightLinear):
            raise ValueError(
                f"LoRA adapter {spec.name!r} adapts {theirs}, which this model does not have "
                "(is it an adapter of another base model?)"
            )
        parent_path, _, attr = path.rpartition(".")
        layer = LoRALinear(module, self)
        setattr(model.get_submodule(parent_path), attr, layer)
        self.layers[path] = layer
        return layer

    @contextlib.contextmanager
    def unwrapped(self) -> Iterator[None]:
        """The model with its own layers where `LoRALinear`s wrap them (its parameters under
        their checkpoint names, for the loader), wrapped again after."""
        for path, layer in self.layers.items():
            parent, _, attr = path.rpartition(".")
            setattr(self.model.get_submodule(parent), attr, layer.base)
        try:
            yield
        finally:
            for path, layer in self.layers.items():
                parent, _, attr = path.rpartition(".")
                setattr(self.model.get_submodule(parent), attr, layer)

    # -- batches --------------------------------------------------------------------------------
    @property
    def columns(self) -> int:
        """The rank columns of every slot: a CUDA graph's static mask is this wide."""
        return self.num_slots * self.max_rank

    def prepare(
        self, forward_batch: ForwardBatch, graph_rows: tuple[torch.Tensor, int] | None = None
    ) -> None:
        """Slots for the batch's adapters, and the mask of its tokens' rank columns. For a
        CUDA graph's replay, `graph_rows` (the graph's static mask rows, tokens a request):
        the mask is written there, over every slot (`bind_graph_rows`), each request's rows
        that many in order (padding rows zero)."""
        ids = forward_batch.lora_ids or []
        needed = set(ids) - {0}
        if len(needed) > self.num_slots:
            raise RuntimeError(
                f"a batch uses {len(needed)} LoRA adapters; there are {self.num_slots} slots"
            )
        for adapter_id in sorted(needed):
            self._load(adapter_id, needed)
        slots = [-1 if i == 0 else self.slot_of[i] for i in ids]
        if graph_rows is not None:
            rows, per_request = graph_rows
            padded = [*slots, *[-1] * (len(rows) // per_request - len(slots))]
            token_slot = torch.tensor(padded, dtype=torch.int64).repeat_interleave(per_request)
            rows.copy_(self._mask(token_slot.to(self.device), 0, self.num_slots - 1))
            self.bind_graph_rows(rows)
            return
        if not needed:
            self.mask = None
            return
        lo, hi = min(self.slot_of[i] for i in needed), max(self.slot_of[i] for i in needed)
        self.slot_range = (lo, hi)
        per_req = torch.tensor(slots, dtype=torch.int64)
        if forward_batch.forward_mode.is_extend():
            lens = torch.tensor(forward_batch.extend_seq_lens_cpu, dtype=torch.int64)
            per_req = per_req.repeat_interleave(lens)
        self.mask = self._mask(per_req.to(self.device), lo, hi)

    def bind_graph_rows(self, rows: torch.Tensor) -> None:
        """The LoRA layers read `rows` (a CUDA graph's static mask, [tokens, columns]) over
        every slot: what a graph records, and what its replay reads."""
        self.mask = rows
        self.slot_range = (0, self.num_slots - 1)

    def _mask(self, token_slot: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        columns = self._column_slot[lo * self.max_rank : (hi + 1) * self.max_rank]
        return (token_slot[:, None] == columns[None, :]).to(self.dtype)

    def _load(self, adapter_id: int, needed: set[int]) -> None:
        if adapter_id in self.slot_of:
            self.slot_of.move_to_end(adapter_id)
            return
        if adapter_id not in self.weights:
            raise RuntimeError(f"unknown LoRA adapter id {adapter_id}")
        if len(self.slot_of) < self.num_slots:  # (after a `remove`, not the highest)
            slot = min(set(range(self.num_slots)) - set(self.slot_of.values()))
        else:
            victim = next(i for i in self.slot_of if i not in needed)
            slot = self.slot_of.pop(victim)
        spec = self.specs[adapter_id]
        modules = self.weights[adapter_id]
        for path, layer in self.layers.items():
            layer.set_slot(slot, modules.get(path, {}), spec.scaling)
        self.slot_of[adapter_id] = slot


def _unfused(
    model: nn.Module, spec: AdapterSpec, tensors: dict[str, tuple[torch.Tensor, ...]]
) -> dict[str, tuple[torch.Tensor, ...]]:
    """An adapter of a module the checkpoint fuses (Phi-3's `qkv_proj`, `gate_up_proj`) as
    adapters of its pieces (q/k/v_proj, gate/up_proj): each piece takes the same A and its
    rows of B, since B @ A @ x stacks the pieces' B_i @ A @ x."""
    parts = model.fused_parts() if hasattr(model, "fused_parts") else {}
    out: dict[str, tuple[torch.Tensor, ...]] = {}
    for path, (a, b) in tensors.items():
        fused = next((key for key in parts if key in path + "."), None)
        if fused is None:
            out[path] = (a, b)
            continue
        rows = sum(size for _, size in parts[fused])
        if b.shape[0] != rows:
            raise ValueError(
                f"LoRA adapter {spec.name!r}: {path} has B {tuple(b.shape)}; the model's "
                f"{fused.strip('.')} has {rows} outputs (is it an adapter of another base model?)"
            )
        start = 0
        for piece, size in parts[fused]:
            out[(path + ".").replace(fused, piece).rstrip(".")] = (a, b[start : start + size])
            start += size
    return out

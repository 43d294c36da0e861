"""LoRAManager's device slots and masks: adapters go into free slots, then replace the least
recently used adapter the batch does not need; each token's mask row selects its request's
slot; a slot holds exactly its adapter's matrices (scaled B, zero padding past its rank)."""

from __future__ import annotations

import pytest
import torch

from engine.config import ModelConfig
from engine.forward_batch import ForwardMode
from engine.loader import load_model
from engine.lora import read_adapter_specs
from engine.lora.adapter import load_adapter_weights
from engine.lora.manager import LoRAManager
from tests.factories import tiny_lora, tiny_model


class _Batch:
    def __init__(self, lora_ids: list[int], lens: list[int] | None = None) -> None:
        self.lora_ids = lora_ids
        self.forward_mode = ForwardMode.EXTEND if lens else ForwardMode.DECODE
        self.extend_seq_lens_cpu = lens


@pytest.fixture(scope="module")
def setup():
    path = tiny_model("llama")
    adapters = [tiny_lora(path, seed, rank) for seed, rank in ((1, 8), (2, 4), (3, 8))]
    specs = read_adapter_specs([f"a{i}={p}" for i, p in enumerate(adapters, start=1)])
    return path, specs


def make(setup, slots: int) -> LoRAManager:
    path, specs = setup
    model = load_model(ModelConfig.from_pretrained(path), torch.float32)
    return LoRAManager(model, specs, slots, 8, torch.float32, torch.device("cpu"))


def slot_matches(manager: LoRAManager, adapter_id: int) -> bool:
    """Whether q_proj of layer 0 holds adapter `adapter_id` in its slot."""
    spec = manager.specs[adapter_id]
    a, b = load_adapter_weights(spec, torch.float32)["model.layers.0.self_attn.q_proj"]
    layer = manager.layers["model.layers.0.self_attn.qkv_proj"]
    slot, rank, slots = manager.slot_of[adapter_id], manager.max_rank, manager.num_slots
    rows = layer.lora_a[slot * 3 * rank : (slot * 3 + 1) * rank]  # [slot][shard][rank]; q first
    cols = layer.lora_b[0][:, slot * rank : (slot + 1) * rank]
    assert slots * rank * 3 == layer.lora_a.shape[0]
    return (
        torch.equal(rows[: spec.rank], a)
        and not rows[spec.rank :].any()
        and torch.allclose(cols[:, : spec.rank], b * spec.scaling)
        and not cols[:, spec.rank :].any()
    )


def test_slots_fill_then_replace_the_least_recently_used(setup) -> None:
    m = make(setup, slots=2)
    m.prepare(_Batch([1, 0, 2]))
    assert dict(m.slot_of) == {1: 0, 2: 1}
    assert slot_matches(m, 1) and slot_matches(m, 2)
    m.prepare(_Batch([3, 1]))  # 2 is the one not needed
    assert dict(m.slot_of) == {1: 0, 3: 1}
    assert slot_matches(m, 3) and slot_matches(m, 1)
    m.prepare(_Batch([2]))  # both unneeded: 1 was touched before 3 was loaded, so 1 goes
    assert dict(m.slot_of) == {3: 1, 2: 0}
    assert slot_matches(m, 2) and slot_matches(m, 3)
    with pytest.raises(RuntimeError, match="3 LoRA adapters; there are 2 slots"):
        m.prepare(_Batch([1, 2, 3]))


def test_mask_selects_each_tokens_slot(setup) -> None:
    m = make(setup, slots=3)
    m.prepare(_Batch([2, 0, 1], lens=[2, 3, 1]))  # extend: per-token rows
    assert dict(m.slot_of) == {1: 0, 2: 1} and m.slot_range == (0, 1)
    assert m.mask is not None and m.mask.shape == (6, 2 * 8)  # slots 0..1 only
    per_token = [2, 2, 0, 0, 0, 1]
    for t, adapter_id in enumerate(per_token):
        want = torch.zeros(2 * 8)
        if adapter_id:
            slot = m.slot_of[adapter_id]
            want[slot * 8 : (slot + 1) * 8] = 1
        assert torch.equal(m.mask[t], want), t
    m.prepare(_Batch([0, 3, 3]))  # decode, one adapter: its slot alone
    assert m.slot_of[3] == 2 and m.slot_range == (2, 2)
    assert torch.equal(m.mask, torch.tensor([[0.0] * 8, [1.0] * 8, [1.0] * 8]))
    m.prepare(_Batch([0, 0]))
    assert m.mask is None  # no adapter in the batch: the layers skip the LoRA matmuls


def test_removed_adapters_free_their_slot_and_added_ones_take_it(setup) -> None:
    """An adapter removed while running leaves a hole in the slots; the next adapter goes
    into that hole (not onto the slot of an adapter the batch still uses)."""
    path, specs = setup
    m = make(setup, slots=3)
    m.prepare(_Batch([1, 2, 3]))
    assert dict(m.slot_of) == {1: 0, 2: 1, 3: 2}
    m.remove(1)
    assert 1 not in m.specs and 1 not in m.weights and dict(m.slot_of) == {2: 1, 3: 2}
    late = read_adapter_specs([f"late={tiny_lora(path, 4, 8)}"])[0]
    late = type(late)(7, late.name, late.path, late.rank, late.scaling, late.config)
    m.add(late)
    m.prepare(_Batch([2, 7, 3]))
    assert dict(m.slot_of) == {2: 1, 7: 0, 3: 2}
    assert slot_matches(m, 7) and slot_matches(m, 2) and slot_matches(m, 3)
    with pytest.raises(ValueError, match="id 7 is taken"):
        m.add(late)
    big = read_adapter_specs([f"big={tiny_lora(path, 5, 16)}"])[0]
    with pytest.raises(ValueError, match="'big': rank 16 > max_lora_rank 8"):
        m.add(big)

"""Mixture-of-experts members of the Llama family: Mixtral, Qwen2-MoE and Qwen3-MoE.

Attention is their dense sibling's (Mistral's; Qwen2's q/k/v bias; Qwen3's q/k norms); the
feed-forward block of a sparse layer is `engine.layers.moe.SparseMoeBlock`:
* Mixtral: every layer; `num_local_experts` experts of `intermediate_size`, top-k weights
  always renormalised. Its checkpoint names the block `block_sparse_moe` and the experts'
  matrices w1 (gate), w3 (up) and w2 (down).
* Qwen2-MoE / Qwen3-MoE: `num_experts` experts of `moe_intermediate_size`, renormalised if
  `norm_topk_prob`; layers in `mlp_only_layers`, or off the `decoder_sparse_step` grid, keep
  a dense MLP of `intermediate_size`. Qwen2-MoE adds a shared expert
  (`shared_expert_intermediate_size`) gated by sigmoid(`shared_expert_gate`).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from engine.layers.moe import SparseMoeBlock
from engine.models.llama import LlamaForCausalLM, LlamaMLP, Qwen3ForCausalLM

# model.layers.{i}.mlp.experts.{e}.{proj}.weight -> (layer prefix, expert, proj)
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(\w+)\.weight$")
# checkpoint projection name -> (our stacked parameter, shard)
_EXPERT_SHARDS = {
    "gate_proj": ("w13", "gate"),
    "up_proj": ("w13", "up"),
    "down_proj": ("w2", "down"),
    "w1": ("w13", "gate"),
    "w3": ("w13", "up"),
    "w2": ("w2", "down"),
}


class _MoeWeights:
    """Maps per-expert checkpoint matrices onto the stacked `w13` / `w2` (mixin)."""

    def _map_weight(self, name: str, tensor: torch.Tensor):
        name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's name for the block
        match = _EXPERT.match(name)
        if match is None:
            return super()._map_weight(name, tensor)
        prefix, expert, proj = match.groups()
        if proj not in _EXPERT_SHARDS:
            raise ValueError(f"unexpected expert weight {name!r} in checkpoint")
        param, shard = _EXPERT_SHARDS[proj]
        return f"{prefix}.{param}.weight", tensor, (int(expert), shard)


def _is_sparse_layer(config, layer_id: int) -> bool:
    """Qwen-MoE's rule for which layers route to experts."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (
        config.num_experts > 0
        and layer_id not in (getattr(config, "mlp_only_layers", None) or [])
        and (layer_id + 1) % step == 0
    )


class MixtralForCausalLM(_MoeWeights, LlamaForCausalLM):
    @staticmethod
    def make_mlp(config, layer_id: int) -> nn.Module:
        return SparseMoeBlock(
            config.hidden_size,
            num_experts=config.num_local_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.intermediate_size,
            renormalize=True,
        )


def _qwen_moe_mlp(config, layer_id: int, renormalize_default: bool) -> nn.Module:
    """A Qwen-MoE layer's block: dense off the sparse grid, else the experts (and a shared
    expert where the config sizes one)."""
    if not _is_sparse_layer(config, layer_id):
        return LlamaMLP(config)
    shared_size = getattr(config, "shared_expert_intermediate_size", 0)
    return SparseMoeBlock(
        config.hidden_size,
        num_experts=config.num_experts,
        top_k=config.num_experts_per_tok,
        intermediate_size=config.moe_intermediate_size,
        renormalize=bool(getattr(config, "norm_topk_prob", renormalize_default)),
        shared_expert=LlamaMLP(config, shared_size) if shared_size else None,
    )


class Qwen2MoeForCausalLM(_MoeWeights, LlamaForCausalLM):
    @staticmethod
    def attention_biases(config) -> tuple[bool, bool]:
        return bool(getattr(config, "qkv_bias", True)), False

    @staticmethod
    def make_mlp(config, layer_id: int) -> nn.Module:
        return _qwen_moe_mlp(config, layer_id, renormalize_default=False)


class Qwen3MoeForCausalLM(_MoeWeights, Qwen3ForCausalLM):
    @staticmethod
    def make_mlp(config, layer_id: int) -> nn.Module:
        return _qwen_moe_mlp(config, layer_id, renormalize_default=True)

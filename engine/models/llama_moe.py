"""Mixture-of-experts members of the Llama family: Mixtral, Qwen2-MoE, Qwen3-MoE and ERNIE 4.5
MoE.

Attention is their dense sibling's (Mistral's; Qwen2's q/k/v bias; Qwen3's q/k norms); the
feed-forward block of a sparse layer is `engine.layers.moe.SparseMoeBlock`:
* Mixtral: every layer; `num_local_experts` experts of `intermediate_size`, top-k weights
  always renormalised. Its checkpoint names the block `block_sparse_moe` and the experts'
  matrices w1 (gate), w3 (up) and w2 (down).
* Qwen2-MoE / Qwen3-MoE: `num_experts` experts of `moe_intermediate_size`, renormalised if
  `norm_topk_prob`; layers in `mlp_only_layers`, or off the `decoder_sparse_step` grid, keep
  a dense MLP of `intermediate_size`. Qwen2-MoE adds a shared expert
  (`shared_expert_intermediate_size`) gated by sigmoid(`shared_expert_gate`).
* ERNIE 4.5 MoE (ERNIE-4.5-21B-A3B, 300B-A47B): ERNIE 4.5's attention (interleaved rope);
  `moe_num_experts` experts of `moe_intermediate_size` from `moe_layer_start_index` to
  `moe_layer_end_index` every `moe_layer_interval` layers, `moe_num_shared_experts` always-on
  ones; routed by softmax (float32, a float32 router as transformers keeps it), chosen by the
  probabilities plus `moe_statics.e_score_correction_bias`, the chosen probabilities
  renormalised (their sum clamped at `moe_norm_min`). Its checkpoints' MTP block
  (`model.mtp_*`) is skipped at load (engine/models/causal_lm.py).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.moe import FusedMoE, SparseMoeBlock
from engine.models.llama import (
    Ernie4_5ForCausalLM,
    LlamaForCausalLM,
    LlamaMLP,
    Qwen3ForCausalLM,
)

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


class ErnieMoE(nn.Module):
    """Router, routed experts and shared experts of one ERNIE 4.5 MoE layer."""

    def __init__(self, config) -> None:
        super().__init__()
        num_experts, self.top_k = config.moe_num_experts, config.moe_k
        if not 0 < self.top_k <= num_experts:
            raise ValueError(f"moe_k={self.top_k} must be in [1, {num_experts}]")
        self.norm_min = float(getattr(config, "moe_norm_min", 1e-12))
        self.gate = nn.Linear(config.hidden_size, num_experts, bias=False, dtype=torch.float32)
        self.moe_statics = nn.Module()
        self.moe_statics.e_score_correction_bias = nn.Parameter(
            torch.zeros(1, num_experts, dtype=torch.float32), requires_grad=False
        )
        self.experts = FusedMoE(num_experts, config.hidden_size, config.moe_intermediate_size)
        shared = config.moe_num_shared_experts or 0
        bias = bool(getattr(config, "use_bias", False))
        self.shared_experts = (
            LlamaMLP(config, config.moe_intermediate_size * shared, bias=bias) if shared else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.linear(x.float(), self.gate.weight.float()).softmax(dim=-1)
        choice = probs + self.moe_statics.e_score_correction_bias.float()
        ids = choice.topk(self.top_k, dim=-1)[1]
        weights = probs.gather(1, ids)
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=self.norm_min)
        out = self.experts(x, weights.to(x.dtype), ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class Ernie4_5_MoeForCausalLM(_MoeWeights, Ernie4_5ForCausalLM):  # noqa: N801 - checkpoints' name
    def __init__(self, config, max_position: int | None = None) -> None:
        if getattr(config, "use_bias", False):  # (the released checkpoints have none)
            raise ValueError("ERNIE 4.5 MoE with use_bias (its lm_head has a bias then) is not "
                             "supported")  # fmt: skip
        super().__init__(config, max_position)

    @staticmethod
    def make_mlp(config, layer_id: int) -> nn.Module:
        end = config.moe_layer_end_index
        end = config.num_hidden_layers - 1 if end is None or end < 0 else end
        sparse = (
            (layer_id + 1) % (config.moe_layer_interval or 1) == 0
            and config.moe_layer_start_index <= layer_id <= end
            and config.moe_num_experts
        )
        if sparse:
            return ErnieMoE(config)
        return LlamaMLP(config, bias=bool(getattr(config, "use_bias", False)))

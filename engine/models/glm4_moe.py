"""GLM-4.5, GLM-4.6 and GLM-4.7 (`Glm4MoeForCausalLM`; -Air too): grouped-query attention with
DeepSeek-V3's mixture of experts.

* Attention: Llama's, with a bias on q/k/v (`attention_bias`; none on o_proj), a per-head
  RMSNorm on q and k where `use_qk_norm`, and rope on the first `partial_rotary_factor` (0.5)
  of each head's features, as rotated halves (transformers' `rotate_half` over that part).
* Feed-forward: `first_k_dense_replace` dense layers, then DeepSeek-V3's routing (sigmoid plus
  `e_score_correction_bias` for the choice, `n_group` / `topk_group`, renormalised where
  `norm_topk_prob`, times `routed_scaling_factor`) over `n_routed_experts` experts with
  `n_shared_experts` always-on ones (engine/models/deepseek.py's `DeepseekMoE`).
* The checkpoints' multi-token-prediction layer (`model.layers.{num_hidden_layers}`) is
  skipped at load (engine/models/causal_lm.py), as SGLang does when it does not speculate.
"""

from __future__ import annotations

from torch import nn

from engine.models.deepseek import DeepseekMoE
from engine.models.llama import LlamaForCausalLM, LlamaMLP
from engine.models.llama_moe import _MoeWeights


class Glm4MoeForCausalLM(_MoeWeights, LlamaForCausalLM):
    @classmethod
    def has_qk_norm(cls, config) -> bool:
        return bool(getattr(config, "use_qk_norm", False))

    @staticmethod
    def attention_biases(config) -> tuple[bool, bool]:
        return bool(getattr(config, "attention_bias", False)), False

    @staticmethod
    def make_mlp(config, layer_id: int) -> nn.Module:
        if layer_id < config.first_k_dense_replace or not config.n_routed_experts:
            return LlamaMLP(config)
        return DeepseekMoE(config, version=3)

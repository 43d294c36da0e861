"""GLM-4 dense (`Glm4ForCausalLM`: GLM-4-9B-0414, GLM-4-32B-0414, GLM-Z1): the Llama layer with

* a q/k/v bias (`attention_bias`; none on o_proj);
* rope on the first `partial_rotary_factor` (0.5) of each head, over interleaved pairs (the
  q/k rows reordered at load, engine/models/interleaved_rope.py);
* sandwich norms: `post_self_attn_layernorm` and `post_mlp_layernorm` on the attention's and
  the MLP's outputs before their residual adds;
* gate and up stored as one `gate_up_proj` tensor, split at load as Phi-3's (so tensor
  parallelism and FP8 block scales take their rows as for Llama).
"""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM
from engine.models.phi3 import Weights, split_fused_weights


class Glm4ForCausalLM(LlamaForCausalLM):
    interleaved_rope = True

    @staticmethod
    def attention_biases(config) -> tuple[bool, bool]:
        return bool(getattr(config, "attention_bias", True)), False

    @staticmethod
    def sandwich_norms(config) -> bool:
        return True

    def load_weights(self, weights: Weights) -> set[str]:
        return super().load_weights(split_fused_weights(weights, self.fused_parts()))

    def fused_parts(self) -> dict[str, tuple[tuple[str, int], ...]]:
        """Checkpoint name part -> (Llama name part, rows) of each piece (PEFT adapters of
        `gate_up_proj` are split the same way: engine/lora/manager.py)."""
        inter = self.config.intermediate_size
        return {".gate_up_proj.": ((".gate_proj.", inter), (".up_proj.", inter))}

"""Multi-token-prediction (MTP, "NextN") layers of DeepSeek-V3 and GLM-4.5 as EAGLE draft
heads (SGLang's `DeepseekV3ForCausalLMNextN` / `Glm4MoeForCausalLMNextN`: `--speculative-
algorithm EAGLE` or `NEXTN` on such a model; vLLM's `deepseek_mtp` / `mtp` methods).

Their checkpoints store `num_nextn_predict_layers` such layers after the decoder's, as
`model.layers.{num_hidden_layers}.*`: `embed_tokens` and `shared_head.head` (copies of the
model's embedding and lm_head), `enorm`, `hnorm`, `eh_proj` and `shared_head.norm`, and a
decoder layer of the model's own kind whose feed-forward is its mixture of experts. At draft
position p the layer reads the embedding of token p + 1 and the model's final normed hidden
state at p (the one the lm_head reads: EAGLE's capture, engine/speculative/eagle.py):

    x = eh_proj([enorm(embed(token p + 1)); hnorm(hidden p)])
    out = shared_head.norm(decoder layer(x))       logits p = lm_head(out): token p + 2

and `out` is the hidden state its next draft reads (as SGLang chains it: the normed output).
The model's embedding and lm_head are used (the checkpoint's copies are skipped, as SGLang
does), and the first MTP layer drafts every step. A folder exported with the MTP layer alone
(SGLang's export script: `architectures` the NextN class, the layer as `model.layers.0`)
loads too. Only the layer's tensors are read from the checkpoint (`reads_tensors`), and
the layer follows the model's weight updates (`weights_companion`, engine/runner_weights.py).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
from torch import nn

from engine.layers.layernorm import RMSNorm
from engine.layers.logits import LogitsProcessor
from engine.layers.rotary import RotaryEmbedding, rope_parameters
from engine.loader import load_named_weights
from engine.models.deepseek import DeepseekDecoderLayer, DeepseekV3ForCausalLM
from engine.models.glm4_moe import Glm4MoeForCausalLM
from engine.models.llama import LlamaDecoderLayer
from engine.models.llama_eagle import _HeadBase

# the MTP layer's own tensors (the rest of `model.layers.{i}.*` is its decoder layer's)
_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")
_SKIPPED = ("embed_tokens.", "shared_head.head.")  # (the model's are used)


def mtp_layer_index(config) -> int:
    """The index under `model.layers.` of the MTP layer the head loads: the first after the
    decoder's, or 0 in a folder exported with that layer alone."""
    arch = (getattr(config, "architectures", None) or [""])[0]
    return 0 if arch in NEXTN_ARCHITECTURES.values() else int(config.num_hidden_layers)


def mtp_head_config(config):
    """The head's config: one layer (the MTP layer), its feed-forward the experts."""
    config = copy.copy(config)
    config.num_hidden_layers = 1
    config.first_k_dense_replace = 0
    return config


class _NextNModel(nn.Module):
    def __init__(self, config, layer: nn.Module) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(hidden, eps)
        self.hnorm = RMSNorm(hidden, eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([layer])  # (the checkpoint's decoder tensors, as layer 0)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(hidden, eps)


class _NextNHead(_HeadBase):
    """An MTP layer as a draft head (mixed in before the model family's class, whose
    checkpoint names it maps: rope rows, experts)."""

    in_model_checkpoint = True  # (its weights follow the model's updates)

    def __init__(self, config, max_position: int | None = None) -> None:
        self.layer_index = mtp_layer_index(config)
        config = mtp_head_config(config)
        super().__init__(config, max_position)
        self.tie_word_embeddings = False  # (the family's weight mapping reads it)
        self.model = _NextNModel(config, self.make_layer(config, self._rotary()))
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def make_layer(self, config, rotary: RotaryEmbedding) -> nn.Module:
        raise NotImplementedError

    @staticmethod
    def hidden_width(target_config) -> int:
        return target_config.hidden_size

    @classmethod
    def reads_tensors(cls, config) -> _LayerNames:
        """The checkpoint tensors the head reads (the others are not read)."""
        return _LayerNames(mtp_layer_index(config))

    def run(self, input_ids, positions, hidden_in, forward_batch):
        model = self.model
        embeds = model.enorm(self.embed(input_ids))
        hidden = model.hnorm(hidden_in.to(embeds.dtype))
        x = model.eh_proj(torch.cat([embeds, hidden], dim=-1))
        x, residual = model.layers[0](positions, x, None, forward_batch)
        out, _ = model.shared_head.norm(x, residual)
        return out, out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        prefix = f"model.layers.{self.layer_index}."

        def transform(name: str, tensor: torch.Tensor):
            if not name.startswith(prefix):
                return None
            rest = name.removeprefix(prefix)
            if rest.startswith(_SKIPPED):
                return None
            if rest.startswith(_OWN):
                return "model." + rest, tensor
            return self._map_weight("model.layers.0." + rest, tensor)

        return load_named_weights(self, weights, stacked=self.load_stacked, transform=transform)


class _LayerNames:
    """The names of the MTP layer's tensors the head reads (a container for
    `iter_safetensors`): not its copies of the model's embedding and lm_head."""

    def __init__(self, index: int) -> None:
        self.prefix = f"model.layers.{index}."

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str) or not name.startswith(self.prefix):
            return False
        return not name.removeprefix(self.prefix).startswith(_SKIPPED)


def has_mtp_layer(path: str) -> bool:
    """Whether the checkpoint in folder `path` stores the MTP layer a head reads (a config
    may declare `num_nextn_predict_layers` over a checkpoint stripped of them), from the
    files' headers."""
    from safetensors import safe_open
    from transformers import AutoConfig

    from engine.loader import safetensors_files

    names = _LayerNames(mtp_layer_index(AutoConfig.from_pretrained(path)))
    for file in safetensors_files(path, names):
        with safe_open(file, framework="pt", device="cpu") as f:
            if any(name in names for name in f.keys()):
                return True
    return False


class DeepseekV3ForCausalLMNextN(_NextNHead, DeepseekV3ForCausalLM):
    load_stacked = DeepseekV3ForCausalLM.load_stacked

    def __init__(self, config, max_position: int | None = None) -> None:
        super().__init__(config, max_position)
        self.split_heads = False
        self._rope_rows = self._interleaved_rope_rows()

    def _rotary(self) -> RotaryEmbedding:
        c = self.config
        return RotaryEmbedding(
            c.qk_rope_head_dim, self.max_position, rope_parameters(c), context_len=self.context_len
        )

    def make_layer(self, config, rotary: RotaryEmbedding) -> nn.Module:
        return DeepseekDecoderLayer(config, 0, rotary, self.version)


class Glm4MoeForCausalLMNextN(_NextNHead, Glm4MoeForCausalLM):
    load_stacked = Glm4MoeForCausalLM.load_stacked

    def __init__(self, config, max_position: int | None = None) -> None:
        super().__init__(config, max_position)
        self.interleaved_rows = None  # (GLM-4.5 rotates halves)

    def make_layer(self, config, rotary: RotaryEmbedding) -> nn.Module:
        return LlamaDecoderLayer(config, 0, rotary, Glm4MoeForCausalLM)


# the model's architecture -> its MTP head's (SGLang's names)
NEXTN_ARCHITECTURES = {
    "DeepseekV3ForCausalLM": "DeepseekV3ForCausalLMNextN",
    "Glm4MoeForCausalLM": "Glm4MoeForCausalLMNextN",
}

"""One implementation for the Llama family: Llama, Mistral, Ministral 3, Qwen2, Qwen3,
Granite, SmolLM3, Seed-OSS and ERNIE 4.5 (GLM-4's layer too, engine/models/glm4.py, and
gpt-oss's, engine/models/gpt_oss.py).

The variants differ only in small switches, held as class attributes:
* Qwen2 puts a bias on q/k/v (not on o_proj);
* Qwen3 applies a per-head RMSNorm to q and k before rope, and its `head_dim` may differ
  from hidden_size / num_heads;
* Llama and Qwen3 take `attention_bias` (q/k/v/o) and Llama `mlp_bias` from the config;
* SmolLM3 leaves rope out of the layers `no_rope_layers` marks 0; Ministral 3 scales its
  queries by a temperature past its original context;
* Granite scales the input embeddings, each attention and MLP output (before its residual
  add), the attention scores and the logits by numbers from its config;
* GLM-4 normalises each attention and MLP output before its residual add (sandwich norms);
  GLM-4 and ERNIE 4.5 rotate interleaved pairs (their q/k rows reordered at load, see
  engine/models/interleaved_rope.py).

Fused projections: `qkv_proj` = [q; k; v] and `gate_up_proj` = [gate; up] (see
`engine.layers.linear.MergedLinear`), one matmul each; rope rotates q and k together as one
[num_tokens, num_heads + num_kv_heads, head_dim] slab.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

import kernels.gemv
from engine.distributed import current_tp
from engine.forward_batch import ForwardBatch
from engine.layer_windows import layer_sliding_windows
from engine.layers.activation import SiluAndMul
from engine.layers.attention import PagedAttention
from engine.layers.layernorm import RMSNorm
from engine.layers.linear import MergedLinear, gemv_fits, norm_gemv
from engine.layers.parallel import (
    RowParallelLinear,
    VocabParallelEmbedding,
    kv_heads_per_rank,
)
from engine.layers.rotary import RotaryEmbedding, rope_parameters, rotary_dim
from engine.models.causal_lm import DecoderForCausalLM
from engine.models.interleaved_rope import deinterleave

STACKED_WEIGHTS = (
    (".qkv_proj.", ".q_proj.", "q"),
    (".qkv_proj.", ".k_proj.", "k"),
    (".qkv_proj.", ".v_proj.", "v"),
    (".gate_up_proj.", ".gate_proj.", "gate"),
    (".gate_up_proj.", ".up_proj.", "up"),
)


class LlamaAttention(nn.Module):
    """With tensor parallelism (`current_tp()` while built): this rank's query heads and K/V
    heads (engine/layers/parallel.py); `num_heads` and `num_kv_heads` are the rank's."""

    def __init__(self, config, layer_id: int, rotary: RotaryEmbedding, variant: type) -> None:
        super().__init__()
        hidden, tp = config.hidden_size, current_tp()
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        self.head_dim = d = getattr(config, "head_dim", None) or hidden // heads
        q_start, self.num_heads = tp.shard(heads, "attention heads")
        kv_start, self.num_kv_heads = kv_heads_per_rank(kv_heads, tp)
        qkv_bias, o_bias = variant.attention_biases(config)
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        kv_rows = (kv_start * d, kv_size, kv_heads * d)
        sources = {"q": (q_start * d, q_size, heads * d), "k": kv_rows, "v": kv_rows}
        self.qkv_proj = MergedLinear(
            hidden, [("q", q_size), ("k", kv_size), ("v", kv_size)], bias=qkv_bias,
            sources=sources if tp.size > 1 else None,
        )  # fmt: skip
        self.o_proj = (
            RowParallelLinear(heads * d, hidden, o_bias, tp) if tp.size > 1
            else nn.Linear(q_size, hidden, bias=o_bias)
        )  # fmt: skip
        self.qk_norm = variant.has_qk_norm(config)
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary = rotary if variant.uses_rope(config, layer_id) else None  # (SmolLM3's NoPE)
        # Ministral 3's query temperature (Llama 4's): q times 1 + beta * log(1 + floor(p / L))
        params = rotary.params
        self.query_beta = params.get("llama_4_scaling_beta")
        self.query_period = params.get("original_max_position_embeddings")
        self.attn = PagedAttention(
            layer_id,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            variant.attention_scale(config, self.head_dim),
            sliding_window=layer_sliding_windows(config, config.num_hidden_layers)[layer_id],
            sinks=variant.attention_sinks,
        )

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        return self.attend(positions, self.qkv_proj(hidden), forward_batch)

    def attend(
        self, positions: torch.Tensor, qkv: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """The layer from the qkv projection's output on: rope, attention, o_proj."""
        num_tokens = qkv.shape[0]
        qk_size = (self.num_heads + self.num_kv_heads) * self.head_dim
        qk = qkv[:, :qk_size].view(num_tokens, -1, self.head_dim)
        v = qkv[:, qk_size:]
        if self.qk_norm:
            q = self.q_norm(qk[:, : self.num_heads])
            k = self.k_norm(qk[:, self.num_heads :])
            qk = torch.cat((q, k), dim=1)
        stored = False
        if self.rotary is not None:
            qk, stored = self.rotary.rotate_and_store(positions, qk, v, self.attn, forward_batch)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        if self.query_beta:
            q = q * query_temperature(positions, self.query_beta, self.query_period, q.dtype)
        out = self.attn(q, k, v, forward_batch, kv_stored=stored)
        return self.o_proj(out)


def query_temperature(
    positions: torch.Tensor, beta: float, period: int, dtype: torch.dtype
) -> torch.Tensor:
    """[tokens, 1, 1]: 1 + beta * log(1 + floor(position / period)), as transformers computes
    it (float32, then the model's dtype): 1 below `period`, growing with each period after."""
    periods = torch.floor(positions.to(torch.float32) / period)
    return (1 + beta * torch.log1p(periods)).to(dtype)[:, None, None]


class LlamaMLP(nn.Module):
    def __init__(
        self, config, intermediate_size: int | None = None, bias: bool | None = None
    ) -> None:
        super().__init__()
        if config.hidden_act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
        full = intermediate_size or config.intermediate_size
        if bias is None:
            bias = bool(getattr(config, "mlp_bias", False))
        tp = current_tp()
        start, inter = tp.shard(full, "intermediate features")  # (all of them with one rank)
        rows = (start, inter, full)
        self.gate_up_proj = MergedLinear(
            config.hidden_size, [("gate", inter), ("up", inter)], bias=bias,
            sources={"gate": rows, "up": rows} if tp.size > 1 else None,
        )  # fmt: skip
        self.act = SiluAndMul()
        self.down_proj = (
            RowParallelLinear(full, config.hidden_size, bias, tp) if tp.size > 1
            else nn.Linear(inter, config.hidden_size, bias=bias)
        )  # fmt: skip
        self.gemv_max_rows = 0  # --gemv-backend triton (engine.layers.linear.use_triton_gemv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.gate_up_proj(x))

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The MLP from the gate_up projection's output on: SiLU-and-mul, down_proj."""
        down = self.down_proj
        if (
            self.gemv_max_rows
            and type(down) is nn.Linear  # not quantized, not wrapped by a LoRA layer
            and gemv_fits(gate_up, down.weight, self.gemv_max_rows)
        ):
            # the activation computed inside the down projection's GEMV, as it loads gate_up
            return kernels.gemv.gemv(gate_up, down.weight, down.bias, act="silu_mul")
        return down(self.act(gate_up))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int, rotary: RotaryEmbedding, variant: type) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, rotary, variant)
        self.mlp = variant.make_mlp(config, layer_id)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.gemv_max_rows = 0  # --gemv-backend triton (engine.layers.linear.use_triton_gemv)
        # (Granite: the attention's and the MLP's outputs times this before each residual add)
        self.residual_multiplier = variant.multipliers(config)[1]
        # (GLM-4: the attention's and the MLP's outputs normalised before each residual add)
        self.sandwich = variant.sandwich_norms(config)
        if self.sandwich:
            self.post_self_attn_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.post_mlp_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        forward_batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (mlp output, residual stream before it); the caller adds them lazily."""
        attn, mlp, norm = self.self_attn, self.mlp, self.post_attention_layernorm
        # --gemv-backend triton, a few rows: each norm inside the next projection's GEMV where
        # that projection is a plain one (not quantized, not under a LoRA adapter)
        if self._norm_in_gemv(attn.qkv_proj, hidden):
            qkv, residual = norm_gemv(hidden, residual, self.input_layernorm, attn.qkv_proj)
            hidden = self._output(attn.attend(positions, qkv, forward_batch), "attn")
        else:
            if residual is None:
                hidden, residual = self.input_layernorm(hidden), hidden
            else:
                hidden, residual = self.input_layernorm(hidden, residual)
            hidden = self._output(attn(positions, hidden, forward_batch), "attn")
        if self._norm_in_gemv(getattr(mlp, "gate_up_proj", None), hidden):
            gate_up, residual = norm_gemv(hidden, residual, norm, mlp.gate_up_proj)
            return self._output(mlp.down(gate_up), "mlp"), residual
        hidden, residual = norm(hidden, residual)
        return self._output(mlp(hidden), "mlp"), residual

    def _output(self, out: torch.Tensor, block: str) -> torch.Tensor:
        """A block's output as its residual add takes it: GLM-4's post norm, Granite's
        multiplier."""
        if self.sandwich:
            norm = self.post_self_attn_layernorm if block == "attn" else self.post_mlp_layernorm
            out = norm(out)
        return out if self.residual_multiplier == 1.0 else out * self.residual_multiplier

    def _norm_in_gemv(self, proj: nn.Module | None, hidden: torch.Tensor) -> bool:
        return (
            self.gemv_max_rows > 0
            and type(proj) is MergedLinear
            and gemv_fits(hidden, proj.weight, self.gemv_max_rows)
        )


class LlamaModel(nn.Module):
    def __init__(
        self, config, max_position: int, variant: type, context_len: int | None = None
    ) -> None:
        super().__init__()
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        rotary = RotaryEmbedding(
            head_dim, max_position, rope_parameters(config), context_len=context_len
        )
        tp = current_tp()
        self.embed_tokens = (
            VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp) if tp.size > 1
            else nn.Embedding(config.vocab_size, config.hidden_size)
        )  # fmt: skip
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, rotary, variant) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.embedding_multiplier = variant.multipliers(config)[0]
        # EAGLE-3 speculation: the layers whose input residual stream is kept for the draft
        # head, and where (engine/speculative/eagle.py; None without)
        self.aux_capture = None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.embedding_multiplier != 1.0:
            hidden = hidden * self.embedding_multiplier
        residual = None
        capture = self.aux_capture
        aux = [] if capture is not None else None
        for i, layer in enumerate(self.layers):
            if aux is not None and i in capture.layers:
                aux.append(hidden if residual is None else hidden + residual)
            hidden, residual = layer(positions, hidden, residual, forward_batch)
        if aux is not None:
            if len(self.layers) in capture.layers:
                aux.append(hidden + residual)
            capture.store_layers(aux, forward_batch)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(DecoderForCausalLM):
    """`forward(input_ids, positions, forward_batch)` -> float32 logits (see LogitsProcessor).

    The backend's `init_forward_metadata(forward_batch)` must have run for this batch.
    """

    load_stacked = STACKED_WEIGHTS

    qk_norm = False
    supports_tensor_parallel = True  # (engine/layers/parallel.py; its MoE subclasses too)
    stacked_weights = STACKED_WEIGHTS  # (fused, PEFT/HF name, shard): for LoRA too

    @classmethod
    def has_qk_norm(cls, config) -> bool:
        """Whether q and k take a per-head RMSNorm before rope (Qwen3's; GLM-4.5's where its
        config's `use_qk_norm` says)."""
        return cls.qk_norm

    @staticmethod
    def attention_biases(config) -> tuple[bool, bool]:
        """(bias on q/k/v, bias on o_proj)."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    @staticmethod
    def attention_scale(config, head_dim: int) -> float:
        """The factor on the attention scores (Granite: its config's `attention_multiplier`)."""
        return head_dim**-0.5

    @staticmethod
    def uses_rope(config, layer_id: int) -> bool:
        """Whether layer `layer_id` rotates q and k (SmolLM3 leaves every fourth alone)."""
        return True

    @staticmethod
    def multipliers(config) -> tuple[float, float, float | None]:
        """(on the input embeddings, on each attention / MLP output before its residual add,
        dividing the logits or None): Granite's; 1, 1, None for the others."""
        return 1.0, 1.0, None

    @staticmethod
    def make_mlp(config, layer_id: int) -> nn.Module:
        """Layer `layer_id`'s feed-forward block (mixture-of-experts models override it)."""
        return LlamaMLP(config)

    @staticmethod
    def sandwich_norms(config) -> bool:
        """Whether each attention and MLP output is normalised before its residual add
        (GLM-4's `post_self_attn_layernorm` / `post_mlp_layernorm`)."""
        return False

    interleaved_rope = False  # rope over pairs (x0, x1), (x2, x3)...: GLM-4's, ERNIE 4.5's
    attention_sinks = False  # a learned logit per head in each softmax: gpt-oss's

    def __init__(self, config, max_position: int | None = None) -> None:
        super().__init__()
        self.config = config
        context_len = max_position or config.max_position_embeddings
        max_position = max(max_position or 0, config.max_position_embeddings)
        self.model = LlamaModel(config, max_position, type(self), context_len)
        self.init_head(config, divisor=type(self).multipliers(config)[2])
        # (rows per head, rotated rows) of q/k whose order is changed at load (a LoRA
        # adapter's B rows of q_proj / k_proj too: engine/lora/manager.py)
        self.interleaved_rows: tuple[int, int] | None = None
        if self.interleaved_rope:
            head_dim = self.model.layers[0].self_attn.head_dim
            self.interleaved_rows = head_dim, rotary_dim(head_dim, rope_parameters(config))

    def _map_weight(self, name: str, tensor: torch.Tensor):
        """Interleaved rope (`engine/models/interleaved_rope.py`): each head's rotated rows
        of q_proj / k_proj (and a q/k norm's weight) reordered to the halves the kernels
        rotate."""
        if self.interleaved_rows is not None and name.endswith(_ROPE_ROWS_OF):
            head_dim, rotated = self.interleaved_rows
            tensor = deinterleave(tensor, name, head_dim, 0, rotated)
        return super()._map_weight(name, tensor)


_ROPE_ROWS_OF = tuple(
    f".{proj}.{part}" for proj in ("q_proj", "k_proj", "q_norm", "k_norm")
    for part in ("weight", "bias")
)  # fmt: skip


class MistralForCausalLM(LlamaForCausalLM):
    pass


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """SmolLM3: Llama with no rope on the layers `no_rope_layers` marks 0 (NoPE)."""

    @staticmethod
    def uses_rope(config, layer_id: int) -> bool:
        return bool(config.no_rope_layers[layer_id])


class Ministral3ForCausalLM(MistralForCausalLM):
    """Ministral 3: Mistral with YaRN and a query temperature past the original context."""


class Mistral3ForConditionalGeneration(MistralForCausalLM):
    """A Mistral 3 checkpoint (Mistral Small 3.1 / 3.2, Ministral 3, Magistral, Devstral)
    served for text: its language model (Mistral's or Ministral 3's layers, from
    `config.text_config`), without the vision tower and projector."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = super().load_weights(weights)
        if not self.tie_word_embeddings and "lm_head.weight" not in loaded:
            # a checkpoint saved with the outer config's `tie_word_embeddings` (the text
            # config's says nothing of it): no lm_head of its own, the embedding serves
            self.lm_head.weight = self.model.embed_tokens.weight
            loaded.add("lm_head.weight")
        return loaded

    def _map_weight(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        for prefix, ours in _MISTRAL3_TEXT_PREFIXES:
            if name.startswith(prefix):
                return super()._map_weight(ours + name.removeprefix(prefix), tensor)
        if name.startswith(_MISTRAL3_SKIPPED):
            return None
        return super()._map_weight(name, tensor)  # (lm_head; anything else is reported)


# (checkpoints saved by transformers 4 / by 5) -> ours
_MISTRAL3_TEXT_PREFIXES = (
    ("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
)  # fmt: skip
_MISTRAL3_SKIPPED = (
    "vision_tower.", "multi_modal_projector.",
    "model.vision_tower.", "model.multi_modal_projector.",
)  # fmt: skip


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_biases(config) -> tuple[bool, bool]:
        return True, False


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True


class GraniteForCausalLM(LlamaForCausalLM):
    """IBM Granite 3.x: the Llama layer with four scalars from its config (muP-style)."""

    @staticmethod
    def attention_scale(config, head_dim: int) -> float:
        return float(config.attention_multiplier)

    @staticmethod
    def multipliers(config) -> tuple[float, float, float | None]:
        divisor = float(config.logits_scaling)
        return float(config.embedding_multiplier), float(config.residual_multiplier), divisor


class SeedOssForCausalLM(LlamaForCausalLM):
    """ByteDance Seed-OSS: Llama with its own switches for the q/k/v and o_proj biases."""

    @staticmethod
    def attention_biases(config) -> tuple[bool, bool]:
        return bool(config.attention_bias), bool(getattr(config, "attention_out_bias", False))


class Ernie4_5ForCausalLM(LlamaForCausalLM):  # noqa: N801 - the checkpoints' class name
    """Baidu ERNIE 4.5 dense (ERNIE-4.5-0.3B): Llama with rope over interleaved pairs and one
    `use_bias` switch for every projection."""

    interleaved_rope = True

    @staticmethod
    def attention_biases(config) -> tuple[bool, bool]:
        bias = bool(getattr(config, "use_bias", False))
        return bias, bias

    @staticmethod
    def make_mlp(config, layer_id: int) -> nn.Module:
        return LlamaMLP(config, bias=bool(getattr(config, "use_bias", False)))

"""One implementation for the Llama family: Llama, Mistral, Qwen2 and Qwen3.

The variants differ only in small switches, held as class attributes:
* Qwen2 puts a bias on q/k/v (not on o_proj);
* Qwen3 applies a per-head RMSNorm to q and k before rope, and its `head_dim` may differ
  from hidden_size / num_heads;
* Llama and Qwen3 take `attention_bias` (q/k/v/o) and Llama `mlp_bias` from the config.

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
from engine.layers.logits import LogitsProcessor
from engine.layers.parallel import (
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    kv_heads_per_rank,
)
from engine.layers.rotary import RotaryEmbedding, rope_parameters
from engine.loader import load_named_weights

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
        self.qk_norm = variant.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary = rotary
        self.attn = PagedAttention(
            layer_id,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.head_dim**-0.5,
            sliding_window=layer_sliding_windows(config, config.num_hidden_layers)[layer_id],
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
        qk, stored = self.rotary.rotate_and_store(positions, qk, v, self.attn, forward_batch)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        out = self.attn(q, k, v, forward_batch, kv_stored=stored)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, config, intermediate_size: int | None = None) -> None:
        super().__init__()
        if config.hidden_act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
        full = intermediate_size or config.intermediate_size
        bias, tp = bool(getattr(config, "mlp_bias", False)), current_tp()
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
            hidden = attn.attend(positions, qkv, forward_batch)
        else:
            if residual is None:
                hidden, residual = self.input_layernorm(hidden), hidden
            else:
                hidden, residual = self.input_layernorm(hidden, residual)
            hidden = attn(positions, hidden, forward_batch)
        if self._norm_in_gemv(getattr(mlp, "gate_up_proj", None), hidden):
            gate_up, residual = norm_gemv(hidden, residual, norm, mlp.gate_up_proj)
            return mlp.down(gate_up), residual
        hidden, residual = norm(hidden, residual)
        return mlp(hidden), residual

    def _norm_in_gemv(self, proj: nn.Module | None, hidden: torch.Tensor) -> bool:
        return (
            self.gemv_max_rows > 0
            and type(proj) is MergedLinear
            and gemv_fits(hidden, proj.weight, self.gemv_max_rows)
        )


class LlamaModel(nn.Module):
    def __init__(self, config, max_position: int, variant: type) -> None:
        super().__init__()
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        rotary = RotaryEmbedding(head_dim, max_position, rope_parameters(config))
        tp = current_tp()
        self.embed_tokens = (
            VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp) if tp.size > 1
            else nn.Embedding(config.vocab_size, config.hidden_size)
        )  # fmt: skip
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, rotary, variant) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, forward_batch)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """`forward(input_ids, positions, forward_batch)` -> float32 logits (see LogitsProcessor).

    The backend's `init_forward_metadata(forward_batch)` must have run for this batch.
    """

    qk_norm = False
    supports_tensor_parallel = True  # (engine/layers/parallel.py; its MoE subclasses too)
    stacked_weights = STACKED_WEIGHTS  # (fused, PEFT/HF name, shard): for LoRA too

    @staticmethod
    def attention_biases(config) -> tuple[bool, bool]:
        """(bias on q/k/v, bias on o_proj)."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    @staticmethod
    def make_mlp(config, layer_id: int) -> nn.Module:
        """Layer `layer_id`'s feed-forward block (mixture-of-experts models override it)."""
        return LlamaMLP(config)

    def __init__(self, config, max_position: int | None = None) -> None:
        super().__init__()
        self.config = config
        max_position = max(max_position or 0, config.max_position_embeddings)
        self.model = LlamaModel(config, max_position, type(self))
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        tp = current_tp()
        if self.tie_word_embeddings:
            pass  # the embedding's rows (with tensor parallelism, this rank's part of them)
        elif tp.size > 1:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.logits_processor = LogitsProcessor(config.vocab_size, tp=tp)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        if self.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        hidden = self.model(input_ids, positions, forward_batch)
        return self.logits_processor(hidden, self.lm_head_weight, forward_batch)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_named_weights(
            self, weights, stacked=STACKED_WEIGHTS, transform=self._map_weight
        )

    def _map_weight(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        if "rotary_emb.inv_freq" in name:
            return None  # derived, stored by old checkpoints
        if self.tie_word_embeddings and name.startswith("lm_head."):
            return None  # tied: the embedding is the head
        return name, tensor


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_biases(config) -> tuple[bool, bool]:
        return True, False


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True

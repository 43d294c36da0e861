"""DeepSeek-V2 and DeepSeek-V3 (`DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`: V2-Lite,
V2.5, V3, R1, Moonlight, Kimi K2): multi-head latent attention (MLA) over a latent KV cache,
and DeepSeek's mixture of experts.

**MLA, absorbed** (the DeepSeek-V2 paper's inference form, as SGLang and vLLM run it). Each
token's K/V is one latent vector: `c_kv` (`kv_lora_rank`, 512, after `kv_a_layernorm`) and the
rotated shared key part `k_pe` (`qk_rope_head_dim`, 64). The cache holds `[c_kv, k_pe]` as a
single K/V head of 576 (`ModelConfig.kv_shared`: the pool's V buffer is its K buffer, so a
token costs 576 values a layer instead of 128 heads x (192 + 128)). `kv_b_proj` holds, per
head, the rows that expand `c_kv` to the key's non-rotated part (W_UK, `qk_nope_head_dim`) and
to the value (W_UV, `v_head_dim`). Since `q_nope . (W_UK c) = (W_UK^T q_nope) . c`, each
query head is taken into the latent space first: `[W_UK^T q_nope, q_pe]` (576) against the
cached `[c_kv, k_pe]` is the full model's score, and the attention output over `c_kv` (the
first 512 features of what the single-head attention returns) times W_UV is the head's value
output. Every attention backend runs it as multi-query attention with head size 576 (on CUDA
not flashinfer's kernels, which do not take that size: triton). The softmax scale is
`(qk_nope + qk_rope)^-0.5`, times YaRN's mscale(`mscale_all_dim`)^2 where rope is scaled.

**Rope**: DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ... (V2's complex product,
V3's `rope_interleave`). The rows of the query and latent projections that produce the rope
part are permuted at load to [x0, x2, ...; x1, x3, ...], where the "rotate half" kernels rotate
the same pairs; q and k are permuted alike, so every score is unchanged.

**Experts**: `first_k_dense_replace` dense layers, then DeepSeekMoE: `n_routed_experts` experts
of `moe_intermediate_size` (the fused kernels of engine/layers/moe.py) plus `n_shared_experts`
always-on ones (one MLP of n_shared x that size). Routing in float32 as transformers routes:
V2 softmax top-k (`greedy`, or `group_limited_greedy`: the `topk_group` groups of highest max
first), V3 sigmoid plus `e_score_correction_bias` for the choice only, the groups ranked by
their two best, the chosen sigmoid scores renormalised when `norm_topk_prob`; the weights times
`routed_scaling_factor`.

FP8: DeepSeek-V3's block-FP8 checkpoints load as such, but for kv_b_proj (its weight is read as
a matrix by the absorbed attention: dequantized as it loads); `--quantization fp8` quantizes
every projection but that one. Tensor parallelism splits the heads (the latent cache whole on
every rank) and the experts as for the other MoE models. Not yet: LoRA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import TensorParallel, current_tp
from engine.forward_batch import ForwardBatch
from engine.layers.attention import PagedAttention
from engine.layers.layernorm import RMSNorm
from engine.layers.linear import MergedLinear
from engine.layers.moe import FusedMoE
from engine.layers.parallel import RowParallelLinear, VocabParallelEmbedding
from engine.layers.rotary import RotaryEmbedding, rope_parameters, scale_factor, yarn_mscale
from engine.models.causal_lm import DecoderForCausalLM
from engine.models.interleaved_rope import deinterleave
from engine.models.llama import STACKED_WEIGHTS, LlamaMLP
from engine.models.llama_moe import _MoeWeights

MLP_STACKED = tuple(row for row in STACKED_WEIGHTS if row[0] == ".gate_up_proj.")
HEAD_ROWS = "heads"  # the one shard of a split per-head projection
LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: transformers' default, not the config's


def mla_softmax_scale(config) -> float:
    """(qk_nope + qk_rope)^-0.5, times mscale(factor, mscale_all_dim)^2 under scaled rope."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(config)
    if params["rope_type"] != "default" and params.get("mscale_all_dim"):
        m = yarn_mscale(scale_factor(params), params["mscale_all_dim"])
        scale *= m * m
    return scale


def latent_dim(config) -> int:
    """The cached latent per token: kv_lora_rank + qk_rope_head_dim (576 in the real models)."""
    return config.kv_lora_rank + config.qk_rope_head_dim


class MLAttention(nn.Module):
    """With tensor parallelism (`current_tp()` while built): this rank's query heads, their
    rows of q_b_proj (q_proj) and kv_b_proj, their columns of o_proj (all-reduced); the
    latent projections and the latent cache are whole on every rank, as in SGLang."""

    def __init__(self, config, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hidden, tp = config.hidden_size, current_tp()
        all_heads = config.num_attention_heads
        first, self.num_heads = tp.shard(all_heads, "attention heads")
        heads = self.num_heads
        self.nope, self.rope = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.rank = config.v_head_dim, config.kv_lora_rank
        qk_dim, bias = self.nope + self.rope, bool(getattr(config, "attention_bias", False))
        self.q_lora_rank = config.q_lora_rank
        q_in = self.q_lora_rank or hidden
        if self.q_lora_rank:
            self.q_a_proj = nn.Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = _head_rows(q_in, first, heads, all_heads, qk_dim, tp)
        else:
            self.q_proj = _head_rows(q_in, first, heads, all_heads, qk_dim, tp)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = _head_rows(
            self.rank, first, heads, all_heads, self.nope + self.v_dim, tp
        )
        self.o_proj = (
            RowParallelLinear(all_heads * self.v_dim, hidden, bias, tp) if tp.size > 1
            else nn.Linear(heads * self.v_dim, hidden, bias=bias)
        )  # fmt: skip
        self.rotary = rotary
        scale = mla_softmax_scale(config)
        self.attn = PagedAttention(layer_id, heads, 1, latent_dim(config), scale)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        tokens, heads = hidden.shape[0], self.num_heads
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        else:
            q = self.q_proj(hidden)
        q = q.view(tokens, heads, self.nope + self.rope)
        latent = self.kv_a_proj_with_mqa(hidden)
        c_kv = self.kv_a_layernorm(latent[:, : self.rank].contiguous())
        # q's rope part and the shared key's, rotated as one [tokens, heads + 1, rope] slab
        pe = torch.cat((q[:, :, self.nope :], latent[:, None, self.rank :]), dim=1)
        pe = self.rotary(positions, pe)
        w_kv = self.kv_b_proj.weight.view(heads, self.nope + self.v_dim, self.rank)
        # each head's query in the latent space: W_UK^T q_nope  [heads, tokens, rank]
        q_latent = torch.bmm(q[:, :, : self.nope].transpose(0, 1), w_kv[:, : self.nope])
        query = torch.cat((q_latent.transpose(0, 1), pe[:, :heads]), dim=-1)
        key = torch.cat((c_kv, pe[:, heads]), dim=-1)
        out = self.attn(query, key, key, forward_batch)  # (value = key; its first `rank` used)
        out = out.view(tokens, heads, -1)[:, :, : self.rank]
        # each head's value output: W_UV applied to its attention over c_kv
        value = torch.bmm(out.transpose(0, 1), w_kv[:, self.nope :].transpose(1, 2))
        return self.o_proj(value.transpose(0, 1).reshape(tokens, heads * self.v_dim))


def _head_rows(
    in_features: int, first: int, heads: int, all_heads: int, per_head: int, tp: TensorParallel
) -> nn.Linear:
    """A projection to `per_head` rows a head: with tensor parallelism its rows of this rank's
    heads (one shard, `HEAD_ROWS`, of a MergedLinear taking them from the checkpoint's)."""
    if tp.size == 1:
        return nn.Linear(in_features, heads * per_head, bias=False)
    rows = (first * per_head, heads * per_head, all_heads * per_head)
    return MergedLinear(in_features, [(HEAD_ROWS, heads * per_head)], sources={HEAD_ROWS: rows})


class DeepseekMoE(nn.Module):
    """Router, routed experts and the shared experts of one DeepSeek layer."""

    def __init__(self, config, version: int) -> None:
        super().__init__()
        self.version = version
        num_experts = config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        if not 0 < self.top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be in [1, {num_experts}]")
        self.scaling = float(config.routed_scaling_factor)
        self.num_groups = config.n_group or 1
        self.topk_groups = config.topk_group or self.num_groups
        if num_experts % self.num_groups:
            raise ValueError(f"n_routed_experts={num_experts} not a multiple of n_group")
        self.method = "sigmoid" if version == 3 else getattr(config, "topk_method", "greedy")
        if self.method not in ("greedy", "group_limited_greedy", "sigmoid"):
            raise ValueError(f"topk_method {self.method!r} is not supported")
        scoring = getattr(config, "scoring_func", None) or "sigmoid"
        if version == 3 and scoring != "sigmoid":  # (transformers' V3 always takes sigmoid)
            raise ValueError(f"scoring_func {scoring!r} is not supported for DeepSeek-V3")
        self.renormalize = version == 3 and bool(getattr(config, "norm_topk_prob", True))
        self.gate = nn.Linear(config.hidden_size, num_experts, bias=False)
        if version == 3:
            self.gate.e_score_correction_bias = nn.Parameter(
                torch.zeros(num_experts), requires_grad=False
            )
        self.experts = FusedMoE(num_experts, config.hidden_size, config.moe_intermediate_size)
        shared = config.n_shared_experts or 0
        self.shared_experts = (
            LlamaMLP(config, config.moe_intermediate_size * shared) if shared else None
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, expert ids [T, k])."""
        logits = F.linear(x.float(), self.gate.weight.float())
        groups = self.num_groups
        if self.method == "sigmoid":
            scores = logits.sigmoid()
            choice = scores + self.gate.e_score_correction_bias.float()
            group_scores = choice.view(len(x), groups, -1).topk(2, dim=-1)[0].sum(dim=-1)
        else:
            scores = choice = logits.softmax(dim=-1)
            group_scores = choice.view(len(x), groups, -1).amax(dim=-1)
        if self.method != "greedy" and self.topk_groups < groups:
            chosen = group_scores.topk(self.topk_groups, dim=-1)[1]
            keep = torch.zeros_like(group_scores).scatter_(1, chosen, 1.0).bool()
            keep = keep.repeat_interleave(choice.shape[1] // groups, dim=1)
            # (transformers: -inf for V3's choice, 0 for V2's probabilities)
            choice = choice.masked_fill(~keep, float("-inf") if self.method == "sigmoid" else 0.0)
        ids = choice.topk(self.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int, rotary: RotaryEmbedding, version: int) -> None:
        super().__init__()
        self.self_attn = MLAttention(config, layer_id, rotary)
        dense = layer_id < config.first_k_dense_replace or not config.n_routed_experts
        self.mlp = LlamaMLP(config) if dense else DeepseekMoE(config, version)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        forward_batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, forward_batch)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DeepseekModel(nn.Module):
    def __init__(self, config, max_position: int, context_len: int, version: int) -> None:
        super().__init__()
        rotary = RotaryEmbedding(
            config.qk_rope_head_dim, max_position, rope_parameters(config), context_len=context_len
        )
        tp = current_tp()
        self.embed_tokens = (
            VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp) if tp.size > 1
            else nn.Embedding(config.vocab_size, config.hidden_size)
        )  # fmt: skip
        self.layers = nn.ModuleList(
            DeepseekDecoderLayer(config, i, rotary, version)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # EAGLE-3 speculation: the layers whose input residual stream is kept for the draft
        # head (engine/speculative/eagle.py; None without), as LlamaModel's
        self.aux_capture = None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
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


class DeepseekV2ForCausalLM(_MoeWeights, DecoderForCausalLM):
    version = 2
    supports_tensor_parallel = True
    load_stacked = MLP_STACKED
    # (`--quantization fp8`: kv_b_proj's weight is read as a matrix by the absorbed attention)
    unquantized_linears = ("kv_b_proj",)
    # (an adapter of q_proj would add to rows reordered at load; kv_b_proj is read as a
    # matrix by the absorbed attention; the experts are fused)
    lora_unsupported = "multi-head latent attention has no LoRA support yet"

    def __init__(self, config, max_position: int | None = None) -> None:
        super().__init__()
        self.config = config
        context_len = max_position or config.max_position_embeddings
        max_position = max(max_position or 0, config.max_position_embeddings)
        self.model = DeepseekModel(config, max_position, context_len, self.version)
        self.init_head(config)
        self.split_heads = current_tp().size > 1  # (the per-head projections load as `_head_rows`)
        self._rope_rows = self._interleaved_rope_rows()

    def _interleaved_rope_rows(self) -> dict[str, tuple[int, int, int]] | None:
        """Projection name -> (rows per block, the rope part's first row in a block, its
        size): the rows whose order `_map_weight` changes; None where rope is not interleaved
        (a V3 config with `rope_interleave` false)."""
        config = self.config
        if self.version == 3 and not getattr(config, "rope_interleave", True):
            return None
        nope, rope, rank = config.qk_nope_head_dim, config.qk_rope_head_dim, config.kv_lora_rank
        q_name = ".q_b_proj." if config.q_lora_rank else ".q_proj."
        latent = ".kv_a_proj_with_mqa."
        return {q_name: (nope + rope, nope, rope), latent: (rank + rope, rank, rope)}

    def _map_weight(self, name: str, tensor: torch.Tensor):
        """The rope rows reordered; the experts stacked (`_MoeWeights`); with tensor
        parallelism, the per-head projections as their one shard (`_head_rows`)."""
        rows = self._rope_rows or {}
        part = next((key for key in rows if key in name), None)
        if part is not None and name.endswith((".weight", ".bias")):
            tensor = deinterleave(tensor, name, *rows[part])
        mapped = super()._map_weight(name, tensor)
        if mapped is not None and len(mapped) == 2 and self.split_heads:
            if mapped[0].rsplit(".", 1)[0].endswith(_HEAD_PROJECTIONS):
                return (*mapped, HEAD_ROWS)
        return mapped


_HEAD_PROJECTIONS = (".q_proj", ".q_b_proj", ".kv_b_proj")


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    version = 3

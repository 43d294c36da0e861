"""The small random configs of every decoder architecture the float64 parity tests check
against transformers (tests/unit/test_models.py), by case name: a shape small enough for
float64 on a CPU, and each config's variant switched on (sliding windows, rope types, routing
methods, norms, biases)."""

from __future__ import annotations

import transformers

VOCAB = 512
LLAMA_SHAPE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=256,
    initializer_range=0.3,
)
# (Phi3Config's and DeepSeek's default special ids are past this vocabulary)
PHI3_IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
ARCH_CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**LLAMA_SHAPE),
    "llama-rope-llama3": lambda: transformers.LlamaConfig(
        **LLAMA_SHAPE,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=16,
        ),
    ),
    "llama-rope-linear": lambda: transformers.LlamaConfig(
        **LLAMA_SHAPE, rope_scaling=dict(rope_type="linear", factor=2.0), rope_theta=500.0
    ),
    "mistral": lambda: transformers.MistralConfig(**LLAMA_SHAPE, sliding_window=None),
    "qwen2": lambda: transformers.Qwen2Config(**LLAMA_SHAPE, tie_word_embeddings=True),
    # every layer sees its last 5 keys only (the prompts are 6-14 tokens, then 4 decodes)
    "mistral-sliding": lambda: transformers.MistralConfig(**LLAMA_SHAPE, sliding_window=5),
    # layer 0 full, layer 1 windowed (max_window_layers=1)
    "qwen2-sliding": lambda: transformers.Qwen2Config(
        **LLAMA_SHAPE, use_sliding_window=True, sliding_window=5, max_window_layers=1
    ),
    "qwen3": lambda: transformers.Qwen3Config(**LLAMA_SHAPE, head_dim=24),
    "mixtral": lambda: transformers.MixtralConfig(
        **LLAMA_SHAPE, num_local_experts=4, num_experts_per_tok=2, sliding_window=None
    ),
    # layer 1 of 3 is dense (mlp_only_layers); shared expert; top-k weights not renormalised
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **{**LLAMA_SHAPE, "num_hidden_layers": 3},
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=80,
        mlp_only_layers=[1],
    ),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **LLAMA_SHAPE,
        head_dim=24,
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=40,
        norm_topk_prob=True,
    ),
    # layer 0 windowed (rope base 10k), layer 1 full (base 1M, linear scaling); GeGLU, 4 norms
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **{**LLAMA_SHAPE, "num_attention_heads": 4, "num_key_value_heads": 1},
        head_dim=32,
        query_pre_attn_scalar=24,
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 4.0},
        },
    ),
    # a multimodal Gemma 3 checkpoint (gemma-3-4b and up) served as its text model: the vision
    # tower and projector are saved beside it and skipped by the loader
    "gemma3-multimodal": lambda: transformers.Gemma3Config(
        text_config=ARCH_CONFIGS["gemma3"]().to_dict(),
        vision_config=transformers.SiglipVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            image_size=28, patch_size=14,
        ).to_dict(),
        mm_tokens_per_image=4, boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2,
        image_token_index=VOCAB - 1,
    ),  # fmt: skip
    # Gemma 2: layer 0 windowed, layer 1 full, one rope; attention scores soft-capped at 4 and
    # the final logits at 6 (the real 50 / 30 barely bend this model's scores)
    "gemma2": lambda: transformers.Gemma2Config(
        **{**LLAMA_SHAPE, "num_attention_heads": 4, "num_key_value_heads": 2},
        head_dim=32,
        query_pre_attn_scalar=24,
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention"],
        attn_logit_softcapping=4.0,
        final_logit_softcapping=6.0,
    ),
    # Phi-4-mini's layout: fused qkv_proj / gate_up_proj tensors, 3/4 of each head rotated,
    # tied embeddings
    "phi3": lambda: transformers.Phi3Config(
        **LLAMA_SHAPE, **PHI3_IDS, partial_rotary_factor=0.75, tie_word_embeddings=True
    ),
    # LongRoPE, short factors (the context, 64, is not past the original 64 positions) and
    # the attention factor of an explicit `factor` 4
    "phi3-longrope-short": lambda: transformers.Phi3Config(
        **{**LLAMA_SHAPE, "max_position_embeddings": 64}, **PHI3_IDS,
        original_max_position_embeddings=64,
        rope_scaling=dict(
            rope_type="longrope", factor=4.0,
            short_factor=[1.0 + 0.3 * i for i in range(8)],
            long_factor=[2.0 + 2.5 * i for i in range(8)],
        ),
    ),  # fmt: skip
    # LongRoPE, long factors (every sequence is past the original 8 positions, so
    # transformers takes them too), half of each head rotated, every layer windowed at 5
    "phi3-longrope-long": lambda: transformers.Phi3Config(
        **LLAMA_SHAPE,
        **PHI3_IDS,
        original_max_position_embeddings=8,
        partial_rotary_factor=0.5,
        sliding_window=5,
        rope_scaling=dict(
            rope_type="longrope",
            short_factor=[1.0 + 0.3 * i for i in range(4)],
            long_factor=[2.0 + 2.5 * i for i in range(4)],
        ),
    ),
    # Granite 3.x: its four multipliers (granite-3.3-8b's, attention's 1 / head_dim)
    "granite": lambda: transformers.GraniteConfig(
        **LLAMA_SHAPE, embedding_multiplier=12.0, residual_multiplier=0.22,
        attention_multiplier=1 / 16, logits_scaling=4.0, tie_word_embeddings=True,
    ),  # fmt: skip
    # Qwen3 with YaRN over 4x its original 32 positions
    "qwen3-yarn": lambda: transformers.Qwen3Config(
        **LLAMA_SHAPE, head_dim=24,
        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32),
    ),  # fmt: skip
    # DeepSeek-V3 (MLA with a query LoRA; rope interleaved; YaRN with mscale on the scores;
    # a dense first layer, then 8 experts in 4 groups, 2 groups and 2 experts chosen by
    # sigmoid + correction bias, one shared expert)
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **{**LLAMA_SHAPE, "num_hidden_layers": 3, "num_key_value_heads": 4},
        moe_intermediate_size=32,
        n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
        first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=12, routed_scaling_factor=2.5,
        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64,
                          mscale=0.707, mscale_all_dim=0.707, beta_fast=32, beta_slow=1),
        **PHI3_IDS,
    ),  # fmt: skip
    # ... with rope on its halves, not interleaved pairs (`rope_interleave` false: no reorder)
    "deepseek_v3-halves": lambda: transformers.DeepseekV3Config(
        **{**ARCH_CONFIGS["deepseek_v3"]().to_dict(), "rope_interleave": False}
    ),
    # DeepSeek-V2-Lite's layout: no query LoRA, softmax top-k over all experts, 2 shared
    "deepseek_v2": lambda: transformers.DeepseekV2Config(
        **{**LLAMA_SHAPE, "num_key_value_heads": 4}, moe_intermediate_size=32,
        n_shared_experts=2, n_routed_experts=6, num_experts_per_tok=2, first_k_dense_replace=1,
        kv_lora_rank=32, q_lora_rank=None,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, topk_method="greedy",
        **PHI3_IDS,
    ),  # fmt: skip
    # DeepSeek-V2's group-limited routing (3 groups of 2 experts, the best 2 groups)
    "deepseek_v2-groups": lambda: transformers.DeepseekV2Config(
        **{**LLAMA_SHAPE, "num_key_value_heads": 4}, moe_intermediate_size=32,
        n_shared_experts=1, n_routed_experts=6, num_experts_per_tok=2, first_k_dense_replace=0,
        kv_lora_rank=32, q_lora_rank=40,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
        topk_method="group_limited_greedy", n_group=3, topk_group=2,
        routed_scaling_factor=16.0, **PHI3_IDS,
    ),  # fmt: skip
    # GLM-4.5: q/k/v bias, rope on half of each head; a dense first layer, then DeepSeek-V3's
    # routing (8 experts in 2 groups, the best group, 2 experts; a shared one); MTP layer
    # declared (its weights are skipped at load)
    "glm4_moe": lambda: transformers.Glm4MoeConfig(
        **{**LLAMA_SHAPE, "num_hidden_layers": 3}, head_dim=24, attention_bias=True,
        moe_intermediate_size=32, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
        n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
        num_nextn_predict_layers=1, **PHI3_IDS,
    ),  # fmt: skip
    # ... GLM-4.5's q/k norms (`use_qk_norm`) and rope on a third of each head
    "glm4_moe-qk-norm": lambda: transformers.Glm4MoeConfig(
        **{**ARCH_CONFIGS["glm4_moe"]().to_dict(), "use_qk_norm": True,
           "rope_parameters": dict(rope_type="default", rope_theta=1e4,
                                   partial_rotary_factor=1 / 3)}
    ),  # fmt: skip
    # GLM-4 dense: interleaved rope on half of each head, sandwich norms, q/k/v bias, gate
    # and up fused in the checkpoint
    "glm4": lambda: transformers.Glm4Config(
        **LLAMA_SHAPE, head_dim=24, attention_bias=True, **PHI3_IDS
    ),
    # ERNIE 4.5: interleaved rope over the whole head; a bias on every projection (`use_bias`)
    "ernie4_5": lambda: transformers.Ernie4_5Config(**LLAMA_SHAPE, use_bias=True, **PHI3_IDS),
    # ERNIE 4.5 MoE: a dense first layer, then 6 experts (2 chosen by softmax + correction
    # bias, renormalised) and a shared expert on every layer from 1
    "ernie4_5_moe": lambda: transformers.Ernie4_5_MoeConfig(
        **{**LLAMA_SHAPE, "num_hidden_layers": 3}, moe_intermediate_size=32, moe_num_experts=6,
        moe_k=2, moe_num_shared_experts=1, moe_layer_start_index=1, **PHI3_IDS,
    ),  # fmt: skip
    # Seed-OSS: q/k/v bias, none on o_proj (`attention_out_bias`)
    "seed_oss": lambda: transformers.SeedOssConfig(
        **LLAMA_SHAPE, head_dim=24, attention_bias=True, attention_out_bias=False, **PHI3_IDS
    ),
    # OLMo 2: norms after each block, q/k normalised over the whole projection
    "olmo2": lambda: transformers.Olmo2Config(**LLAMA_SHAPE, **PHI3_IDS),
    # OLMo 3: layer 0 windowed at 5, layer 1 full
    "olmo3": lambda: transformers.Olmo3Config(
        **LLAMA_SHAPE, **PHI3_IDS, sliding_window=5,
        layer_types=["sliding_attention", "full_attention"],
    ),  # fmt: skip
    # SmolLM3: no rope on layer 1 of 2 (every second here, every fourth in SmolLM3-3B)
    "smollm3": lambda: transformers.SmolLM3Config(
        **LLAMA_SHAPE, no_rope_layer_interval=2, **PHI3_IDS
    ),
    # ... with a window of 5 on its NoPE layer (`use_sliding_window`)
    "smollm3-sliding": lambda: transformers.SmolLM3Config(
        **LLAMA_SHAPE, no_rope_layer_interval=2, use_sliding_window=True, sliding_window=5,
        **PHI3_IDS,
    ),  # fmt: skip
    # Ministral 3: YaRN, and the query temperature from position 8 (its original 16384)
    "ministral3": lambda: transformers.Ministral3Config(
        **LLAMA_SHAPE, sliding_window=None,
        rope_parameters=dict(rope_type="yarn", rope_theta=1e6, factor=16.0,
                             original_max_position_embeddings=8, llama_4_scaling_beta=0.1,
                             beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        **PHI3_IDS,
    ),  # fmt: skip
    # a Mistral 3 checkpoint (Mistral Small 3.1) served as its text model: the Pixtral tower
    # and the projector are saved beside it and skipped by the loader
    "mistral3-multimodal": lambda: transformers.Mistral3Config(
        text_config=transformers.MistralConfig(**LLAMA_SHAPE, sliding_window=None).to_dict(),
        vision_config=transformers.PixtralVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            image_size=28, patch_size=14,
        ).to_dict(),
        image_token_index=VOCAB - 1, tie_word_embeddings=False,
    ),  # fmt: skip
    # ... saved tied by the outer config (no lm_head in the checkpoint; the text config says
    # nothing of it)
    "mistral3-multimodal-tied": lambda: transformers.Mistral3Config(
        **{**ARCH_CONFIGS["mistral3-multimodal"]().to_dict(), "tie_word_embeddings": True}
    ),
    # gpt-oss: attention sinks, q/k/v/o biases, layer 0 windowed (5 keys) and layer 1 full,
    # YaRN past 16 positions (not truncated), 4 experts (top 2) with clamped SwiGLU and biases
    "gpt_oss": lambda: transformers.GptOssConfig(
        **{**LLAMA_SHAPE, "num_hidden_layers": 2}, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=5, swiglu_limit=1.5,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, beta_fast=32.0,
                             beta_slow=1.0, truncate=False, original_max_position_embeddings=16),
        **PHI3_IDS,
    ),  # fmt: skip
    "gpt2": lambda: transformers.GPT2Config(
        n_embd=64,
        n_layer=2,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=256,
        initializer_range=0.3,
        bos_token_id=0,
        eos_token_id=1,
    ),
}

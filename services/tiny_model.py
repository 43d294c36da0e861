"""``sluice make-tiny-model``: small random models with a locally trained tokenizer.

Nothing can be downloaded, so tests and benchmarks use random weights saved as real Hugging Face
folders (config.json, model.safetensors, generation_config.json, tokenizer.json,
tokenizer_config.json, chat_template.jinja) that transformers and sluice both load.

The tokenizers (two families, trained on a fixed synthetic corpus, with a ChatML chat template)
are built in ``services.tiny_tokenizer``; special token ids in config.json come from there.
generation_config.json stops on eos and ``<|im_end|>``. Encoders (bert, xlm-roberta: embedding
models and cross-encoders) are built in ``services.tiny_encoder``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PretrainedConfig

# build_tokenizer is also imported from here (this module's public API before the split).
from services import tiny_draft, tiny_encoder, tiny_fp8, tiny_int_weight
from services.tiny_classifier import to_classifier
from services.tiny_tokenizer import SpecialTokens, build_tokenizer

MOE_ARCHS = (
    "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "glm4_moe", "gpt_oss",
)  # fmt: skip
GEMMA_ARCHS = ("gemma2", "gemma3_text")
ARCHS = (
    "llama", "mistral", "qwen2", "qwen3", "phi3", "granite", "smollm3", "olmo2", "glm4", "gpt2",
    *GEMMA_ARCHS, *MOE_ARCHS,
)  # fmt: skip

# --- Model ----------------------------------------------------------------------------------------

# architectures without a sliding window setting here (SmolLM3's applies to its NoPE layers
# only, with `use_sliding_window`)
_UNWINDOWED = (
    "llama", "granite", "gpt2", "deepseek_v2", "deepseek_v3", "glm4", "glm4_moe", "olmo2",
    "smollm3",
)  # fmt: skip

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LOGIT_SCALE = 8.0  # standard deviation of the logits
EMBED_SCALE = 0.25  # input embeddings relative to a unit-gain layer's output
NORM_JITTER = 0.2  # norm weights are uniform in 1 +- NORM_JITTER
QK_SCALE = 2.0  # queries and keys are scaled by this: sharper attention
# the local window of gemma-2-2b and of gemma-3-1b (the tiny preset uses 32)
GEMMA_WINDOWS = {"gemma2": 4096, "gemma3_text": 512}
GRANITE_LOGITS_SCALING = 16.0  # granite-3.3-8b's (the logits are divided by it)
QK_BIAS_STD = 0.5  # query / key projection biases (qwen2)
BIAS_STD = 0.02  # other biases: they add the same vector at every position, so keep them small
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """Architecture-independent sizes; ``head_dim`` None means hidden_size // num_heads."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    head_dim: int | None = None
    # mixture-of-experts archs only: experts per sparse layer, experts per token, and each
    # expert's intermediate size (None: intermediate_size // 4; Mixtral's experts always
    # have intermediate_size)
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int | None = None
    # every layer attends to its last `sliding_window` keys (Mistral v0.1 style; Qwen2-MoE's
    # config windows the even layers), for all archs but llama and gpt2; None: whole context
    sliding_window: int | None = None


_SIZE_KEYS = tuple(f.name for f in dataclasses.fields(ModelShape))
_MOE_KEYS = {"num_experts", "num_experts_per_tok", "moe_intermediate_size"}
# preset -> (shape, its own architecture, other transformers config fields)
PRESETS: dict[str, tuple[ModelShape, str, dict[str, Any]]] = {
    "tiny": (ModelShape(64, 2, 4, 2, 176, 1536, 2048), "llama", {}),
    "small": (ModelShape(1024, 8, 16, 4, 2816, 32000, 4096), "llama", {}),
    "gpt2-124m": (ModelShape(768, 12, 12, 12, 3072, 50257, 1024), "gpt2", {}),
    "llama-3.2-1b": (
        ModelShape(2048, 16, 32, 8, 8192, 128256, 131072, head_dim=64),
        "llama",
        {"tie_word_embeddings": True, "rope_parameters": _LLAMA3_ROPE, "rms_norm_eps": 1e-5},
    ),
}
# The tiny Qwen models tie their embeddings like Qwen2-0.5B / Qwen3-0.6B, and qwen3's head_dim
# is not hidden_size / num_heads, as in real Qwen3 models.
_TINY_TWEAKS: dict[str, dict[str, Any]] = {
    "qwen2": {"tie_word_embeddings": True},
    "qwen3": {"tie_word_embeddings": True, "head_dim": 32},
    "qwen3_moe": {"head_dim": 32},
    # Phi-4-mini's: 3/4 of each head rotated, tied embeddings (fused qkv / gate_up tensors
    # are Phi-3's checkpoint layout)
    "phi3": {"partial_rotary_factor": 0.75, "tie_word_embeddings": True},
    # SmolLM3-3B leaves rope out of every fourth layer; of the second here (two layers)
    "smollm3": {"no_rope_layer_interval": 2},
    # GLM-4's and GLM-4.5's attention: q/k/v bias, rope on half of each head (GLM-4's over
    # interleaved pairs)
    "glm4": {"attention_bias": True, "partial_rotary_factor": 0.5},
    "glm4_moe": {"attention_bias": True, "partial_rotary_factor": 0.5},
    # Gemma 2 and 3 always window their local layers (gemma-3-1b: 512 keys)
    "gemma2": {"sliding_window": 32},
    "gpt_oss": {"sliding_window": 32},
    "gemma3_text": {"sliding_window": 32},
}


def build_config(
    arch: str | None = None, preset: str = "tiny", **overrides: Any
) -> PretrainedConfig:
    """The transformers config of ``preset`` for ``arch`` (default: the preset's own arch).

    ``overrides`` are ModelShape sizes (hidden_size, num_layers, num_heads, num_kv_heads,
    intermediate_size, vocab_size, max_position_embeddings, head_dim; None = preset's) or any
    other transformers config field (e.g. ``tie_word_embeddings``). Special token ids are those
    of ``arch``'s tokenizer family.
    """
    base, own_arch, preset_fields = PRESETS[preset]
    arch = arch or own_arch
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {ARCHS}")
    explicit = {k: v for k, v in overrides.items() if v is not None}
    fields = {**preset_fields, **(_TINY_TWEAKS.get(arch, {}) if preset == "tiny" else {})}
    fields.update(explicit)
    sizes = {k: fields.pop(k) for k in _SIZE_KEYS if k in fields}
    shape = dataclasses.replace(base, **sizes)
    special = SpecialTokens.for_arch(arch)
    fields.update(
        vocab_size=shape.vocab_size,
        initializer_range=shape.hidden_size**-0.5,
        bos_token_id=special.id_of(special.bos),
        eos_token_id=special.id_of(special.eos),
        pad_token_id=special.id_of(special.pad),
    )
    arch_fields = _gpt2_fields(shape, explicit) if arch == "gpt2" else _rope_fields(arch, shape)
    if arch == "granite":
        arch_fields.update(_granite_fields(shape))
    if arch in MOE_ARCHS:
        arch_fields.update(_moe_fields(arch, shape))
    elif _MOE_KEYS & explicit.keys():
        raise ValueError(f"{arch} has no experts; the expert sizes are for {MOE_ARCHS}")
    if shape.sliding_window is not None and arch in _UNWINDOWED:
        raise ValueError(f"{arch} has no sliding window attention")
    # an explicit config field (e.g. Gemma's `layer_types`) wins over the arch's default
    arch_fields = {k: v for k, v in arch_fields.items() if k not in fields}
    return AutoConfig.for_model(arch, **arch_fields, **fields)


def _rope_fields(arch: str, shape: ModelShape) -> dict[str, Any]:
    fields = {
        "hidden_size": shape.hidden_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "intermediate_size": shape.intermediate_size,
        "max_position_embeddings": shape.max_position_embeddings,
        "head_dim": shape.head_dim or shape.hidden_size // shape.num_heads,
    }
    if arch not in _UNWINDOWED:
        fields["sliding_window"] = shape.sliding_window
    if arch in ("deepseek_v2", "deepseek_v3"):
        fields.update(_mla_fields(shape, query_lora=arch == "deepseek_v3"))
    if arch in GEMMA_ARCHS:
        # local (windowed) and global layers alternate, so that a 2-layer model has both
        # (Gemma 2 alternates too, Gemma 3 has five local layers per global one); always a
        # window. Gemma 2 keeps its config's soft caps (attention 50, final logits 30).
        fields["sliding_window"] = shape.sliding_window or GEMMA_WINDOWS[arch]
        fields["layer_types"] = [
            "full_attention" if i % 2 else "sliding_attention" for i in range(shape.num_layers)
        ]
        fields["query_pre_attn_scalar"] = fields["head_dim"]
    if arch == "gpt_oss":  # windowed and full layers alternate (gpt-oss's window: 128)
        fields["sliding_window"] = shape.sliding_window or 128
        fields["layer_types"] = [
            "full_attention" if i % 2 else "sliding_attention" for i in range(shape.num_layers)
        ]
    if shape.sliding_window is not None and arch.startswith("qwen"):
        # Qwen configs window the layers from max_window_layers on (Qwen2-MoE: the even ones
        # below it)
        layers = 0 if arch in ("qwen2", "qwen3") else shape.num_layers
        fields.update(use_sliding_window=True, max_window_layers=layers)
    return fields


def _granite_fields(shape: ModelShape) -> dict[str, Any]:
    """granite-3.3-8b's multipliers (its attention's is 1 / head_dim, 1/128 there) and tied
    embeddings."""
    head_dim = shape.head_dim or shape.hidden_size // shape.num_heads
    return {
        "embedding_multiplier": 12.0,
        "residual_multiplier": 0.22,
        "attention_multiplier": 1.0 / head_dim,
        "logits_scaling": GRANITE_LOGITS_SCALING,
        "tie_word_embeddings": True,
    }


def _mla_fields(shape: ModelShape, query_lora: bool) -> dict[str, Any]:
    """DeepSeek-V3's attention at a small scale: a query LoRA, a latent of half the hidden
    size, rope on head_dim features of each query head and twice that without rope, values
    of twice head_dim (at the small preset, head_dim 64: V3's 512 latent, 64 + 128 query
    features and 128 value ones), every head reading the one latent. Without `query_lora`
    (DeepSeek-V2-Lite's layout) the query is one projection."""
    head = shape.head_dim or shape.hidden_size // shape.num_heads
    return {
        "num_key_value_heads": shape.num_heads,
        "head_dim": head,
        "q_lora_rank": shape.hidden_size * 3 // 4 if query_lora else None,
        "kv_lora_rank": shape.hidden_size // 2,
        "qk_rope_head_dim": head,
        "qk_nope_head_dim": head * 2,
        "v_head_dim": head * 2,
    }


def _moe_fields(arch: str, shape: ModelShape) -> dict[str, Any]:
    """Every layer sparse; Qwen3-MoE renormalises its top-k weights (as Qwen3-30B-A3B does),
    Qwen2-MoE does not and adds a shared expert of intermediate_size (as Qwen1.5-MoE)."""
    if arch == "mixtral":
        return {
            "num_local_experts": shape.num_experts,
            "num_experts_per_tok": shape.num_experts_per_tok,
        }
    if arch == "gpt_oss":  # its experts' size is `intermediate_size`
        return {
            "num_local_experts": shape.num_experts,
            "num_experts_per_tok": shape.num_experts_per_tok,
            "intermediate_size": shape.moe_intermediate_size or shape.intermediate_size,
        }
    # (a multiple of 16, as V3's 2048 is of its 128-row FP8 blocks)
    deepseek_moe_size = shape.moe_intermediate_size or -(-shape.intermediate_size // 64) * 16
    if arch == "deepseek_v2":  # V2-Lite's routing: softmax top-k, two shared experts
        return {
            "n_routed_experts": shape.num_experts,
            "num_experts_per_tok": shape.num_experts_per_tok,
            "moe_intermediate_size": deepseek_moe_size,
            "n_shared_experts": 2,
            "topk_method": "greedy",
            "first_k_dense_replace": 1,
            "routed_scaling_factor": 1.0,
        }
    if arch == "glm4_moe":  # GLM-4.5's: V3's routing in one group, a shared expert
        return {
            "n_routed_experts": shape.num_experts,
            "num_experts_per_tok": shape.num_experts_per_tok,
            "moe_intermediate_size": deepseek_moe_size,
            "n_shared_experts": 1,
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
        }
    if arch == "deepseek_v3":  # V3's routing: 4 groups (8 there), the best 2 (4 there)
        groups = 4 if shape.num_experts % 4 == 0 else 1
        return {
            "n_routed_experts": shape.num_experts,
            "num_experts_per_tok": shape.num_experts_per_tok,
            "moe_intermediate_size": deepseek_moe_size,
            "n_shared_experts": 1,
            "n_group": groups,
            "topk_group": max(groups // 2, 1),
            "first_k_dense_replace": 1,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
        }
    fields = {
        "num_experts": shape.num_experts,
        "num_experts_per_tok": shape.num_experts_per_tok,
        "moe_intermediate_size": shape.moe_intermediate_size or shape.intermediate_size // 4,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": arch == "qwen3_moe",
    }
    if arch == "qwen2_moe":
        fields["shared_expert_intermediate_size"] = shape.intermediate_size
    return fields


def _gpt2_fields(shape: ModelShape, explicit: dict[str, Any]) -> dict[str, Any]:
    """GPT-2 has no GQA and no free head_dim; its MLP is 4 x hidden unless asked otherwise."""
    if {"num_kv_heads", "head_dim"} & explicit.keys():
        raise ValueError("gpt2 has no num_kv_heads or head_dim setting")
    return {
        "n_embd": shape.hidden_size,
        "n_layer": shape.num_layers,
        "n_head": shape.num_heads,
        "n_inner": explicit.get("intermediate_size"),
        "n_positions": shape.max_position_embeddings,
    }


def make_tiny_model(
    out_dir: str | os.PathLike[str],
    arch: str | None = None,
    preset: str = "tiny",
    seed: int = 0,
    dtype: str = "float32",
    num_labels: int | None = None,
    pooling: str = "cls",
    qk_scale: float = QK_SCALE,
    **size_overrides: Any,
) -> str:
    """Write a random ``arch`` model of ``preset``'s shape, with its tokenizer, to ``out_dir``.

    ``arch`` defaults to the preset's own (llama for tiny / small); ``size_overrides`` are as
    for ``build_config``. The same arguments give the same weights (the torch seed is set
    first) and the same tokenizer (trained on a fixed corpus). Returns ``out_dir``.
    ``pooling`` ("cls" or "mean") is for encoder embedding models only. ``qk_scale``: the
    factor on queries and keys (see `_shape_weights`; 1 leaves transformers' init).
    """
    if arch in tiny_encoder.ENCODER_ARCHS:
        tiny_encoder.check_encoder_options(dtype, size_overrides)
        if qk_scale != QK_SCALE:
            raise ValueError(f"--qk-scale is for decoder models, not {arch}")
        return tiny_encoder.make_tiny_encoder(out_dir, arch, preset, seed, num_labels, pooling)
    out_dir = os.fspath(out_dir)
    config = build_config(arch, preset, **size_overrides)
    with torch.random.fork_rng(devices=[]):  # leave the caller's random state alone
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])
        _shape_weights(model, qk_scale)
        if num_labels is not None:
            model = to_classifier(model, config, num_labels, LOGIT_SCALE)
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in os.listdir(out_dir):  # written through a 0600 temporary file
        os.chmod(os.path.join(out_dir, name), 0o644)
    max_len = getattr(config, "max_position_embeddings", None) or config.n_positions
    build_tokenizer(config.model_type, config.vocab_size, max_len).save_pretrained(out_dir)
    special = SpecialTokens.for_arch(config.model_type)
    GenerationConfig(
        bos_token_id=special.id_of(special.bos),
        eos_token_id=[special.id_of(special.eos), special.id_of(special.im_end)],
        pad_token_id=special.id_of(special.pad),
    ).save_pretrained(out_dir)
    return out_dir


def _shape_weights(model: torch.nn.Module, qk_scale: float = QK_SCALE) -> None:
    """Make transformers' random init useful for tests (the values are measured, see tests).

    * Random norm weights and biases: transformers sets them to 1 and 0, so an engine that
      forgot them would still match it.
    * Sharper attention (queries and keys x `qk_scale`, default QK_SCALE) and small input
      embeddings: with diffuse attention the hidden state barely changes from one position to
      the next and greedy decoding repeats a token; the layers see the embeddings through a
      norm anyway. Sharper attention also makes the model more sensitive to rounding: at the
      bf16 parity shape transformers' own bf16 agrees with its float32 on 0.83 of positions
      with 2, 0.96 with 1 (benchmarks/bf16_noise.py).
    * Logits with a standard deviation of about LOGIT_SCALE (final norm weight), so the top-1 /
      top-2 gap is wide and greedy tokens do not flip on float rounding.
    """
    decoder = model.get_decoder()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.bias", "k_proj.bias")):
                param.normal_(0.0, QK_BIAS_STD)
            elif name.endswith((".bias", "_proj_bias")):  # (gpt-oss's experts': *_proj_bias)
                param.normal_(0.0, BIAS_STD)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # (DeepSeek-V3's, for the choice)
                buffer.normal_(0.0, 0.1)
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm) or type(module).__name__.endswith("RMSNorm"):
                module.weight.uniform_(1.0 - NORM_JITTER, 1.0 + NORM_JITTER)
                module.weight.sub_(_gain_offset(module))
        latent_keys = model.config.model_type in ("deepseek_v2", "deepseek_v3")
        for name, module in model.named_modules():
            if latent_keys and name.endswith(("q_proj", "q_b_proj")):
                module.weight.mul_(qk_scale**2)  # DeepSeek's query (its keys are latents)
            elif name.endswith(("q_proj", "k_proj", "q_norm", "k_norm")):
                _scale_gain(module, qk_scale)
            elif name.endswith("c_attn"):  # GPT-2's fused [q | k | v] columns
                module.weight[:, : 2 * module.weight.shape[0]].mul_(qk_scale)
            elif name.endswith("qkv_proj"):  # Phi-3's fused [q; k; v] rows
                module.weight[: _qk_rows(model.config)].mul_(qk_scale)
        for embedding in (model.get_input_embeddings(), getattr(decoder, "wpe", None)):
            if embedding is not None:
                embedding.weight.mul_(EMBED_SCALE)
        _undo_multipliers(model)
        row_norm = model.get_output_embeddings().weight.float().norm(dim=1).mean().item()
        final_norm = decoder.ln_f if hasattr(decoder, "ln_f") else decoder.norm
        divisor = getattr(model.config, "logits_scaling", 1.0)  # (Granite's)
        _scale_gain(final_norm, LOGIT_SCALE * divisor / row_norm)


def _undo_multipliers(model: torch.nn.Module) -> None:
    """Granite's: the weights divided by the multipliers its forward applies, so that the
    random model computes what the Llama one would (its embeddings times 12 and layer outputs
    times 0.22 left random weights repeating one token), the forward still applying them all.
    (A tied output embedding shrinks with the input one; the final norm's gain, set after
    this, sizes the logits.)"""
    config = model.config
    embedding_multiplier = getattr(config, "embedding_multiplier", 1.0)
    residual_multiplier = getattr(config, "residual_multiplier", 1.0)
    if embedding_multiplier != 1.0:
        model.get_input_embeddings().weight.div_(embedding_multiplier)
    if residual_multiplier != 1.0:
        for name, module in model.named_modules():
            if name.endswith(("o_proj", "down_proj")):
                module.weight.div_(residual_multiplier)


def _qk_rows(config: PretrainedConfig) -> int:
    """The query and key rows of a fused [q; k; v] projection."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return (heads + kv_heads) * head_dim


def _gain_offset(module: torch.nn.Module) -> float:
    """1 for a Gemma norm (its weight is stored as gain - 1), else 0."""
    return 1.0 if type(module).__name__.startswith("Gemma") else 0.0


def _scale_gain(module: torch.nn.Module, factor: float) -> None:
    """Multiply a linear layer's or a norm's gain by `factor`."""
    offset = _gain_offset(module)
    module.weight.add_(offset).mul_(factor).sub_(offset)


# --- Command line ---------------------------------------------------------------------------------


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``make-tiny-model`` on the ``sluice`` command line; ``run`` handles it."""
    parser = subparsers.add_parser("make-tiny-model", help="write a small random model folder")
    parser.add_argument("out_dir", metavar="DIR")
    parser.add_argument(
        "--arch", choices=ARCHS + tiny_encoder.ENCODER_ARCHS, default=None,
        help="default: the preset's (llama for tiny/small)",
    )  # fmt: skip
    parser.add_argument("--preset", choices=tuple(PRESETS), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    parser.add_argument("--num-labels", type=int, default=None,
                        help="a sequence classifier (cross-encoder) with this many labels")
    parser.add_argument("--pooling", choices=tiny_encoder.POOLING_MODES, default="cls",
                        help="an encoder embedding model's pooling (bert, xlm-roberta)")
    parser.add_argument("--qk-scale", type=float, default=QK_SCALE,
                        help=f"queries and keys times this (default {QK_SCALE}: sharper "
                        "attention; 1: transformers' init, less sensitive to rounding)")
    for key in _SIZE_KEYS:
        parser.add_argument("--" + key.replace("_", "-"), type=int, default=None)
    parser.add_argument("--mtp-layers", type=int, choices=(0, 1), default=0,
                        help="deepseek_v3 / glm4_moe: a multi-token-prediction layer after the "
                        "model's, for speculative decoding with it (services/tiny_mtp.py)")
    parser.add_argument("--mtp-derived", action="store_true",
                        help="with --mtp-layers: a near-bigram model and an MTP layer that "
                        "agrees with it (random otherwise)")
    tiny_draft.add_args(parser)
    tiny_fp8.add_args(parser)
    tiny_int_weight.add_args(parser)
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    path = tiny_draft.run(args)  # (a draft model or an EAGLE head of a model folder)
    if path is not None:
        print(f"wrote {path} in {time.perf_counter() - start:.1f}s")
        return 0
    sizes = {key: getattr(args, key) for key in _SIZE_KEYS}
    path = make_tiny_model(
        args.out_dir, arch=args.arch, preset=args.preset, seed=args.seed, dtype=args.dtype,
        num_labels=args.num_labels, pooling=args.pooling, qk_scale=args.qk_scale, **sizes,
    )  # fmt: skip
    if args.mtp_layers:
        from services.tiny_mtp import add_mtp_layer

        add_mtp_layer(path, derived=args.mtp_derived, seed=args.seed)
    elif args.mtp_derived:
        raise SystemExit("--mtp-derived needs --mtp-layers 1")
    tiny_fp8.apply(args, path)
    tiny_int_weight.apply(args, path)
    print(f"wrote {path} in {time.perf_counter() - start:.1f}s")
    return 0

"""Our models + loader + torch_native paged attention against Hugging Face transformers.

Random tiny HF models are saved to a tmp dir, loaded with `engine.loader.load_model`, and run
through hand-built ForwardBatches over a real KVPool; HF's full-sequence forward on the same
weights is the oracle. Comparisons run in float64 so a tight tolerance separates real bugs
from rounding; weights use a large init range so attention is sharp and a wrong mask, rope
or cache slot changes the logits visibly. One case runs in float32 as the engine does.
"""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from engine.attention.base import create_attention_backend
from engine.config import ModelConfig
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.loader import load_model
from engine.mem_cache.kv_pool import KVPool

transformers = pytest.importorskip("transformers")

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


def save_random_model(arch: str, path: str, **save_kwargs: object) -> None:
    torch.manual_seed(0)
    model = _auto_class(ARCH_CONFIGS[arch]()).from_config(ARCH_CONFIGS[arch]())
    with torch.no_grad():  # norms start at exactly 1/0; randomise them so they are tested
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(torch.randn_like(param) * 0.2)
        for name, tensor in [*model.named_buffers(), *model.named_parameters()]:
            if name.endswith("e_score_correction_bias"):  # (DeepSeek-V3's, GLM-4.5's, ERNIE's)
                tensor.normal_(0.0, 0.1)
    model.save_pretrained(path, safe_serialization=True, **save_kwargs)


class PagedHarness:
    """Hand-rolled scheduler: a req_to_token table, pages handed out (optionally shuffled),
    and ForwardBatch construction for EXTEND and DECODE."""

    def __init__(self, model, cfg: ModelConfig, dtype, page_size: int = 1, shuffle: bool = False):
        self.model, self.page_size = model, page_size
        num_pages, rows, max_ctx = 64, 4, 128
        self.kv_pool = KVPool(
            num_pages * page_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype,
            page_size=page_size, shared=cfg.kv_shared,
        )  # fmt: skip
        self.req_to_token = torch.zeros(rows, max_ctx, dtype=torch.int32)
        self.free_pages = list(range(1, num_pages))  # page 0 holds the padding slot
        if shuffle:
            random.Random(1).shuffle(self.free_pages)
        self.pages: dict[int, list[int]] = {r: [] for r in range(rows)}
        self.lens = [0] * rows
        self.backend = create_attention_backend("torch_native", device="cpu", page_size=page_size)

    def _alloc(self, row: int, new_len: int) -> list[int]:
        slots = []
        for pos in range(self.lens[row], self.lens[row] + new_len):
            if pos % self.page_size == 0:
                self.pages[row].append(self.free_pages.pop())
            slot = self.pages[row][pos // self.page_size] * self.page_size + pos % self.page_size
            self.req_to_token[row, pos] = slot
            slots.append(slot)
        return slots

    def run(
        self, rows: list[int], chunks: list[list[int]], mode=ForwardMode.EXTEND, all_logits=False
    ):
        prefix = [self.lens[r] for r in rows]
        slots = [s for r, c in zip(rows, chunks, strict=True) for s in self._alloc(r, len(c))]
        for r, c in zip(rows, chunks, strict=True):
            self.lens[r] += len(c)
        ext = [len(c) for c in chunks]
        fb = ForwardBatch(
            forward_mode=mode,
            batch_size=len(rows),
            input_ids=torch.tensor([t for c in chunks for t in c]),
            positions=torch.tensor(
                [p + i for p, n in zip(prefix, ext, strict=True) for i in range(n)]
            ),
            out_cache_loc=torch.tensor(slots),
            req_pool_indices=torch.tensor(rows),
            seq_lens=torch.tensor([self.lens[r] for r in rows]),
            seq_lens_cpu=[self.lens[r] for r in rows],
            req_to_token=self.req_to_token,
            kv_pool=self.kv_pool,
            attn_backend=self.backend,
            extend_prefix_lens_cpu=prefix,
            extend_seq_lens_cpu=ext,
            extend_start_loc=torch.tensor([sum(ext[:i]) for i in range(len(ext))]),
            return_all_logits=all_logits,
        )
        if mode.is_decode():
            fb.extend_prefix_lens_cpu = fb.extend_seq_lens_cpu = fb.extend_start_loc = None
        self.backend.init_forward_metadata(fb)
        with torch.inference_mode():
            return self.model(fb.input_ids, fb.positions, fb)


PROMPT_LENS = [9, 14, 6]
NUM_DECODE = 4


class ArchCase:
    """One saved random model, our float64 load of it, and HF's float64 logits at every
    position of three fixed sequences (prompt + decode tokens): one HF forward each."""

    def __init__(self, arch: str, path: str) -> None:
        self.arch, self.path = arch, path
        self.cfg = ModelConfig.from_pretrained(path)
        self.model = load_model(self.cfg, torch.float64, "cpu")
        self.seqs = _random_ids([n + NUM_DECODE for n in PROMPT_LENS], seed=1)
        self.prompts = [s[:n] for s, n in zip(self.seqs, PROMPT_LENS, strict=True)]
        hf = _hf_model(path, torch.float64)
        self.refs = [_hf_logits(hf, s) for s in self.seqs]


@pytest.fixture(scope="module", params=list(ARCH_CONFIGS))
def case(request, tmp_path_factory) -> ArchCase:
    path = str(tmp_path_factory.mktemp(request.param))
    save_random_model(request.param, path)
    return ArchCase(request.param, path)


def _hf_model(path: str, dtype: torch.dtype):
    # eager experts: transformers' default grouped_mm has no float64
    hf = _auto_class(transformers.AutoConfig.from_pretrained(path)).from_pretrained(
        path, dtype=dtype, experts_implementation="eager"
    )
    return hf.eval()


def _auto_class(config):
    """AutoModelForCausalLM, or the image-text one for Mistral 3 (not in the causal map)."""
    if config.model_type == "mistral3":
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM


def _random_ids(lens: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lens]


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    eager = hf.config._attn_implementation == "eager"
    with (
        torch.no_grad(),
        _float64_softmax() if eager else contextlib.nullcontext(),
        _float64_deepseek_v2_rope() if hf.config.model_type == "deepseek_v2" else (
            contextlib.nullcontext()),
        _float64_ernie_rope(hf.config.model_type) if hf.config.model_type.startswith("ernie") else (
            contextlib.nullcontext()),
    ):  # fmt: skip
        return hf(torch.tensor([ids])).logits[0]


@contextlib.contextmanager
def _float64_ernie_rope(model_type: str):
    """transformers' ERNIE 4.5 rotates q and k in float32 whatever the model's dtype
    (`q.float() * cos`): 2e-6 of noise in the float64 oracle. For the duration, the same
    rotation in the inputs' precision with float32's cos and sin (the model's table)."""
    import importlib

    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")

    original = module.apply_rotary_pos_emb

    def rotate(q, k, cos, sin, unsqueeze_dim=1):
        cos, sin = (
            t.unsqueeze(unsqueeze_dim)[..., : t.shape[-1] // 2].repeat_interleave(2, dim=-1)
            for t in (cos, sin)
        )
        return tuple(
            x * cos.to(x.dtype) + module.rotate_half(x) * sin.to(x.dtype) for x in (q, k)
        )

    module.apply_rotary_pos_emb = rotate
    try:
        yield
    finally:
        module.apply_rotary_pos_emb = original


@contextlib.contextmanager
def _float64_deepseek_v2_rope():
    """transformers' DeepSeek-V2 rotates q and k as complex64 whatever the model's dtype
    (`xq.float()`), and takes cos/sin from `torch.polar`, an ulp off float32's cos and sin in
    places: 2e-6 of noise in the float64 oracle. For the duration, the same complex product
    in the inputs' precision, with float32's cos and sin (those of the model's table: that
    rounding is the model's, the engine's too)."""
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as module

    original, polar = module.apply_rotary_emb, torch.polar

    def rotate(xq, xk, freqs_cis):
        out = []
        for x in (xq, xk):
            pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
            turned = pairs * freqs_cis.unsqueeze(1).to(pairs.dtype)
            out.append(torch.view_as_real(turned).flatten(3).type_as(x))
        return tuple(out)

    module.apply_rotary_emb = rotate
    torch.polar = lambda length, angle: torch.complex(length * angle.cos(), length * angle.sin())
    try:
        yield
    finally:
        module.apply_rotary_emb, torch.polar = original, polar


@contextlib.contextmanager
def _float64_softmax():
    """transformers' eager attention (Gemma 2's: SDPA cannot soft-cap) takes its softmax in
    float32 even for a float64 model, which leaves 1e-6 of noise in the float64 oracle's
    logits; for the duration, a softmax asked for float32 of a float64 input stays float64.
    (Only for eager models: the MoE routers' float32 softmax is what the engine matches.)"""
    softmax = torch.nn.functional.softmax

    def float64_softmax(x, *args, dtype=None, **kwargs):
        if x.dtype == torch.float64:
            dtype = None
        return softmax(x, *args, dtype=dtype, **kwargs)

    torch.nn.functional.softmax = float64_softmax
    try:
        yield
    finally:
        torch.nn.functional.softmax = softmax


def _close(ours: torch.Tensor, ref: torch.Tensor, atol: float) -> None:
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, ref.float(), atol=atol, rtol=0)


def test_prefill_batch_matches_hf(case):
    harness = PagedHarness(case.model, case.cfg, torch.float64)
    last = harness.run([0, 1, 2], case.prompts)
    assert last.shape == (3, VOCAB)
    _close(
        last,
        torch.stack([r[n - 1] for r, n in zip(case.refs, PROMPT_LENS, strict=True)]),
        atol=1e-6,
    )


def test_return_all_logits_matches_hf(case):
    harness = PagedHarness(case.model, case.cfg, torch.float64)
    every = harness.run([2, 0, 1], case.seqs, all_logits=True)
    assert every.shape == (sum(PROMPT_LENS) + 3 * NUM_DECODE, VOCAB)
    _close(every, torch.cat(case.refs), atol=1e-6)


@pytest.mark.parametrize("page_size,shuffle", [(1, False), (4, True)])
def test_chunked_extend_then_decode_matches_hf(case, page_size, shuffle):
    h = PagedHarness(case.model, case.cfg, torch.float64, page_size=page_size, shuffle=shuffle)
    rows = [3, 1, 2]
    halves = [n // 2 for n in PROMPT_LENS]
    first = h.run(rows, [p[:n] for p, n in zip(case.prompts, halves, strict=True)])
    _close(
        first, torch.stack([r[n - 1] for r, n in zip(case.refs, halves, strict=True)]), atol=1e-6
    )
    second = h.run(
        rows, [p[n:] for p, n in zip(case.prompts, halves, strict=True)], all_logits=True
    )
    want = torch.cat([r[n:p] for r, n, p in zip(case.refs, halves, PROMPT_LENS, strict=True)])
    _close(second, want, atol=1e-6)
    for step in range(NUM_DECODE):
        tokens = [[s[n + step]] for s, n in zip(case.seqs, PROMPT_LENS, strict=True)]
        logits = h.run(rows, tokens, mode=ForwardMode.DECODE)
        want = torch.stack([r[n + step] for r, n in zip(case.refs, PROMPT_LENS, strict=True)])
        _close(logits, want, atol=1e-6)


def test_float32_matches_hf(case):
    """float32 as the engine runs on CPU: prefill with page_size 2 (shuffled), then decode."""
    model = load_model(case.cfg, torch.float32, "cpu")
    hf = _hf_model(case.path, torch.float32)
    refs = [_hf_logits(hf, s) for s in case.seqs]
    h = PagedHarness(model, case.cfg, torch.float32, page_size=2, shuffle=True)
    logits = h.run([0, 1, 2], case.prompts)
    _close(
        logits, torch.stack([r[n - 1] for r, n in zip(refs, PROMPT_LENS, strict=True)]), atol=1e-4
    )
    logits = h.run(
        [0, 1, 2], [[s[n]] for s, n in zip(case.seqs, PROMPT_LENS, strict=True)], ForwardMode.DECODE
    )
    _close(logits, torch.stack([r[n] for r, n in zip(refs, PROMPT_LENS, strict=True)]), atol=1e-4)


def test_sharded_checkpoint_loads_identically(case, tmp_path):
    save_random_model(case.arch, str(tmp_path), max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    sharded = load_model(ModelConfig.from_pretrained(str(tmp_path)), torch.float64).state_dict()
    single = case.model.state_dict()
    assert single.keys() == sharded.keys()
    for name, tensor in single.items():
        assert torch.equal(tensor, sharded[name]), name

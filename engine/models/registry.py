"""Architecture name (HF `config.architectures[0]`) -> model class, imported lazily.

A `*ForSequenceClassification` architecture is its causal model's class with a `score` head
(engine/models/classification.py); BERT's and RoBERTa's are encoders of their own
(engine/models/bert.py)."""

from __future__ import annotations

import importlib

from torch import nn

# Encoders (bidirectional attention; ModelConfig.is_encoder): architecture -> class name
_ENCODERS = {
    "BertModel": "BertModel",
    "BertForSequenceClassification": "BertForSequenceClassification",
    "RobertaModel": "RobertaModel",
    "RobertaForSequenceClassification": "RobertaForSequenceClassification",
    "XLMRobertaModel": "RobertaModel",
    "XLMRobertaForSequenceClassification": "RobertaForSequenceClassification",
}
ENCODER_ARCHITECTURES = frozenset(_ENCODERS)

_MODELS = {
    "LlamaForCausalLM": "engine.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "engine.models.llama:MistralForCausalLM",
    "Ministral3ForCausalLM": "engine.models.llama:Ministral3ForCausalLM",
    "Qwen2ForCausalLM": "engine.models.llama:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "engine.models.llama:Qwen3ForCausalLM",
    "GraniteForCausalLM": "engine.models.llama:GraniteForCausalLM",
    "SmolLM3ForCausalLM": "engine.models.llama:SmolLM3ForCausalLM",
    "Olmo2ForCausalLM": "engine.models.olmo:Olmo2ForCausalLM",
    "Olmo3ForCausalLM": "engine.models.olmo:Olmo3ForCausalLM",
    "MixtralForCausalLM": "engine.models.llama_moe:MixtralForCausalLM",
    "Qwen2MoeForCausalLM": "engine.models.llama_moe:Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM": "engine.models.llama_moe:Qwen3MoeForCausalLM",
    "Phi3ForCausalLM": "engine.models.phi3:Phi3ForCausalLM",
    "DeepseekV2ForCausalLM": "engine.models.deepseek:DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM": "engine.models.deepseek:DeepseekV3ForCausalLM",
    "Glm4ForCausalLM": "engine.models.glm4:Glm4ForCausalLM",
    "Glm4MoeForCausalLM": "engine.models.glm4_moe:Glm4MoeForCausalLM",
    "SeedOssForCausalLM": "engine.models.llama:SeedOssForCausalLM",
    "Ernie4_5ForCausalLM": "engine.models.llama:Ernie4_5ForCausalLM",
    "Ernie4_5_MoeForCausalLM": "engine.models.llama_moe:Ernie4_5_MoeForCausalLM",
    "GptOssForCausalLM": "engine.models.gpt_oss:GptOssForCausalLM",
    "GPT2LMHeadModel": "engine.models.gpt2:GPT2LMHeadModel",
    # EAGLE draft heads (speculative decoding: engine/speculative/eagle.py)
    "LlamaForCausalLMEagle": "engine.models.llama_eagle:LlamaForCausalLMEagle",
    "LlamaForCausalLMEagle3": "engine.models.llama_eagle:LlamaForCausalLMEagle3",
    # multi-token-prediction layers as draft heads (engine/models/mtp.py)
    "DeepseekV3ForCausalLMNextN": "engine.models.mtp:DeepseekV3ForCausalLMNextN",
    "Glm4MoeForCausalLMNextN": "engine.models.mtp:Glm4MoeForCausalLMNextN",
    "Gemma2ForCausalLM": "engine.models.gemma:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "engine.models.gemma:Gemma3ForCausalLM",
    # served as its text model (engine.config.TEXT_OF_MULTIMODAL)
    "Gemma3ForConditionalGeneration": "engine.models.gemma:Gemma3ForConditionalGeneration",
    "Mistral3ForConditionalGeneration": "engine.models.llama:Mistral3ForConditionalGeneration",
    **{arch: f"engine.models.bert:{cls}" for arch, cls in _ENCODERS.items()},
}


def supported_architectures() -> list[str]:
    from engine.models.classification import CLASSIFIER_BASES

    return sorted([*_MODELS, *CLASSIFIER_BASES])


def get_model_class(architecture: str) -> type[nn.Module]:
    from engine.models.classification import CLASSIFIER_BASES, sequence_classifier

    if architecture in CLASSIFIER_BASES:
        return sequence_classifier(get_model_class(CLASSIFIER_BASES[architecture]))
    if architecture not in _MODELS:
        raise ValueError(
            f"model architecture {architecture!r} is not supported; "
            f"supported: {supported_architectures()}"
        )
    module_name, cls_name = _MODELS[architecture].split(":")
    return getattr(importlib.import_module(module_name), cls_name)

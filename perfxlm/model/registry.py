"""Architecture name (config.json `architectures`) -> model class."""

from __future__ import annotations

import importlib
from typing import Any

_MODELS = {
    "LlamaForCausalLM": ("perfxlm.model.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("perfxlm.model.models.mistral", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("perfxlm.model.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("perfxlm.model.models.qwen3", "Qwen3ForCausalLM"),
    "Phi3ForCausalLM": ("perfxlm.model.models.phi3", "Phi3ForCausalLM"),
    "Gemma2ForCausalLM": ("perfxlm.model.models.gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("perfxlm.model.models.gemma3", "Gemma3ForCausalLM"),
    "OPTForCausalLM": ("perfxlm.model.models.opt", "OPTForCausalLM"),
    "Qwen2MoeForCausalLM": ("perfxlm.model.models.qwen2_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("perfxlm.model.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "GlmForCausalLM": ("perfxlm.model.models.glm", "GlmForCausalLM"),
    "Glm4ForCausalLM": ("perfxlm.model.models.glm4", "Glm4ForCausalLM"),
    "DeepseekV2ForCausalLM": ("perfxlm.model.models.deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("perfxlm.model.models.deepseek_v2", "DeepseekV3ForCausalLM"),
    "GptOssForCausalLM": ("perfxlm.model.models.gpt_oss", "GptOssForCausalLM"),
    "MixtralForCausalLM": ("perfxlm.model.models.mixtral", "MixtralForCausalLM"),
    # encoders: only the pooling runner serves them (model.models.base.EncoderModel)
    "BertModel": ("perfxlm.model.models.bert", "BertModel"),
    "BertForSequenceClassification": ("perfxlm.model.models.bert", "BertForSequenceClassification"),
    "XLMRobertaModel": ("perfxlm.model.models.xlm_roberta", "XLMRobertaModel"),
    "XLMRobertaForSequenceClassification": (
        "perfxlm.model.models.xlm_roberta", "XLMRobertaForSequenceClassification",
    ),
    "ModernBertModel": ("perfxlm.model.models.modernbert", "ModernBertModel"),
    "LlamaForSequenceClassification": ("perfxlm.model.models.seq_classification", "LlamaForSequenceClassification"),
    "Qwen2ForSequenceClassification": ("perfxlm.model.models.seq_classification", "Qwen2ForSequenceClassification"),
    "Qwen3ForSequenceClassification": ("perfxlm.model.models.seq_classification", "Qwen3ForSequenceClassification"),
    "ModernBertForSequenceClassification": ("perfxlm.model.models.modernbert", "ModernBertForSequenceClassification"),
    "Gemma3TextModel": ("perfxlm.model.models.gemma3_encoder", "Gemma3TextModel"),
}
# architectures that pool and cannot generate (no LM head): runner="auto" picks the pooling runner for them
POOLING_ONLY = frozenset(
    {"BertModel", "BertForSequenceClassification", "XLMRobertaModel", "XLMRobertaForSequenceClassification",
     "ModernBertModel", "ModernBertForSequenceClassification", "LlamaForSequenceClassification",
     "Qwen2ForSequenceClassification", "Qwen3ForSequenceClassification", "Gemma3TextModel"}
)


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_model_class(hf_config: Any) -> type:
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in _MODELS:
            module, name = _MODELS[arch]
            return getattr(importlib.import_module(module), name)
    raise ValueError(
        f"Model architectures {archs} are not supported. Supported: {', '.join(supported_architectures())}."
    )


def is_pooling_only(hf_config: Any) -> bool:
    """Whether the first supported architecture the config names is an encoder (pooling only)."""
    for arch in list(getattr(hf_config, "architectures", None) or []):
        if arch in _MODELS:
            return arch in POOLING_ONLY
    return False

"""GGUF checkpoints (llama.cpp format): config and weights in Hugging Face terms.

The header parser is `gguf_reader`, the tokenizer `gguf_tokenizer`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator

import gguf
import torch

from perfxlm.model.loader import gguf_deepseek2, gguf_gemma2, gguf_gemma3, gguf_glm4, gguf_gpt_oss
from perfxlm.model.loader.gguf_reader import GGUFFile, open_gguf
from perfxlm.model.loader.gguf_metadata import (
    ROPE_SCALING_TYPES, check_attention_scale, check_metadata, head_dims, rope_freq_factors, uniform,
)
from perfxlm.ops.gguf_dequant import check_supported
from perfxlm.quant.gguf_repack import REPACKED_TYPES, repack

if TYPE_CHECKING:
    import transformers

    from perfxlm.quant.weight import QuantizedWeight

logger = logging.getLogger(__name__)

Q = gguf.GGMLQuantizationType

# ---------------------------------------------------------------------------------------------------------
# Architecture tables. Adding an architecture that shares llama's tensor layout (qwen2, mistral, ...) means
# adding an `_ArchSpec` entry: its HF config class and architecture, its metadata keys, and whether
# llama.cpp's converter permuted q/k for it.
# ---------------------------------------------------------------------------------------------------------

# `{arch}.<key>` -> HF config attribute, shared by llama-like decoders
_DECODER_KEYS: dict[str, str] = {
    "block_count": "num_hidden_layers",
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
}

# GGUF tensor name -> HF parameter name; `{n}` is the layer index
_DECODER_TENSORS: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "blk.{n}.attn_q": "model.layers.{n}.self_attn.q_proj",
    "blk.{n}.attn_k": "model.layers.{n}.self_attn.k_proj",
    "blk.{n}.attn_v": "model.layers.{n}.self_attn.v_proj",
    "blk.{n}.attn_output": "model.layers.{n}.self_attn.o_proj",
    "blk.{n}.ffn_gate": "model.layers.{n}.mlp.gate_proj",
    "blk.{n}.ffn_up": "model.layers.{n}.mlp.up_proj",
    "blk.{n}.ffn_down": "model.layers.{n}.mlp.down_proj",
    "blk.{n}.attn_norm": "model.layers.{n}.input_layernorm",
    "blk.{n}.ffn_norm": "model.layers.{n}.post_attention_layernorm",
}

# llama.cpp's precomputed Llama-3 rope factors: read into the config (rope_freq_factors), not a parameter
_ROPE_FREQS_TENSORS = re.compile(r"^(rope_freqs|blk\.\d+\.rope_freqs)\.weight$")


@dataclass(frozen=True)
class _ArchSpec:
    model_type: str  # transformers' name of the family
    hf_architecture: str
    config_keys: dict[str, str]
    tensors: dict[str, str]
    # llama.cpp interleaves q/k rows for its rope layout on these architectures; undone on load
    permute_qk: bool
    extra_config: dict[str, Any] = field(default_factory=dict)
    extra_keys: frozenset[str] = frozenset()  # `{arch}.*` metadata read beyond the decoder keys
    # the converter stored norm weights as (1 + w) (Gemma): subtract the one on load
    norms_plus_one: bool = False
    # a mixture of experts: expert_count / expert_used_count are read, and the `*_exps` tensors, stacked
    # [num_experts, ...], are split into the per-expert tensors of the Hugging Face layout
    moe: bool = False
    # the family puts its expert tensors together itself (gpt-oss: fused, interleaved stacks): the stream of
    # (Hugging Face name, tensor) pairs passes through this instead of the per-expert split
    regroup: Callable[[Iterator[tuple[str, Any]]], Iterator[tuple[str, Any]]] | None = None
    # the `*_exps` stacks go whole to `regroup` (gpt-oss), not split per expert first
    experts_whole: bool = False
    # one GGUF architecture for several families (deepseek2: V2 or V3): (model_type, architecture) by the
    # file's metadata, else the two fields above
    variant: Callable[[dict[str, Any]], tuple[str, str]] | None = None
    rope_types: tuple[str, ...] = ROPE_SCALING_TYPES  # the rope.scaling.type values the family reads


_QK_NORM_TENSORS: dict[str, str] = {
    **_DECODER_TENSORS,
    "blk.{n}.attn_q_norm": "model.layers.{n}.self_attn.q_norm",
    "blk.{n}.attn_k_norm": "model.layers.{n}.self_attn.k_norm",
}

# Qwen3-MoE: every layer sparse (Qwen3-30B-A3B's mlp_only_layers is empty), top-k renormalised (llama.cpp's
# qwen3moe graph always normalises the chosen weights)
_QWEN3MOE_KEYS = {
    **_DECODER_KEYS, "expert_count": "num_experts", "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
}  # fmt: skip
_QWEN3MOE_TENSORS = {
    **_QK_NORM_TENSORS,
    "blk.{n}.ffn_gate_inp": "model.layers.{n}.mlp.gate",
    "blk.{n}.ffn_gate_exps": "model.layers.{n}.mlp.experts.gate_proj",
    "blk.{n}.ffn_up_exps": "model.layers.{n}.mlp.experts.up_proj",
    "blk.{n}.ffn_down_exps": "model.layers.{n}.mlp.experts.down_proj",
}
_EXPERT_STACK = re.compile(r"\.experts\.(gate_proj|up_proj|down_proj)\.weight$")

_ARCHS: dict[str, _ArchSpec] = {
    "llama": _ArchSpec("llama", "LlamaForCausalLM", _DECODER_KEYS, _DECODER_TENSORS, permute_qk=True),
    # llama.cpp uses the NeoX rope layout for these, so its converter leaves q/k as they are
    "qwen2": _ArchSpec("qwen2", "Qwen2ForCausalLM", _DECODER_KEYS, _DECODER_TENSORS, permute_qk=False,
                       extra_config={"use_sliding_window": False, "sliding_window": None}),
    "qwen3": _ArchSpec("qwen3", "Qwen3ForCausalLM", _DECODER_KEYS, _QK_NORM_TENSORS, permute_qk=False,
                       extra_config={"use_sliding_window": False, "sliding_window": None}),
    "qwen3moe": _ArchSpec(
        "qwen3_moe", "Qwen3MoeForCausalLM", _QWEN3MOE_KEYS, _QWEN3MOE_TENSORS, permute_qk=False,
        extra_config={"use_sliding_window": False, "sliding_window": None, "norm_topk_prob": True,
                      "decoder_sparse_step": 1, "mlp_only_layers": []},
        extra_keys=frozenset({"expert_feed_forward_length"}), moe=True,
    ),  # fmt: skip
    "gemma2": _ArchSpec("gemma2", "Gemma2ForCausalLM", _DECODER_KEYS, gguf_gemma2.TENSORS, permute_qk=False,
                        extra_config=gguf_gemma2.CONFIG_DEFAULTS, extra_keys=gguf_gemma2.EXTRA_KEYS,
                        norms_plus_one=True),
    "gemma3": _ArchSpec(
        "gemma3_text", "Gemma3ForCausalLM", _DECODER_KEYS, gguf_gemma3.TENSORS, permute_qk=False,
        extra_config=gguf_gemma3.CONFIG_DEFAULTS, extra_keys=gguf_gemma3.EXTRA_KEYS, norms_plus_one=True,
    ),
    "glm4": _ArchSpec("glm4", "Glm4ForCausalLM", _DECODER_KEYS, gguf_glm4.TENSORS, permute_qk=False,
                      extra_config=gguf_glm4.CONFIG_DEFAULTS),
    "gpt-oss": _ArchSpec(
        "gpt_oss", "GptOssForCausalLM", {**_DECODER_KEYS, **gguf_gpt_oss.KEYS}, gguf_gpt_oss.TENSORS,
        permute_qk=False, extra_config=gguf_gpt_oss.CONFIG_DEFAULTS, extra_keys=gguf_gpt_oss.EXTRA_KEYS, moe=True,
        regroup=gguf_gpt_oss.regroup, rope_types=gguf_gpt_oss.ROPE_SCALING_TYPES, experts_whole=True,
    ),
    "deepseek2": _ArchSpec(
        "deepseek_v2", "DeepseekV2ForCausalLM", {**_DECODER_KEYS, **gguf_deepseek2.KEYS}, gguf_deepseek2.TENSORS,
        permute_qk=False, extra_config=gguf_deepseek2.CONFIG_DEFAULTS, extra_keys=gguf_deepseek2.EXTRA_KEYS,
        moe=True, regroup=gguf_deepseek2.regroup, rope_types=gguf_deepseek2.ROPE_SCALING_TYPES,
        variant=gguf_deepseek2.variant,
    ),
}

# What the transformers config classes of these families default to, for the fields a GGUF file does
# not carry. The config is a plain `PretrainedConfig`: the family classes import about a second of
# transformers modules (validators, kernels hub, dynamo) that loading a GGUF file never needs.
_CONFIG_DEFAULTS: dict[str, Any] = {
    "hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "initializer_range": 0.02,
    "attention_dropout": 0.0, "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1,
    "use_cache": True,
}  # fmt: skip


def _spec(arch: str) -> _ArchSpec:
    try:
        return _ARCHS[arch]
    except KeyError:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(sorted(_ARCHS))})."
        ) from None


# ---------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------

def _rope_scaling(meta: dict[str, Any], arch: str) -> dict[str, Any] | None:
    prefix = f"{arch}.rope.scaling."
    kind = meta.get(prefix + "type")
    factor = meta.get(prefix + "factor")
    if kind is None and f"{arch}.rope.scale_linear" in meta:  # older files
        kind, factor = "linear", meta[f"{arch}.rope.scale_linear"]
    if kind in (None, "none") or factor is None:
        return None
    # yarn and other types are refused by check_metadata before this is reached
    return {"rope_type": kind, "factor": float(factor)}


def load_gguf_config(path: str) -> "transformers.PretrainedConfig":
    """A transformers `PretrainedConfig` with the family's fields, built from the GGUF file's metadata."""
    import transformers

    f = open_gguf(path)
    arch = f.architecture
    spec = _spec(arch)
    meta = f.metadata

    # llama.cpp writes Mistral as `llama`; a sliding window in the file makes it Mistral again
    window = meta.get(f"{arch}.attention.sliding_window") if arch == "llama" else None
    check_metadata(
        meta, arch, spec.extra_keys | ({"attention.sliding_window"} if arch == "llama" else set()), spec.moe,
        spec.rope_types,
    )
    model_type, hf_architecture = spec.variant(meta) if spec.variant else (spec.model_type, spec.hf_architecture)
    kwargs: dict[str, Any] = {**_CONFIG_DEFAULTS, **spec.extra_config}
    if window:
        model_type, hf_architecture = "mistral", "MistralForCausalLM"
        kwargs["sliding_window"] = int(window)
    for gguf_key, hf_key in spec.config_keys.items():
        if f"{arch}.{gguf_key}" in meta:
            kwargs[hf_key] = uniform(meta, f"{arch}.{gguf_key}")  # per-layer lists must agree
    for required in ("num_hidden_layers", "hidden_size", "num_attention_heads"):
        if required not in kwargs:
            raise ValueError(f"{path!r} lacks the {arch}.* metadata for {required}.")

    if "vocab_size" not in kwargs:
        if "tokenizer.ggml.tokens" in meta:
            kwargs["vocab_size"] = len(meta["tokenizer.ggml.tokens"])
        elif "token_embd.weight" in f.tensors:
            kwargs["vocab_size"] = f.tensors["token_embd.weight"].shape[0]

    if arch == "deepseek2":  # MLA: its key and value sizes are not one head size (gguf_deepseek2)
        head_dim = gguf_deepseek2.apply(meta, kwargs)
    else:
        head_dim = head_dims(
            meta, arch, int(kwargs["hidden_size"]), int(kwargs["num_attention_heads"]), partial_rotary=arch == "glm4"
        )  # fmt: skip
    kwargs["head_dim"] = head_dim
    if arch == "glm4":
        gguf_glm4.apply(meta, kwargs, head_dim)  # its rope width is a part of the head
    if arch == "gemma2":
        gguf_gemma2.apply(meta, kwargs, head_dim)  # its attention scale is query_pre_attn_scalar
    elif arch not in ("gemma3", "deepseek2"):  # (gemma3's is set with its rope, below; MLA's from its config)
        check_attention_scale(meta, arch, head_dim)
    freq_factors = rope_freq_factors(f.tensors, f.tensor, head_dim)

    rope_theta = float(kwargs.pop("rope_theta", 10000.0))
    rope_scaling = _rope_scaling(meta, arch)
    # both spellings: 4.x code reads rope_theta / rope_scaling, 5.x code rope_parameters
    kwargs["rope_theta"] = rope_theta
    kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": rope_theta, **(rope_scaling or {})}
    if rope_scaling is not None:
        kwargs["rope_scaling"] = rope_scaling
    if arch == "gemma3":
        gguf_gemma3.apply(meta, kwargs, head_dim)  # local and global rope, the attention scale, the windows
    if arch == "gpt-oss":
        gguf_gpt_oss.apply(meta, kwargs)  # alternating sliding / full layers, untruncated YaRN
    if arch == "deepseek2":
        gguf_deepseek2.apply_rope(meta, kwargs)  # YaRN with DeepSeek's mscale
    if spec.extra_config.get("use_sliding_window") is False:  # as Qwen2Config: every layer full attention
        kwargs["layer_types"] = ["full_attention"] * int(kwargs["num_hidden_layers"])
        kwargs["max_window_layers"] = int(kwargs["num_hidden_layers"])

    tensors = f.tensors
    kwargs["tie_word_embeddings"] = "output.weight" not in tensors
    kwargs["attention_bias"] = "blk.0.attn_q.bias" in tensors
    if "blk.0.ffn_up.bias" in tensors:
        kwargs["mlp_bias"] = True

    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    # llama.cpp also ends generation on the end-of-turn / end-of-message tokens chat models emit
    extra_eos = [
        meta[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in meta
    ]
    eos_ids = [i for i in dict.fromkeys([eos, *extra_eos]) if i is not None]
    kwargs["bos_token_id"] = bos
    kwargs["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None)
    kwargs["pad_token_id"] = meta.get("tokenizer.ggml.padding_token_id")
    kwargs["architectures"] = [hf_architecture]

    config = transformers.PretrainedConfig(**kwargs)
    config.model_type = model_type
    if freq_factors is not None:
        # Llama-3.x rope scaling as llama.cpp stores it: inv_freq / factor per frequency (rotary.py)
        config.rope_freq_factors = freq_factors
    # 5.x keeps the base frequency only in rope_parameters; code written for 4.x reads config.rope_theta
    if getattr(config, "rope_theta", None) is None:
        config.rope_theta = rope_theta
    if isinstance(getattr(type(config), "torch_dtype", None), property):
        config.dtype = torch.float32  # newer transformers: torch_dtype is a deprecated alias of dtype
    else:
        config.torch_dtype = torch.float32
    return config


# ---------------------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------------------

def _name_table(spec: _ArchSpec) -> list[tuple[re.Pattern[str], str]]:
    table = []
    for gguf_name, hf_name in spec.tensors.items():
        pattern = re.escape(gguf_name).replace(re.escape("{n}"), r"(?P<n>\d+)")
        table.append((re.compile(rf"^{pattern}\.(?P<kind>weight|bias)$"), hf_name))
    return table


def _hf_name(name: str, table: list[tuple[re.Pattern[str], str]]) -> str | None:
    for pattern, hf_name in table:
        m = pattern.match(name)
        if m:
            groups = m.groupdict()
            return hf_name.format(n=groups.get("n")) + "." + groups["kind"]
    return None


def unpermute_qk(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (its converter's `permute`), giving the HF layout back.

    Same as transformers' `LlamaTensorProcessor._reverse_permute_weights`: within each head the rows
    were reordered from [first half | second half] to interleaved pairs.
    """
    dim = weight.shape[0] // n_head // 2
    w = weight.reshape(n_head, dim, 2, *weight.shape[1:])
    return w.transpose(1, 2).reshape(weight.shape)


def iter_gguf_weights(
    path: str, config: Any = None, keep_quantized: bool = False
) -> Iterator[tuple[str, "torch.Tensor | QuantizedWeight"]]:
    """(Hugging Face parameter name, float32 tensor) for every model tensor in the GGUF file.

    Tensors are dequantized one at a time, as the iterator is consumed. A tied model yields no
    lm_head.weight. `config` (for the head counts) defaults to `load_gguf_config(path)`.
    `keep_quantized`: matrices of the types in `gguf_repack.REPACKED_TYPES` come as a `QuantizedWeight`
    holding the same values (repacked, never widened); other quantized types are dequantized, and one
    log line says which.
    """
    # opened here rather than in the generator so a bad file, architecture or tensor type fails at the call
    f = open_gguf(path)
    spec = _spec(f.architecture)
    for info in f.tensors.values():
        try:
            check_supported(info.ggml_type)
        except ValueError as e:
            raise ValueError(f"{path!r}: tensor {info.name!r}: {e}") from None
    table = _name_table(spec)
    for name in f.tensors:
        if _hf_name(name, table) is None and not _ROPE_FREQS_TENSORS.match(name):
            # a tensor the model has no place for would silently be computed without: refuse instead
            raise ValueError(
                f"{path!r}: GGUF tensor {name!r} has no counterpart in the {spec.hf_architecture} model; "
                "the file is not supported by this loader."
            )
    config = config if config is not None else load_gguf_config(path)
    n_head = config.num_attention_heads
    n_kv_head = getattr(config, "num_key_value_heads", None) or n_head
    if keep_quantized:
        widened = sorted({
            i.ggml_type.name for i in f.tensors.values()
            if i.ggml_type not in REPACKED_TYPES and i.ggml_type not in (Q.F32, Q.F16, Q.BF16)
        })  # fmt: skip
        if widened:
            logger.info(
                "GGUF %s: tensors of type %s are dequantized to float at load (kept quantized: %s).",
                os.path.basename(path), ", ".join(widened), ", ".join(sorted(t.name for t in REPACKED_TYPES)),
            )  # fmt: skip
    weights = _iter_weights(f, spec, n_head, n_kv_head, keep_quantized)
    return weights if spec.regroup is None else spec.regroup(weights)


@contextlib.contextmanager
def _one_torch_thread() -> Iterator[None]:
    # Dequantizing is memory-bound: one thread is within ~20% of two on an idle machine, while with
    # the cores contended OpenMP's barrier waits made the whole SmolLM2 load 10x slower (0.35 s -> 4 s).
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _iter_weights(
    f: GGUFFile, spec: _ArchSpec, n_head: int, n_kv_head: int, keep_quantized: bool = False
) -> Iterator[tuple[str, Any]]:
    table = _name_table(spec)
    for name in f.tensors:
        hf_name = _hf_name(name, table)
        if hf_name is None:
            continue  # rope_freqs: read into the config by load_gguf_config (others refused up front)
        info = f.tensors[name]
        if spec.moe and not spec.experts_whole and _EXPERT_STACK.search(hf_name):
            yield from _expert_tensors(f, name, hf_name, keep_quantized)
            continue
        # the thread count is restored before each yield, so the consumer runs with its own setting
        with _one_torch_thread():
            if keep_quantized and info.ggml_type in REPACKED_TYPES and len(info.shape) in (2, 3):
                tensor: Any = repack(f.raw(name), info.ggml_type, info.shape)
            else:
                tensor = f.tensor(name)
            if spec.norms_plus_one and hf_name.endswith("norm.weight"):
                tensor = tensor - 1.0
            if spec.permute_qk:
                if ".self_attn.q_proj." in hf_name:
                    tensor = _unpermute(tensor, n_head)
                elif ".self_attn.k_proj." in hf_name:
                    tensor = _unpermute(tensor, n_kv_head)
        yield hf_name, tensor
    # the tensors are copied out: hand the file's pages back, so resident memory is the model's own
    f.release_pages()


def _expert_tensors(f: GGUFFile, name: str, hf_name: str, keep_quantized: bool) -> Iterator[tuple[str, Any]]:
    """A stacked `*_exps` tensor [E, rows, cols] as E per-expert tensors under the Hugging Face names
    (`experts.{e}.gate_proj.weight`, ...); quantized blocks are repacked expert by expert, never widened."""
    info = f.tensors[name]
    quantized = keep_quantized and info.ggml_type in REPACKED_TYPES and len(info.shape) == 3
    raw = f.raw(name) if quantized else None
    stack = None if quantized else f.tensor(name)
    for e in range(info.shape[0]):
        with _one_torch_thread():
            tensor = repack(raw[e], info.ggml_type, info.shape[1:]) if quantized else stack[e]
        yield hf_name.replace(".experts.", f".experts.{e}."), tensor


def _unpermute(tensor: Any, n_head: int) -> Any:
    if isinstance(tensor, torch.Tensor):
        return unpermute_qk(tensor, n_head)
    rows = torch.arange(tensor.out_features).view(-1, 1)
    return tensor.index_rows(unpermute_qk(rows, n_head).view(-1))  # codes, scales and mins rows alike

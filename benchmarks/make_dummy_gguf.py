"""Write a Llama GGUF of a chosen shape with random weights, for speed comparisons at sizes no local file has.

The tokenizer (and so the vocabulary size) is copied from a donor GGUF, by default the embedded
SmolLM2 model, so prompts tokenize as usual; every other tensor is drawn from N(0, 0.02) (norms 1.0) and
stored as F16, which `compare_llamacpp.py --llamacpp-ftype` / `requantize` turn into Q8_0, Q4_0, ...
Speed depends on shapes, not on values, so a dummy file measures what a real one of that shape would.

    python benchmarks/make_dummy_gguf.py /tmp/llama-1b-shape.f16.gguf            # Llama-3.2-1B body
    python benchmarks/make_dummy_gguf.py out.gguf --hidden 4096 --layers 32 --intermediate 14336

`--experts E` writes a Qwen3-MoE body instead (every layer E experts of --intermediate, --experts-used per
token), e.g. Qwen3-30B-A3B's shapes with 4 of its 48 layers and 64 of its 128 experts:

    python benchmarks/make_dummy_gguf.py moe.f16.gguf --hidden 2048 --layers 4 --heads 32 --kv-heads 4 \
        --head-dim 128 --intermediate 768 --experts 64 --experts-used 8

`--from-hf DIR` converts a gpt-oss Hugging Face checkpoint (random weights saved by transformers) instead,
as llama.cpp's converter lays it out: expert stacks in MXFP4, the rest F32 (or `--float-type BF16`):

    python benchmarks/make_dummy_gguf.py tiny-gpt-oss.gguf --from-hf /tmp/tiny-gpt-oss

or a DeepSeek-V2 / V3 one as llama.cpp's `deepseek2` (kv_b split into attn_k_b / attn_v_b unless
`--whole-kv-b`; `--quant-type Q8_0` quantizes the matrices whose rows are whole blocks):

    python benchmarks/make_dummy_gguf.py tiny-deepseek.gguf --from-hf /tmp/tiny-deepseek-v3 --quant-type Q8_0

or a BERT encoder (`BertModel`: bge, e5, all-MiniLM) as llama.cpp's `bert`, the WordPiece vocabulary from the
folder's tokenizer, CLS or MEAN pooling as its sentence-transformers `1_Pooling` says (the embedding
benchmark's llama.cpp peer; `--from-hf` also takes a sentence-transformers folder):

    python benchmarks/make_dummy_gguf.py bge-base-shape.gguf --from-hf /tmp/st-folder
"""

from __future__ import annotations

import argparse

import numpy as np
from tqdm import tqdm


def donor_tokenizer(path: str) -> list[tuple[str, object, object]]:
    """(key, value, GGUFValueType) of every tokenizer.* field of the donor file."""
    import gguf

    reader = gguf.GGUFReader(path)
    fields = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            item_type = field.types[1] if len(field.types) > 1 else None
            fields.append((key, field.contents(), item_type))
        else:
            fields.append((key, field.contents(), kind))
    return fields


def write_dummy(path: str, donor: str, hidden: int, layers: int, intermediate: int, heads: int, kv_heads: int,
                context: int, rope_theta: float, seed: int, experts: int = 0, experts_used: int = 0,
                head_dim: int | None = None, quant_type: str | None = None) -> None:
    """A Llama body, or with `experts` a Qwen3-MoE one (`qwen3moe`: q/k norms, every layer a mixture of
    `experts` gated MLPs of `intermediate` each, `experts_used` per token, no shared expert).
    `quant_type` (a GGML type gguf-py quantizes, "Q8_0" / "Q4_0"): the layers' matrices and expert stacks
    in it (the table and the router stay float), as a small quantized file for tests."""
    import gguf

    rng = np.random.default_rng(seed)
    tokenizer = donor_tokenizer(donor)
    vocab = next(len(v) for k, v, _ in tokenizer if k == "tokenizer.ggml.tokens")
    arch = "qwen3moe" if experts else "llama"
    head_dim = head_dim or hidden // heads
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(f"dummy-{arch}-{hidden}x{layers}")
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(experts_used)
        writer.add_expert_feed_forward_length(intermediate)
    writer.add_rope_freq_base(rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for key, value, kind in tokenizer:
        if isinstance(value, list):
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, kind)

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)

    qtype = None if quant_type is None else gguf.GGMLQuantizationType[quant_type]

    def matrix(name: str, value: np.ndarray) -> None:
        if qtype is None:
            return writer.add_tensor(name, value)
        writer.add_tensor(name, gguf.quants.quantize(value.astype(np.float32), qtype), raw_dtype=qtype)

    writer.add_tensor("token_embd.weight", normal(vocab, hidden))  # tied: no output.weight
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in tqdm(range(layers), desc="layers", unit="layer"):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        matrix(f"blk.{i}.attn_q.weight", normal(heads * head_dim, hidden))
        matrix(f"blk.{i}.attn_k.weight", normal(kv_heads * head_dim, hidden))
        matrix(f"blk.{i}.attn_v.weight", normal(kv_heads * head_dim, hidden))
        matrix(f"blk.{i}.attn_output.weight", normal(hidden, heads * head_dim))
        if not experts:
            matrix(f"blk.{i}.ffn_gate.weight", normal(intermediate, hidden))
            matrix(f"blk.{i}.ffn_up.weight", normal(intermediate, hidden))
            matrix(f"blk.{i}.ffn_down.weight", normal(hidden, intermediate))
            continue
        writer.add_tensor(f"blk.{i}.attn_q_norm.weight", np.ones(head_dim, np.float32))
        writer.add_tensor(f"blk.{i}.attn_k_norm.weight", np.ones(head_dim, np.float32))
        # the router in float32, as llama.cpp's converter keeps it; stacks [E, rows, cols]
        writer.add_tensor(f"blk.{i}.ffn_gate_inp.weight", normal(experts, hidden).astype(np.float32))
        matrix(f"blk.{i}.ffn_gate_exps.weight", normal(experts, intermediate, hidden))
        matrix(f"blk.{i}.ffn_up_exps.weight", normal(experts, intermediate, hidden))
        matrix(f"blk.{i}.ffn_down_exps.weight", normal(experts, hidden, intermediate))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=True)
    writer.close()


def _float_tensor(writer, name: str, value, float_type: str):
    """`value` (torch) written as F32, or as BF16 for matrices (norms, biases and sinks stay F32, as the
    converter keeps 1-D tensors); returns the float32 values the file holds."""
    import gguf
    import torch

    value = value.detach().float().contiguous()
    if float_type == "BF16" and value.dim() > 1:
        rounded = value.to(torch.bfloat16)
        writer.add_tensor(name, rounded.view(torch.int16).numpy().view(np.uint16),
                          raw_dtype=gguf.GGMLQuantizationType.BF16)
        return rounded.float()
    writer.add_tensor(name, value.numpy())
    return value


def _mxfp4_tensor(writer, name: str, value):
    """[E, N, K] written as GGML MXFP4 blocks (gguf-py's quantizer); returns the dequantized values."""
    import gguf
    import torch

    q = gguf.GGMLQuantizationType.MXFP4
    blocks = gguf.quants.quantize(value.detach().float().contiguous().numpy(), q)
    writer.add_tensor(name, blocks, raw_dtype=q)
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(blocks, q), dtype=np.float32))


def _hf_writer(path: str, arch: str, cfg):
    """A GGUFWriter for `arch` holding the sizes every family's file carries, read off a transformers config."""
    import gguf

    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    return writer


def write_gpt_oss(path: str, model, float_type: str = "F32") -> dict:
    """A gpt-oss GGUF file from a transformers `GptOssForCausalLM` (float), laid out as llama.cpp's
    converter writes it: gate|up columns split into `ffn_gate_exps` / `ffn_up_exps` (even / odd columns),
    every stack [E, out, in] in MXFP4 (rows a multiple of 32 long), `attn_sinks`, the router as
    `ffn_gate_inp`, YaRN keys. Returns the model's state dict with the values as the file holds them
    (MXFP4 and BF16 rounding included), to load back into transformers for a comparison."""
    import gguf
    import torch

    cfg = model.config
    arch = "gpt-oss"
    rope = dict(cfg.rope_parameters)
    writer = _hf_writer(path, arch, cfg)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    writer.add_expert_count(cfg.num_local_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_expert_feed_forward_length(cfg.intermediate_size)
    writer.add_sliding_window(cfg.sliding_window)
    writer.add_vocab_size(cfg.vocab_size)
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
        writer.add_rope_scaling_yarn_beta_fast(float(rope.get("beta_fast", 32.0)))
        writer.add_rope_scaling_yarn_beta_slow(float(rope.get("beta_slow", 1.0)))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    held = dict(state)
    held["model.embed_tokens.weight"] = _float_tensor(writer, "token_embd.weight", state["model.embed_tokens.weight"], float_type)
    held["model.norm.weight"] = _float_tensor(writer, "output_norm.weight", state["model.norm.weight"], float_type)
    if not cfg.tie_word_embeddings:
        held["lm_head.weight"] = _float_tensor(writer, "output.weight", state["lm_head.weight"], float_type)
    parts = {
        "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
        "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
        "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
        "self_attn.o_proj.weight": "attn_output.weight", "self_attn.o_proj.bias": "attn_output.bias",
        "self_attn.sinks": "attn_sinks.weight", "mlp.router.weight": "ffn_gate_inp.weight",
        "mlp.router.bias": "ffn_gate_inp.bias",
    }  # fmt: skip
    for i in range(cfg.num_hidden_layers):
        hf, blk = f"model.layers.{i}.", f"blk.{i}."
        for part, gguf_part in parts.items():
            held[hf + part] = _float_tensor(writer, blk + gguf_part, state[hf + part], float_type)
        experts = hf + "mlp.experts."
        gate_up = state[experts + "gate_up_proj"].transpose(1, 2)  # [E, 2I, H], gate and up rows interleaved
        gate = _mxfp4_tensor(writer, blk + "ffn_gate_exps.weight", gate_up[:, 0::2])
        up = _mxfp4_tensor(writer, blk + "ffn_up_exps.weight", gate_up[:, 1::2])
        down = _mxfp4_tensor(writer, blk + "ffn_down_exps.weight", state[experts + "down_proj"].transpose(1, 2))
        bias = state[experts + "gate_up_proj_bias"]
        _float_tensor(writer, blk + "ffn_gate_exps.bias", bias[:, 0::2], float_type)
        _float_tensor(writer, blk + "ffn_up_exps.bias", bias[:, 1::2], float_type)
        _float_tensor(writer, blk + "ffn_down_exps.bias", state[experts + "down_proj_bias"], float_type)
        held[experts + "gate_up_proj"] = torch.stack((gate, up), dim=2).reshape(gate_up.shape).transpose(1, 2)
        held[experts + "down_proj"] = down.transpose(1, 2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held


def write_bert(path: str, folder: str, float_type: str = "F32") -> None:
    """A llama.cpp `bert` GGUF from a BERT encoder folder (a transformers one, or a sentence-transformers one
    whose transformer is at its root), laid out as llama.cpp's converter writes it: the tensors by gguf-py's
    name map, WordPiece tokens in its phantom-space form (a word start prefixed with U+2581, `##` dropped),
    [CLS] / [SEP] as BOS / EOS, the pooling of `1_Pooling/config.json` (CLS when there is none)."""
    import json
    import os

    import gguf
    import transformers

    model = transformers.AutoModel.from_pretrained(folder, dtype="float32")
    cfg = model.config
    if cfg.model_type != "bert":
        raise SystemExit(f"{folder}: write_bert converts BertModel checkpoints; this one is {cfg.model_type!r}")
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    writer = _hf_writer(path, "bert", cfg)
    writer.add_layer_norm_eps(float(cfg.layer_norm_eps))
    writer.add_causal_attention(False)
    pooling = gguf.PoolingType.CLS
    pooling_file = os.path.join(folder, "1_Pooling", "config.json")
    if os.path.isfile(pooling_file):
        with open(pooling_file) as f:
            modes = json.load(f)
        pooling = gguf.PoolingType.MEAN if modes.get("pooling_mode_mean_tokens") else gguf.PoolingType.CLS
    writer.add_pooling_type(pooling)
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    special = set(tok.all_special_ids)
    tokens, types = [], []
    for text, i in vocab:
        if i in special:
            tokens.append(text)
            types.append(gguf.TokenType.UNKNOWN if i == tok.unk_token_id else gguf.TokenType.CONTROL)
        else:
            tokens.append(text[2:] if text.startswith("##") else "\u2581" + text)
            types.append(gguf.TokenType.NORMAL)
    writer.add_token_type_count(int(getattr(cfg, "type_vocab_size", 1) or 1))
    writer.add_tokenizer_model("bert")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_bos_token_id(tok.cls_token_id)
    writer.add_eos_token_id(tok.sep_token_id)
    writer.add_sep_token_id(tok.sep_token_id)
    writer.add_unk_token_id(tok.unk_token_id)
    writer.add_pad_token_id(tok.pad_token_id)
    writer.add_mask_token_id(tok.mask_token_id)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(True)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, cfg.num_hidden_layers)
    for name, value in model.state_dict().items():
        if name.startswith("pooler.") or name.endswith("position_ids"):
            continue  # the [CLS] pooler's dense + tanh is not part of an embedding; ids are not weights
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise SystemExit(f"{folder}: no llama.cpp name for tensor {name!r}")
        _float_tensor(writer, gguf_name, value, float_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _quantized_or_float(writer, name: str, value, qtype: str):
    """A matrix written as `qtype` (gguf-py's quantizer: Q8_0, Q4_0, ...) where its rows are whole blocks,
    else F32, as llama.cpp's converter falls back; 1-D tensors F32. Returns the values the file holds."""
    import gguf
    import torch

    value = value.detach().float().contiguous()
    q = getattr(gguf.GGMLQuantizationType, qtype)
    block = gguf.GGML_QUANT_SIZES[q][0]
    if qtype in ("F32", "BF16") or value.dim() < 2 or value.shape[-1] % block:
        return _float_tensor(writer, name, value, "BF16" if qtype == "BF16" else "F32")
    blocks = gguf.quants.quantize(value.numpy(), q)
    writer.add_tensor(name, blocks, raw_dtype=q)
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(blocks, q), dtype=np.float32)).view(value.shape)


def write_deepseek2(path: str, model, qtype: str = "F32", split_kv_b: bool = True, donor: str | None = None) -> dict:
    """A `deepseek2` GGUF file from a transformers DeepseekV2 / V3 model (float), laid out as llama.cpp's
    converter (DeepseekV2Model) writes it: head_count_kv 1 and key / value lengths as the latent's MQA view
    with the heads' own sizes as `*_mla`, kv_b_proj split into `attn_k_b` (each head's W_UK transposed) and
    `attn_v_b` (`split_kv_b`; older converters kept `attn_kv_b` whole), expert stacks `ffn_*_exps`, shared
    experts `ffn_*_shexp`, V3's correction bias `exp_probs_b.bias`, YaRN's mscale_all_dim as 0.1 x it in
    `yarn_log_multiplier`; matrices in `qtype` where their rows are whole blocks; `donor`: a GGUF whose
    tokenizer is copied (its vocabulary size must be the model's), so llama.cpp can run the file. Returns
    the model's state dict with the values the file holds (quantization included), to load back into
    transformers."""
    import gguf
    import torch

    cfg = model.config
    arch = "deepseek2"
    v3 = cfg.model_type == "deepseek_v3"
    rope = dict(cfg.rope_parameters)
    writer = _hf_writer(path, arch, cfg)
    writer.add_head_count_kv(1)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    writer.add_expert_count(cfg.n_routed_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    if getattr(cfg, "n_group", None) is not None:
        writer.add_expert_group_count(cfg.n_group)
    if getattr(cfg, "topk_group", None) is not None:
        writer.add_expert_group_used_count(cfg.topk_group)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX)
    writer.add_leading_dense_block_count(cfg.first_k_dense_replace)
    writer.add_vocab_size(cfg.vocab_size)
    for key, value, kind in donor_tokenizer(donor) if donor else []:
        writer.add_array(key, value) if isinstance(value, list) else writer.add_key_value(key, value, kind)
    if cfg.q_lora_rank:
        writer.add_q_lora_rank(cfg.q_lora_rank)
    writer.add_kv_lora_rank(cfg.kv_lora_rank)
    writer.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    writer.add_value_length(cfg.kv_lora_rank)
    writer.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    writer.add_value_length_mla(cfg.v_head_dim)
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    writer.add_expert_shared_count(cfg.n_shared_experts or 0)
    writer.add_expert_weights_scale(float(cfg.routed_scaling_factor))
    if getattr(cfg, "norm_topk_prob", False):
        writer.add_expert_weights_norm(True)
    writer.add_rope_dimension_count(cfg.qk_rope_head_dim)
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
        if rope.get("beta_fast") is not None:
            writer.add_rope_scaling_yarn_beta_fast(float(rope["beta_fast"]))
        if rope.get("beta_slow") is not None:
            writer.add_rope_scaling_yarn_beta_slow(float(rope["beta_slow"]))
        if rope.get("mscale_all_dim") is not None:
            writer.add_rope_scaling_yarn_log_mul(0.1 * float(rope["mscale_all_dim"]))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    held = dict(state)

    def put(hf: str, name: str, value=None) -> None:
        held[hf] = _quantized_or_float(writer, name, state[hf] if value is None else value, qtype)

    put("model.embed_tokens.weight", "token_embd.weight")
    put("model.norm.weight", "output_norm.weight")
    if not cfg.tie_word_embeddings:
        put("lm_head.weight", "output.weight")
    parts = {
        "input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm",
        "self_attn.q_proj.weight": "attn_q", "self_attn.q_a_proj.weight": "attn_q_a",
        "self_attn.q_a_layernorm.weight": "attn_q_a_norm", "self_attn.q_b_proj.weight": "attn_q_b",
        "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa", "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm",
        "self_attn.o_proj.weight": "attn_output", "mlp.gate_proj.weight": "ffn_gate", "mlp.up_proj.weight": "ffn_up",
        "mlp.down_proj.weight": "ffn_down", "mlp.gate.weight": "ffn_gate_inp",
        "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp", "mlp.shared_experts.up_proj.weight": "ffn_up_shexp",
        "mlp.shared_experts.down_proj.weight": "ffn_down_shexp",
    }  # fmt: skip
    heads, nope, v_dim = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    for i in range(cfg.num_hidden_layers):
        hf, blk = f"model.layers.{i}.", f"blk.{i}."
        for part, gguf_part in parts.items():
            if hf + part not in state:
                continue
            if part == "mlp.gate.weight":  # the router stays F32, as llama.cpp keeps ffn_gate_inp
                held[hf + part] = _float_tensor(writer, blk + gguf_part + ".weight", state[hf + part], "F32")
            else:
                put(hf + part, blk + gguf_part + ".weight")
        if hf + "mlp.gate.e_score_correction_bias" in state:
            held[hf + "mlp.gate.e_score_correction_bias"] = _float_tensor(
                writer, blk + "exp_probs_b.bias", state[hf + "mlp.gate.e_score_correction_bias"], "F32")
        kv_b = state[hf + "self_attn.kv_b_proj.weight"]
        if split_kv_b:
            per_head = kv_b.view(heads, nope + v_dim, -1)
            k_b = _quantized_or_float(writer, blk + "attn_k_b.weight", per_head[:, :nope].transpose(1, 2), qtype)
            v_b = _quantized_or_float(writer, blk + "attn_v_b.weight", per_head[:, nope:], qtype)
            held[hf + "self_attn.kv_b_proj.weight"] = torch.cat((k_b.transpose(1, 2), v_b), 1).reshape(kv_b.shape)
        else:
            put(hf + "self_attn.kv_b_proj.weight", blk + "attn_kv_b.weight")
        experts = hf + "mlp.experts."
        if experts + "gate_up_proj" in state:  # transformers 5's stacks: [E, 2I, H] (gate rows, then up), [E, H, I]
            gate_up = state[experts + "gate_up_proj"]
            inter = gate_up.shape[1] // 2
            gate = _quantized_or_float(writer, blk + "ffn_gate_exps.weight", gate_up[:, :inter], qtype)
            up = _quantized_or_float(writer, blk + "ffn_up_exps.weight", gate_up[:, inter:], qtype)
            held[experts + "gate_up_proj"] = torch.cat((gate, up), dim=1)
            put(experts + "down_proj", blk + "ffn_down_exps.weight")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held


def main() -> None:
    from perfxlm.config import default_model_path

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="GGUF file to write")
    p.add_argument("--donor", default=None, 
                   help="GGUF whose tokenizer is copied (default: the embedded model)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--intermediate", type=int, default=8192)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--rope-theta", type=float, default=500000.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--experts", type=int, default=0, help="write a Qwen3-MoE (qwen3moe) body with this many "
                   "experts per layer, each of --intermediate")
    p.add_argument("--experts-used", type=int, default=8, help="with --experts: experts per token")
    p.add_argument("--head-dim", type=int, default=None, help="default hidden / heads (Qwen3-MoE: 128)")
    p.add_argument("--from-hf", default=None, help="convert this Hugging Face folder instead "
                   "(gpt-oss, DeepSeek-V2/V3, BERT)")
    p.add_argument("--float-type", default="F32", choices=("F32", "BF16"), help="with --from-hf: non-expert matrices")
    p.add_argument("--quant-type", default=None, help="with --from-hf of DeepSeek: matrices in this GGML type "
                   "(Q8_0, Q4_0, ...) where their rows are whole blocks")
    p.add_argument("--whole-kv-b", action="store_true", help="with --from-hf of DeepSeek: attn_kv_b unsplit, "
                   "as older llama.cpp converters wrote it")
    a = p.parse_args()
    if a.from_hf:
        import transformers

        if transformers.AutoConfig.from_pretrained(a.from_hf).model_type == "bert":
            write_bert(a.out, a.from_hf, a.float_type)
            print(f"wrote {a.out}")
            return
        model = transformers.AutoModelForCausalLM.from_pretrained(a.from_hf, dtype="float32")
        if model.config.model_type in ("deepseek_v2", "deepseek_v3"):
            donor = a.donor if a.donor or model.config.vocab_size != 49152 else default_model_path()
            write_deepseek2(a.out, model, a.quant_type or a.float_type, split_kv_b=not a.whole_kv_b, donor=donor)
        elif model.config.model_type == "gpt_oss":
            write_gpt_oss(a.out, model, a.float_type)
        else:
            p.error(f"--from-hf converts gpt-oss, DeepSeek-V2/V3 and BERT checkpoints; {a.from_hf} is "
                    f"{model.config.model_type!r}")
        print(f"wrote {a.out}")
        return
    donor = a.donor or default_model_path()
    write_dummy(a.out, donor, a.hidden, a.layers, a.intermediate, a.heads, a.kv_heads, a.context, a.rope_theta,
                a.seed, a.experts, a.experts_used, a.head_dim)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()

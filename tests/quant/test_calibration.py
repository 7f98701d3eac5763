"""Activation-aware int4: the calibration statistics (perfxlm.quant.calibration) against transformers' own
activations, the options' errors, and the engine: int4 closer to the float model than Q4_0's rule."""

from __future__ import annotations

import pytest
import torch

from perfxlm import LLM, SamplingParams
from perfxlm.quant import QuantizationConfig, QuantizedWeight
from perfxlm.quant.mixed import layer_of, use_more_bits
from perfxlm.quant.calibration import ChannelStats, calibration_ids, calibration_text, collect
from tests.conftest import make_llama_checkpoint

TEXT = "The quick brown fox jumps over the lazy dog. " * 40


def add_byte_tokenizer(path: str) -> None:
    """A tokenizer with one token per byte (ids 0..255) saved beside the checkpoint, as a real model's is."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = make_llama_checkpoint(str(tmp_path_factory.mktemp("calib_llama")), seed=3)
    add_byte_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("calib_text") / "text.txt"
    path.write_text(TEXT, encoding="utf-8")
    return str(path)


def test_channel_stats_are_mean_squares():
    lin = torch.nn.Linear(4, 2)
    stats = ChannelStats({"lin.weight": lin})
    a, b = torch.randn(3, 4), torch.randn(2, 5, 4)
    lin(a)
    lin(b)
    stats.remove()
    lin(torch.full((1, 4), 100.0))  # after remove: not recorded
    want = torch.cat([a, b.reshape(-1, 4)]).square().mean(dim=0)
    torch.testing.assert_close(stats.mean_squares()["lin.weight"], want)


@pytest.mark.parametrize("weights", ["none", "int8"])
def test_statistics_match_transformers_activations(tiny, text_file, weights):
    """Every projection's statistic is the mean square of its input in the float model (transformers'):
    to float rounding when the calibration model is float, within int8's error as it is by default
    (on this random model, whose activations amplify errors more than a trained one's). The fused
    weights get their shared input's."""
    from transformers import AutoModelForCausalLM

    from perfxlm.model.loader import load_hf_config

    ids = calibration_ids(calibration_text(text_file), tiny, 200)
    assert len(ids) == 200 and max(ids) < 256
    from perfxlm.model.loader import get_model

    config = load_hf_config(tiny)
    load = lambda w: get_model(tiny, config, torch.float32, "safetensors", quantization=w)  # noqa: E731
    stats = collect(load, config, ids, weights={"method": weights})
    hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    seen: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in hf.named_modules():
        if name.endswith(("q_proj", "o_proj", "gate_proj", "down_proj")):
            def record(_m, args, name=name):
                seen[name] = args[0].reshape(-1, args[0].shape[-1]).square().mean(0)
            hooks.append(module.register_forward_pre_hook(record))
    with torch.no_grad():
        hf(torch.tensor([ids]))
    ours = {"q_proj": "self_attn.qkv_proj", "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_up_proj",
            "down_proj": "mlp.down_proj"}  # fmt: skip
    assert set(stats) == {f"model.layers.{i}.{v}.weight" for i in range(3) for v in ours.values()}
    for name, want in seen.items():
        prefix, proj = name.rsplit(".", 1)
        layer = prefix.rsplit(".", 1)[0]  # model.layers.i
        got = stats[f"{layer}.{ours[proj]}.weight"]
        if weights == "none":
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6 * float(want.max()))
        else:
            torch.testing.assert_close(got, want, rtol=0.2, atol=1e-3 * float(want.max()))
            assert ((got - want).abs().sum() / want.sum()) < 0.02  # 2 % over all channels


def test_bad_calibration_values_are_clear_errors(tiny, tmp_path):
    with pytest.raises(ValueError, match=r"calibration='/no/such/text.txt': no such file. Supported: the path"):
        LLM(tiny, skip_tokenizer_init=True,
            quantization={"method": "int4", "calibration": "/no/such/text.txt"})
    with pytest.raises(ValueError, match=r"calibration with symmetric int4"):
        QuantizationConfig.resolve({"method": "int4", "symmetric": True, "calibration": "default"})
    with pytest.raises(ValueError, match=r"calibration with w8a8: supported with int4 and nf4"):
        QuantizationConfig.resolve({"method": "w8a8", "calibration": "default"})
    with pytest.raises(ValueError, match=r"calibration_tokens=4: expected an integer >= 16"):
        QuantizationConfig.resolve({"method": "int4", "calibration": "default", "calibration_tokens": 4})
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\xff\xfe\x00 not text")
    with pytest.raises(ValueError, match=r"is not UTF-8 text"):
        calibration_text(str(binary))
    short = tmp_path / "short.txt"
    short.write_text("Hi.")
    with pytest.raises(ValueError, match=r"calibration text has 3 tokens; supported: at least 16"):
        calibration_ids(calibration_text(str(short)), tiny, 512)
    no_tokenizer = make_llama_checkpoint(str(tmp_path / "bare"), seed=1)
    with pytest.raises(ValueError, match=r"tokenizes its text with the tokenizer stored with the model"):
        calibration_ids(TEXT, no_tokenizer, 512)


def test_builtin_text_is_shipped_and_the_default(tiny, tmp_path, caplog):
    assert len(calibration_text("default")) > 4000
    c = QuantizationConfig.resolve("int4")
    assert c.calibration == "default" and not c.calibration_explicit
    assert QuantizationConfig.resolve({"method": "int4", "calibration": False}).calibration is None
    # no tokenizer: the default goes calibration-free with a warning, a named text is an error
    bare = make_llama_checkpoint(str(tmp_path / "bare"), seed=1)
    with caplog.at_level("WARNING", logger="perfxlm"):
        LLM(bare, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=16, quantization="int4")
    assert "calibration-free, as the built-in calibration text cannot be used here" in caplog.text
    with pytest.raises(ValueError, match=r"tokenizes its text with the tokenizer stored with the model"):
        LLM(bare, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=16,
            quantization={"method": "int4", "calibration": "default"})


def logits_of(path: str, quantization) -> torch.Tensor:
    from perfxlm.model.forward_context import AttentionMetadata, PrefillSeq, set_forward_context
    from perfxlm.model.loader import get_model, load_hf_config
    from perfxlm.worker.model_runner import ModelRunner

    model = get_model(path, load_hf_config(path), torch.float32, "safetensors", quantization=quantization)
    ModelRunner(model, num_blocks=4, block_size=16, dtype=torch.float32)
    ids = torch.tensor(calibration_ids(TEXT, path, 48))
    meta = AttentionMetadata(torch.arange(48), 0, None, None, None, [PrefillSeq(0, 48, 0, torch.arange(3))])
    with torch.inference_mode(), set_forward_context(meta):
        return model.compute_logits(model(ids, torch.arange(48)))


def test_int4_is_closer_to_the_float_model_than_q4_0s_rule(tiny, text_file):
    ref = logits_of(tiny, None)
    err = {}
    for name, q in {"q4_0 rule": {"method": "int4", "symmetric": True},
                    "int4": {"method": "int4", "calibration": False},
                    "int4 calibrated": {"method": "int4", "calibration": text_file}}.items():  # fmt: skip
        err[name] = (logits_of(tiny, q) - ref).square().mean().item()
    assert err["int4"] < 0.8 * err["q4_0 rule"], err
    assert err["int4 calibrated"] < 0.8 * err["q4_0 rule"], err


def test_engine_generates_with_calibration_and_mixed_precision(tiny, text_file):
    llm = LLM(tiny, dtype="float32", num_kv_blocks=64,
              quantization={"method": "int4", "calibration": text_file, "mixed_precision": True})  # fmt: skip
    out = llm.generate(["The quick brown"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
    model = llm.llm_engine.core.model
    weights = {f"{n}.{a}": v for n, m in model.named_modules() for a, v in vars(m).items()
               if isinstance(v, QuantizedWeight)}  # fmt: skip
    # Q4_K_M's allocation: the tiny model's input sizes are not multiples of 256, so every projection
    # takes Q5_0's 5-bit form but the QKV holding a V that Q4_K_M widens (Q8_0 there and here); the LM
    # head takes int4's head form (`head_bits` 6: Q6_K's codes), and so does the embedding table where the
    # head is tied to it
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    layers = model.config.num_hidden_layers
    wide = {n for n in weights if "qkv" in n and use_more_bits(layer_of(n), layers)}
    eight = {n for n, w in weights.items() if w.bits == 8}
    head = {"model.embed_tokens.weight", "lm_head.weight"} if tied else {"lm_head.weight"}
    assert wide and eight == wide
    assert {n for n, w in weights.items() if w.bits == 6} == head
    if not tied:  # a table only looked up: Q4_K_M's token_embd, 4-bit
        assert weights["model.embed_tokens.weight"].bits == 4
    assert all(w.bits == 5 and w.centred for n, w in weights.items() if "layers" in n and n not in wide)

"""Bad adapters and bad LoRA arguments: a clear ValueError before anything runs, other requests and the
KV pool untouched."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from perfxlm import LLM, LoRARequest, SamplingParams
from perfxlm.engine.kv_cache_manager import block_digest
from tests.conftest import assert_pool_whole, make_llama_checkpoint
from tests.lora.conftest import make_adapter


@pytest.fixture(scope="module")
def llm(lora_base):
    return LLM(lora_base, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64, enable_lora=True,
               max_loras=2, max_lora_rank=8)


def generate(llm, lora, prompt=(5, 6, 7)):
    return llm.generate({"prompt_token_ids": list(prompt)}, SamplingParams(max_tokens=3), use_tqdm=False,
                        lora_request=lora)


def _fails_alone(llm, lora, match):
    """The bad adapter fails the whole call before any request is queued; a good request still runs."""
    with pytest.raises(ValueError, match=match):
        llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [7, 8]}], SamplingParams(max_tokens=2),
                     use_tqdm=False, lora_request=[None, lora])
    assert len(generate(llm, None)[0].outputs[0].token_ids) == 3
    assert_pool_whole(llm)


def test_rank_above_max_lora_rank(llm, lora_base, tmp_path):
    path = make_adapter(lora_base, str(tmp_path / "r9"), seed=4, r=9, targets=("q_proj",))
    _fails_alone(llm, LoRARequest("r9", 9, path), r"rank 9, more than max_lora_rank \(8\)")


def test_rank_pattern_above_max_lora_rank(llm, lora_base, tmp_path):
    path = make_adapter(lora_base, str(tmp_path / "rp"), seed=4, r=2, targets=("q_proj", "o_proj"),
                        rank_pattern={"o_proj": 12})
    _fails_alone(llm, LoRARequest("rp", 10, path), r"rank 12, more than max_lora_rank")


def test_adapter_of_another_base_model(llm, tmp_path):
    other = make_llama_checkpoint(str(tmp_path / "other"), hidden_size=64, intermediate_size=128,
                                  num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
    path = make_adapter(other, str(tmp_path / "other_ad"), seed=5, r=2)
    _fails_alone(llm, LoRARequest("other", 11, path), r"trained for another base model")


def test_target_module_the_model_lacks(llm, lora_base, tmp_path):
    path = make_adapter(lora_base, str(tmp_path / "emb"), seed=6, r=2, targets=("q_proj",))
    tensors_file = os.path.join(path, "adapter_model.safetensors")
    from safetensors.torch import load_file, save_file

    tensors = load_file(tensors_file)
    renamed = {k.replace("layers.0.", "layers.7."): v for k, v in tensors.items()}  # the model has 3 layers
    save_file(renamed, tensors_file)
    _fails_alone(llm, LoRARequest("deep", 12, path), r"targets 'model.layers.7.self_attn.q_proj', which is not")


def test_unsupported_peft_features(llm, lora_base, tmp_path):
    path = make_adapter(lora_base, str(tmp_path / "emb"), seed=6, r=2, targets=("embed_tokens",))
    _fails_alone(llm, LoRARequest("emb", 13, path), r"not a LoRA A or B weight of a linear projection")
    dora = make_adapter(lora_base, str(tmp_path / "dora"), seed=6, r=2, targets=("q_proj",), use_dora=True)
    _fails_alone(llm, LoRARequest("dora", 14, dora), r"DoRA adapters are not supported")


def test_missing_folder_and_files(llm, lora_base, tmp_path):
    _fails_alone(llm, LoRARequest("gone", 15, str(tmp_path / "nowhere")), r"does not exist")
    empty = tmp_path / "empty"
    empty.mkdir()
    _fails_alone(llm, LoRARequest("empty", 16, str(empty)), r"has no adapter_config.json")
    no_weights = make_adapter(lora_base, str(tmp_path / "nw"), seed=7, r=2, targets=("q_proj",))
    os.remove(os.path.join(no_weights, "adapter_model.safetensors"))
    _fails_alone(llm, LoRARequest("nw", 17, no_weights), r"has no adapter_model.safetensors")
    bad_json = make_adapter(lora_base, str(tmp_path / "bj"), seed=7, r=2, targets=("q_proj",))
    with open(os.path.join(bad_json, "adapter_config.json"), "w") as f:
        f.write("{not json")
    _fails_alone(llm, LoRARequest("bj", 18, bad_json), r"cannot read the adapter's config")


def test_bad_arguments(llm, lora_base):
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("x", 0, "/some/path")
    with pytest.raises(ValueError, match="must be a perfxlm.lora.request.LoRARequest"):
        generate(llm, "adapter-a")
    with pytest.raises(ValueError, match="2 lora_requests for 1 prompts"):
        llm.generate({"prompt_token_ids": [5]}, use_tqdm=False, lora_request=[None, None])
    with pytest.raises(ValueError, match="max_cpu_loras must be an integer >= max_loras"):
        LLM(lora_base, skip_tokenizer_init=True, enable_lora=True, max_loras=3, max_cpu_loras=2)
    with pytest.raises(ValueError, match="lora_dtype='float16' is not supported"):
        LLM(lora_base, skip_tokenizer_init=True, enable_lora=True, lora_dtype="float16")
    with pytest.raises(ValueError, match="enable_lora runs in one process"):
        LLM(lora_base, skip_tokenizer_init=True, enable_lora=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="max_lora_rank must be an integer >= 1"):
        LLM(lora_base, skip_tokenizer_init=True, enable_lora=True, max_lora_rank=0)
    assert_pool_whole(llm)


def test_lora_request_without_enable_lora(lora_base, adapters):
    plain = LLM(lora_base, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=32)
    with pytest.raises(ValueError, match="pass enable_lora=True"):
        generate(plain, LoRARequest("a", 1, adapters["a"]))
    assert_pool_whole(plain)


def test_cpu_cache_is_lru_bounded(lora_base, adapters):
    llm = LLM(lora_base, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=32, enable_lora=True,
              max_loras=1, max_cpu_loras=2, max_lora_rank=8)
    registry = llm.llm_engine.loras
    for i, key in ((1, "a"), (2, "b"), (1, "a"), (3, "c")):
        generate(llm, LoRARequest(key, i, adapters[key]))
    assert registry.loaded_ids() == [1, 3] and registry.num_loads == 3  # "a" reused, "b" dropped
    assert_pool_whole(llm)


def test_block_digest_separates_adapters():
    tokens = list(range(16))
    digests = {block_digest(None, tokens), block_digest(None, tokens, adapter="lora\x1f1"),
               block_digest(None, tokens, adapter="lora\x1f2"), block_digest(None, tokens, cache_salt="lora\x1f1")}
    assert len(digests) == 4

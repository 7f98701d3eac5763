"""What LoRA A and B are stored in (lora_dtype): float32 beside float32 base weights, bfloat16 beside bf16
ones, int8 beside quantized ones. bf16 adapters are exactly the checkpoint's values rounded to bf16,
int8 ones the values of their codes (a scale per row of A and per column of B), summed in float32:
greedy output equals peft's with the adapter rounded the same way, and the fused decode layer gives what
the module path gives."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from perfxlm import LLM, LoRARequest, SamplingParams
from perfxlm.lora.config import LoRAConfig
from tests.conftest import assert_pool_whole
from tests.lora.conftest import peft_greedy
from tests.lora.test_lora_vs_peft import _assert_same, prompts_of


def _int8_values(name: str, w: torch.Tensor) -> torch.Tensor:
    """What int8 storage keeps of a lora_A [r, in] (per row) or lora_B [out, r] (per column) weight."""
    rows = w if "lora_A" in name else w.T
    scale = rows.abs().amax(dim=1).clamp_min(1e-30) / 127
    kept = torch.round(rows / scale[:, None]).clamp_(-127, 127) * scale[:, None]
    return kept if "lora_A" in name else kept.T


_ROUNDED = {"bfloat16": lambda name, w: w.bfloat16().float(), "int8": _int8_values}


def _rounded_copy(adapter: str, path: str, dtype: str) -> str:
    """The adapter folder with every tensor rounded as `dtype` storage rounds it (stored back as float32)."""
    from safetensors.torch import load_file, save_file

    os.makedirs(path, exist_ok=True)
    shutil.copy(os.path.join(adapter, "adapter_config.json"), path)
    tensors = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    save_file({k: _ROUNDED[dtype](k, v.float()).contiguous() for k, v in tensors.items()},
              os.path.join(path, "adapter_model.safetensors"))
    return path


def _slots(llm):
    return llm.llm_engine.core.runner.lora_slots


def test_storage_dtype_follows_the_base_weights():
    auto = LoRAConfig()
    assert auto.storage_dtype(torch.float32) == torch.float32
    assert auto.storage_dtype(torch.bfloat16) == torch.bfloat16
    assert auto.storage_dtype(torch.bfloat16, quantized=True) == torch.int8
    assert auto.storage_dtype(torch.float32, quantized=True) == torch.float32  # dtype="float32": exact
    assert LoRAConfig(dtype="bfloat16").storage_dtype(torch.bfloat16, quantized=True) == torch.bfloat16
    assert LoRAConfig(dtype="float32").storage_dtype(torch.bfloat16) == torch.float32
    assert LoRAConfig(dtype=torch.bfloat16).storage_dtype(torch.float32) == torch.bfloat16  # vLLM takes dtypes too
    assert LoRAConfig(dtype="int8").storage_dtype(torch.float32) == torch.int8
    with pytest.raises(ValueError, match="lora_dtype='float16' is not supported: adapters are stored in float32, bfloat16 or int8"):
        LoRAConfig(dtype="float16")


@pytest.mark.parametrize("lora_dtype,stored", [("bfloat16", torch.bfloat16), ("int8", torch.uint8)])
def test_narrow_adapters_match_peft_rounded_and_the_module_path(lora_base, adapters, tmp_path, lora_dtype, stored):
    llm = LLM(lora_base, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64, enable_lora=True,
              max_loras=2, max_lora_rank=8, lora_dtype=lora_dtype)
    a, b = LoRARequest("a", 1, adapters["a"]), LoRARequest("b", 2, adapters["b"])
    prompts = prompts_of((7, 16, 3), seed=8)
    loras = [a, None, b]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)

    def outputs():
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in got]

    fused = outputs()
    packed = [w.packed for w in _slots(llm).wrappers if w.packed is not None]
    assert packed and all(p.kernel_a.dtype == p.kernel_bt.dtype == stored for p in packed)
    rounded = {k: _rounded_copy(adapters[k], str(tmp_path / k), lora_dtype) for k in ("a", "b")}
    for prompt, lora, (tokens, _) in zip(prompts, loras, fused):
        assert tokens == peft_greedy(lora_base, rounded[lora.lora_name] if lora else None, prompt, 12), lora
    llm.llm_engine.core.model.model.fused_decode.eligible = False  # the module path
    # the same adapter values on both paths; only float32 summation order differs (the portable tier's
    # sequential sums drift up to ~1e-4 in 12 steps of this random model)
    _assert_same(fused, outputs(), f"{lora_dtype} adapters, fused vs module path", tolerance=5e-4)
    assert_pool_whole(llm)


def test_auto_stores_int8_beside_quantized_weights(lora_base, adapters):
    llm = LLM(lora_base, skip_tokenizer_init=True, quantization="int8", num_kv_blocks=48, enable_lora=True,
              max_lora_rank=8)
    out = llm.generate({"prompt_token_ids": [5, 9, 11]}, SamplingParams(max_tokens=3), use_tqdm=False,
                       lora_request=LoRARequest("a", 1, adapters["a"]))[0]
    assert len(out.outputs[0].token_ids) == 3
    assert _slots(llm).storage_dtype == torch.int8
    bf16 = LLM(lora_base, skip_tokenizer_init=True, dtype="bfloat16", num_kv_blocks=48, enable_lora=True)
    assert _slots(bf16).storage_dtype == torch.bfloat16
    exact = LLM(lora_base, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=48, enable_lora=True)
    assert _slots(exact).storage_dtype == torch.float32


def _scored(llm, sequence, start, lora):
    """Each continuation token's log-probability, teacher-forced (the same context under every storage)."""
    out = llm.generate({"prompt_token_ids": sequence}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False, lora_request=lora)[0]
    return torch.tensor([out.prompt_logprobs[i][sequence[i]].logprob for i in range(start, len(sequence))])


def test_int8_adapters_stay_close_to_peft(lora_base, adapters):
    """int8 and bf16 storage against float32 adapters (peft's output, tested above), scored on peft's own
    greedy continuation: the mean change of a token's log-probability stays under 5 % (int8) and 1 %
    (bf16) of the mean change the adapter itself makes (measured on this random model, whose large weights
    amplify any change: 2.3 % and 0.55 %; the README gives the default model's figures)."""
    prompt = prompts_of((11,), seed=4)[0]
    sequence = prompt + peft_greedy(lora_base, adapters["a"], prompt, 24)
    lora = LoRARequest("a", 1, adapters["a"])
    scores = {}
    for dtype in ("float32", "int8", "bfloat16"):
        llm = LLM(lora_base, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=32, enable_lora=True,
                  max_lora_rank=8, lora_dtype=dtype)
        scores[dtype] = _scored(llm, sequence, len(prompt), lora)
        if dtype == "float32":
            scores["none"] = _scored(llm, sequence, len(prompt), None)
    moved = {k: (v - scores["float32"]).abs().mean().item() for k, v in scores.items()}
    assert moved["none"] > 1  # the adapter matters, so the bounds below mean something
    assert 0 < moved["int8"] < 0.05 * moved["none"], moved
    assert 0 < moved["bfloat16"] < 0.01 * moved["none"], moved

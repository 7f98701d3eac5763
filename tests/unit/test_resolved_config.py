"""The engine's decisions, frozen once by EngineConfig.resolve(): every `auto` decided, the value
immutable, what the loader and runners build from, and one start-up log line."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from perfxlm import LLM, SamplingParams
from perfxlm.config import EngineConfig
from perfxlm.ops import cpu_plan


def test_every_auto_is_decided_and_the_value_is_frozen(tiny_llama):
    c = EngineConfig(model=tiny_llama, dtype="auto", kv_cache_dtype="int8", block_size=32, quantization="int4",
                     skip_tokenizer_init=True).resolve()  # fmt: skip
    r = c.resolved
    assert r.compute_dtype in (torch.float32, torch.bfloat16) and r.compute_dtype == c.torch_dtype
    assert r.weight_dtype == c.weight_dtype
    assert r.kv_cache_spec.name == "int8" and r.block_size == 32 and r.load_format == "safetensors"
    assert r.quantized_source == "int4" and r.quant_activations == c.quant_activation_mode
    assert r.cpu_plan == cpu_plan.plan() and r.isa == cpu_plan.plan().isa
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.block_size = 16  # type: ignore[misc]
    line = r.describe()
    for part in ("kv_cache_dtype=int8", "block_size=32", f"isa={r.isa}", "quantization=int4", "load_format=safetensors"):
        assert part in line


def test_the_plan_in_force_at_resolve_is_the_one_recorded(tiny_llama):
    previous = cpu_plan.use(native_max_rows=7)
    try:
        r = EngineConfig(model=tiny_llama, skip_tokenizer_init=True).resolve().resolved
    finally:
        cpu_plan.use(previous)
    assert r.cpu_plan.native_max_rows == 7  # a value: putting the previous plan back does not change it


def test_loading_needs_the_resolved_value(tiny_llama):
    from perfxlm.model.loader import load_model

    with pytest.raises(ValueError, match="call config.resolve"):
        load_model(EngineConfig(model=tiny_llama))


def test_the_engine_logs_its_config_once_at_start(tiny_llama, caplog):
    with caplog.at_level(logging.INFO, logger="perfxlm"):
        llm = LLM(tiny_llama, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=16, block_size=8)
    lines = [r.getMessage() for r in caplog.records if "Initializing a perfxlm engine with config" in r.getMessage()]
    assert len(lines) == 1
    assert f"model={tiny_llama}" in lines[0] and "dtype=float32" in lines[0] and "block_size=8" in lines[0]
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True,
                                                                        detokenize=False), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3

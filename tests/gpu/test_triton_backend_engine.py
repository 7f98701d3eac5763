"""The engine with every attention layer on the Triton backend: greedy text identical to the CPU backend's,
through the real scheduler (prefill chunks over cached context, batched decodes, prefix-cache hits)."""

from __future__ import annotations

import os

import pytest

from perfxlm import LLM, SamplingParams
from perfxlm.model.layers import attention_backend
from tests.conftest import make_llama_checkpoint

# The engine runs on CPU tensors: the Triton kernels run there in Triton's interpreter.
needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the CPU engine runs Triton kernels only in its interpreter"
)

PROMPTS = [[1, 5, 9, 33, 2 + i, 17, 80, 41, 7, 3, 9, 11, 250, 31, 64, 8, 5, 99][: 6 + 3 * i] for i in range(4)]


def _generate(path, backend, monkeypatch, **engine):
    monkeypatch.setenv("PERFXLM_ATTENTION_BACKEND", backend)
    attention_backend.requested.cache_clear()
    try:
        llm = LLM(path, dtype="float32", max_num_batched_tokens=16, block_size=4, skip_tokenizer_init=True, **engine)
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        layers = [m for m in llm.llm_engine.core.executor.runner.model.modules() if hasattr(m, "backend")]
        assert layers and all(m.backend.name == backend for m in layers)
        return [o.outputs[0].token_ids for o in outs]
    finally:
        attention_backend.requested.cache_clear()


@needs_interpreter
@pytest.mark.parametrize("engine", [{}, {"kv_cache_dtype": "int8"}], ids=["float", "int8-kv"])
def test_greedy_tokens_match_cpu_backend(tmp_path, monkeypatch, engine):
    path = make_llama_checkpoint(str(tmp_path / "llama"), hidden_size=64, intermediate_size=96,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    want = _generate(path, "cpu", monkeypatch, **engine)
    got = _generate(path, "triton", monkeypatch, **engine)
    assert got == want


def test_unknown_backend_is_named(monkeypatch):
    import torch

    monkeypatch.setenv("PERFXLM_ATTENTION_BACKEND", "flash")
    attention_backend.requested.cache_clear()
    try:
        with pytest.raises(ValueError, match="PERFXLM_ATTENTION_BACKEND must be one of auto, cpu, triton; got 'flash'"):
            attention_backend.for_device(torch.device("cpu"))
    finally:
        attention_backend.requested.cache_clear()

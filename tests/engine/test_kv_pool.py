"""KV pool sizing: from memory when not given, max_model_len fitted to one sequence, lazy pages."""

from __future__ import annotations

import logging

import pytest
import torch

from perfxlm import LLM, SamplingParams
from perfxlm.engine import kv_pool
from perfxlm.worker.kv_memory import lazy_zeros
from tests.conftest import assert_pool_whole, make_llama_checkpoint


@pytest.fixture(scope="module")
def long_context_llama(tmp_path_factory) -> str:
    return make_llama_checkpoint(str(tmp_path_factory.mktemp("long_llama")), max_position_embeddings=131072)


def test_default_pool_is_bounded_by_available_memory(monkeypatch):
    monkeypatch.setattr(kv_pool, "available_memory_bytes", lambda: 64 << 20)
    # 32 MiB of 1 MiB blocks, though 256 seats x 8192 tokens could use far more
    assert kv_pool.plan_num_blocks(1 << 20, 16, 256, 8192) == 32
    # and never more than the seats could fill
    assert kv_pool.plan_num_blocks(1024, 16, 2, 64) == 8
    # explicit settings win
    assert kv_pool.plan_num_blocks(1 << 20, 16, 256, 8192, kv_cache_gib=0.125) == 128
    assert kv_pool.plan_num_blocks(1 << 20, 16, 256, 8192, num_kv_blocks=5) == 5
    with pytest.raises(ValueError, match="kv_cache_gib"):
        kv_pool.plan_num_blocks(1 << 20, 16, 256, 8192, kv_cache_gib=-1)


def test_long_context_model_is_clamped_and_serves_default_max_tokens(long_context_llama, caplog):
    # a pool of 64 blocks x 16 tokens cannot hold one 131072-token sequence: the default is lowered, loudly
    with caplog.at_level(logging.WARNING, logger="perfxlm"):
        llm = LLM(long_context_llama, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64)
    cfg = llm.llm_engine.config
    assert llm.llm_engine.resolved.max_model_len == llm.llm_engine.num_kv_blocks * cfg.block_size == 1024
    assert "max_model_len lowered from the model's 131072 to 1024" in caplog.text
    assert cfg.max_model_len == cfg.resolved.max_model_len == 131072  # the user's config is not rewritten
    # max_tokens=None fills the context, as the chat endpoint's default does: it must be accepted
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=None, ignore_eos=True), use_tqdm=False)
    assert len(out[0].prompt_token_ids) + len(out[0].outputs[0].token_ids) == 1024
    assert_pool_whole(llm)


def test_long_context_model_with_default_settings_starts(long_context_llama):
    llm = LLM(long_context_llama, skip_tokenizer_init=True, dtype="float32")
    cfg = llm.llm_engine.config
    assert 1 <= llm.llm_engine.resolved.max_model_len <= llm.llm_engine.num_kv_blocks * cfg.block_size
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_explicit_max_model_len_that_cannot_fit_fails_at_start(tiny_llama):
    with pytest.raises(ValueError, match=r"max_model_len=512 .* holds 128 tokens"):
        LLM(tiny_llama, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=8, max_model_len=512)


def test_lazy_pool_reads_zero_and_commits_only_written_pages():
    def rss() -> int:
        with open("/proc/self/status") as f:
            return int(f.read().split("VmRSS:")[1].split()[0]) * 1024

    before = rss()
    t = lazy_zeros((4096, 16, 8, 64), torch.float32)  # 128 MiB of address space
    assert t.is_contiguous() and t.shape == (4096, 16, 8, 64)
    assert t[::512].abs().sum().item() == 0.0
    assert rss() - before < 32 << 20
    t[:64].fill_(1.0)
    assert t[:64].sum().item() == 64 * 16 * 8 * 64

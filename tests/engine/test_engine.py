"""End-to-end engine behaviour on the real default model (float32) and small random checkpoints."""

import pytest
import torch

from perfxlm import LLM, SamplingParams
from tests.conftest import assert_pool_whole

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _prompts(n: int) -> list[str]:
    topics = ["the ocean", "a robot", "Paris", "mathematics", "a cat", "the moon", "music", "bread"]
    out = []
    for i in range(n):
        words = " ".join(["very"] * (i % 7))
        out.append(f"Write a {words} short story about {topics[i % len(topics)]} number {i}:")
    return out


def test_quickstart_program(smollm_fp32):
    prompts = ["Hello, my name is", "The president of the United States is",
               "The capital of France is", "The future of AI is"]
    outputs = smollm_fp32.generate(prompts, SamplingParams(temperature=0.8, top_p=0.95))
    assert [o.prompt for o in outputs] == prompts
    for o in outputs:
        c = o.outputs[0]
        assert o.finished and c.finish_reason in ("stop", "length")
        assert len(c.token_ids) <= 16 and (c.text.strip() or c.finish_reason == "stop")
    assert_pool_whole(smollm_fp32)


def test_greedy_capital_of_france(smollm_fp32):
    out = smollm_fp32.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8))[0]
    assert "Paris" in out.outputs[0].text


def test_batch_invariance_32_prompts(smollm_fp32):
    # 8 tokens: each of the 32 batch-1 runs (the cost: 32 x a step's weight reads) ends past the prompt's
    # KV block, as 16 did; every decode step of the batch is the same 32-row step, so steps 9-16 checked
    # no row path that steps 1-8 do not
    prompts = _prompts(32)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    together = smollm_fp32.generate(prompts, params, use_tqdm=False)
    smollm_fp32.llm_engine.kv_cache_manager.reset_prefix_cache()
    for prompt, out in zip(prompts, together):
        alone = smollm_fp32.generate(prompt, params, use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids, prompt
    assert_pool_whole(smollm_fp32)


def test_tiny_kv_pool_preempts_and_still_matches(default_model, smollm_fp32):
    # 16 tokens (32 before): prompts of 24-31 tokens take 2 KV blocks and grow into a 3rd, so two running
    # requests still outgrow the pool (5 blocks) and each pair preempts one, which is recomputed from its
    # prompt and the tokens it had: the same paths at half the decode steps of both engines
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [p + " Once upon a time, in a land far away, there lived" for p in _prompts(16)]
    ref = smollm_fp32.generate(prompts, params, use_tqdm=False)
    longest = max(len(o.prompt_token_ids) for o in ref) + params.max_tokens
    num_blocks = -(-longest // 16) + 2  # just above one request's need
    llm = LLM(default_model, dtype="float32", num_kv_blocks=num_blocks)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
    for r, o in zip(ref, outs):
        assert len(o.outputs[0].token_ids) == params.max_tokens
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
    assert_pool_whole(llm)


def test_prefix_caching_reports_hits_and_same_output(smollm_fp32):
    smollm_fp32.llm_engine.kv_cache_manager.reset_prefix_cache()
    shared = "You are a helpful assistant. " * 12
    first = smollm_fp32.generate(shared + "Tell me about cats.", GREEDY, use_tqdm=False)[0]
    second = smollm_fp32.generate(shared + "Tell me about cats.", GREEDY, use_tqdm=False)[0]
    other = smollm_fp32.generate(shared + "Tell me about dogs.", GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens > 0 and other.num_cached_tokens >= 64
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert_pool_whole(smollm_fp32)


def test_prefix_caching_can_be_disabled(tiny_llama):
    llm = LLM(tiny_llama, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64, enable_prefix_caching=False)
    p = {"prompt_token_ids": list(range(3, 60))}
    llm.generate([p], GREEDY, use_tqdm=False)
    assert llm.generate([p], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0
    assert_pool_whole(llm)


def test_chunked_prefill_gives_same_tokens(tiny_llama):
    prompts = [{"prompt_token_ids": torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(n)).tolist()}
               for n in (5, 70, 130)]
    big = LLM(tiny_llama, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64)
    small = LLM(tiny_llama, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16)
    a = big.generate(prompts, GREEDY, use_tqdm=False)
    b = small.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert_pool_whole(small)


def test_too_long_request_is_refused_and_others_run(tiny_llama):
    llm = LLM(tiny_llama, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=8, max_model_len=128)
    ok = {"prompt_token_ids": [5, 6, 7]}
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([ok, {"prompt_token_ids": [5] * 250}], SamplingParams(max_tokens=10), use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([{"prompt_token_ids": [5] * 120}], SamplingParams(max_tokens=10), use_tqdm=False)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([{"prompt_token_ids": [5, 100000]}], use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([{"prompt_token_ids": []}], use_tqdm=False)
    assert_pool_whole(llm)
    out = llm.generate([ok], SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 10 and out.outputs[0].finish_reason == "length"


def test_stop_strings_and_stop_token_ids(smollm_fp32):
    base = smollm_fp32.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=20))[0]
    text, ids = base.outputs[0].text, base.outputs[0].token_ids
    stop_word = text.split()[2]
    out = smollm_fp32.generate("The capital of France is",
                               SamplingParams(temperature=0, max_tokens=20, stop=[stop_word]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_word
    assert out.text == text[: text.index(stop_word)]
    out = smollm_fp32.generate("The capital of France is",
                               SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[ids[3]]))[0].outputs[0]
    first = ids.index(ids[3])
    assert out.finish_reason == "stop" and out.stop_reason == ids[3] and out.token_ids == ids[: first + 1]
    assert_pool_whole(smollm_fp32)


def test_eos_stops_chat_reply(smollm_fp32):
    out = smollm_fp32.chat([{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0, max_tokens=200))[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason is None
    assert c.token_ids[-1] in smollm_fp32.llm_engine.config.eos_token_ids | {smollm_fp32.get_tokenizer().eos_token_id}
    assert "<|im_end|>" not in c.text and c.text.strip()


def test_seed_reproducible_and_per_prompt_params(smollm_fp32):
    p = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    a = smollm_fp32.generate(["Once upon a time", "Hello"], [p, GREEDY], use_tqdm=False)
    b = smollm_fp32.generate("Once upon a time", p, use_tqdm=False)[0]
    assert a[0].outputs[0].token_ids == b.outputs[0].token_ids
    assert len(a[1].outputs[0].token_ids) == 24


def test_token_id_prompts_and_metrics(smollm_fp32):
    tok = smollm_fp32.get_tokenizer()
    ids = tok.encode("The capital of France is")
    a = smollm_fp32.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=8))[0]
    b = smollm_fp32.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8))[0]
    assert a.prompt_token_ids == ids and a.outputs[0].token_ids == b.outputs[0].token_ids
    m = a.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time


def test_skip_tokenizer_init_returns_ids_only(tiny_llama):
    llm = LLM(tiny_llama, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=16)
    out = llm.generate({"prompt_token_ids": [4, 5, 6]}, SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].text == "" and len(out.outputs[0].token_ids) == 5
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate("text prompt", use_tqdm=False)


def test_bad_constructor_arguments(tiny_llama):
    with pytest.raises(TypeError, match="no_such_option"):
        LLM(tiny_llama, no_such_option=1)
    with pytest.raises(ValueError, match="dtype"):
        LLM(tiny_llama, dtype="float16")
    with pytest.raises(ValueError, match="does not exist"):
        LLM("/nonexistent/model")

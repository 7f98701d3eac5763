"""The quantized KV cache end to end on the default model: output close to the unquantized cache, the
pool sized by bytes per block, and prefix caching, preemption, chunked prefill and n > 1 forking with
an int8 cache leave the KV pool whole."""

import pytest

from perfxlm import LLM, SamplingParams
from perfxlm.entrypoints.cli import add_engine_args, engine_kwargs
from tests.conftest import assert_pool_whole

PROMPTS = [
    "The capital of France is",
    "Write a short story about a robot who learns to paint. Once upon a time,",
    "List three facts about the moon:",
    "def fibonacci(n):",
    "The best way to learn a new language is",
    "Explain photosynthesis in one sentence:",
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def int8_llm(default_model):
    return LLM(default_model, dtype="float32", kv_cache_dtype="int8", num_kv_blocks=256)


def _agreement(outs, refs) -> float:
    """Mean fraction of each greedy continuation that matches the reference before they first differ."""
    fractions = []
    for o, r in zip(outs, refs):
        a, b = o.outputs[0].token_ids, r.outputs[0].token_ids
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(b))
        fractions.append(same / len(b))
    return sum(fractions) / len(fractions)


@pytest.mark.parametrize("kv_cache_dtype,least", [("int8", 0.8), ("fp8", 0.5)])
def test_greedy_output_close_to_unquantized_cache(default_model, smollm_fp32, int8_llm, kv_cache_dtype, least):
    refs = smollm_fp32.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm = int8_llm if kv_cache_dtype == "int8" else LLM(default_model, dtype="float32", kv_cache_dtype="fp8",
                                                        num_kv_blocks=256)  # fmt: skip
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
    assert _agreement(outs, refs) >= least
    assert_pool_whole(llm)


def test_pool_holds_more_tokens_in_the_same_gib(default_model):
    blocks = {}
    for kv in ("auto", "int8", "fp8", "fp8_e5m2"):
        llm = LLM(default_model, dtype="bfloat16", kv_cache_dtype=kv, kv_cache_gib=0.05, max_model_len=256)
        blocks[kv] = llm.llm_engine.num_kv_blocks
        spec = llm.llm_engine.config.kv_cache_spec
        assert spec.name == {"auto": "bfloat16", "fp8": "fp8_e4m3"}.get(kv, kv)
    # SmolLM2-135M: 3 KV heads of 64 per layer; int8 keeps one float32 scale per token and head, fp8 one
    # exponent byte
    assert blocks["int8"] / blocks["auto"] == pytest.approx(2 * 64 / (64 + 4), rel=0.01)
    assert blocks["fp8"] / blocks["auto"] == pytest.approx(2 * 64 / (64 + 1), rel=0.01)
    assert blocks["fp8_e5m2"] == blocks["fp8"]


def test_prefix_caching_with_int8_cache(int8_llm):
    int8_llm.llm_engine.kv_cache_manager.reset_prefix_cache()
    shared = "You are a helpful assistant. " * 12
    first = int8_llm.generate(shared + "Tell me about cats.", GREEDY, use_tqdm=False)[0]
    second = int8_llm.generate(shared + "Tell me about cats.", GREEDY, use_tqdm=False)[0]
    third = int8_llm.generate(shared + "Tell me about cats.", GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens >= 64
    # read back from the quantized cache either way: a cached prefix gives the same continuation
    assert third.outputs[0].token_ids == second.outputs[0].token_ids
    assert _agreement([second], [first]) >= 0.5
    assert_pool_whole(int8_llm)


def test_n_greater_than_one_forks_copy_the_scales(int8_llm):
    """Greedy siblings share the full prompt blocks and get a copy of the partial last block: values and
    scales. A copy without the scales would dequantize the partial block to zeros and the siblings
    would part ways."""
    int8_llm.llm_engine.kv_cache_manager.reset_prefix_cache()
    prompt = "Write a short story about a robot who learns to paint. Once upon a"
    assert len(int8_llm.get_tokenizer().encode(prompt)) % 16  # a partial last block to copy
    out = int8_llm.generate(prompt, SamplingParams(n=3, temperature=0, max_tokens=16, ignore_eos=True),
                            use_tqdm=False)[0]  # fmt: skip
    alone = int8_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                              use_tqdm=False)[0]  # fmt: skip
    assert len(out.outputs) == 3
    for c in out.outputs:
        assert c.token_ids == out.outputs[0].token_ids
    assert _agreement([out], [alone]) >= 0.5
    assert_pool_whole(int8_llm)


def test_preemption_and_chunked_prefill_with_int8_cache(default_model, int8_llm):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [p + " Once upon a time, in a land far away, there lived" for p in PROMPTS]
    ref = int8_llm.generate(prompts, params, use_tqdm=False)
    longest = max(len(o.prompt_token_ids) for o in ref) + 24
    small = LLM(default_model, dtype="float32", kv_cache_dtype="int8", num_kv_blocks=-(-longest // 16) + 2,
                max_num_batched_tokens=16)  # fmt: skip
    outs = small.generate(prompts, params, use_tqdm=False)
    assert small.llm_engine.scheduler.num_preemptions_total > 0
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
    # recomputed requests re-prefill their own tokens (chunks over the quantized context): close, not bit-equal
    assert _agreement(outs, ref) >= 0.5
    assert_pool_whole(small)


def test_bad_kv_cache_dtype_is_a_value_error_naming_the_choices(tiny_llama):
    with pytest.raises(ValueError, match="auto, int8, fp8, fp8_e4m3, fp8_e5m2"):
        LLM(tiny_llama, skip_tokenizer_init=True, kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="kv_cache_group_size"):
        LLM(tiny_llama, skip_tokenizer_init=True, kv_cache_dtype="int8", kv_cache_group_size=0)


def test_cli_flag_reaches_the_engine():
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    kwargs = engine_kwargs(parser.parse_args(["--kv-cache-dtype", "fp8_e5m2", "--kv-cache-group-size", "32"]))
    assert kwargs["kv_cache_dtype"] == "fp8_e5m2" and kwargs["kv_cache_group_size"] == 32
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "int4"])

"""LoRA adapters against peft: greedy float32 output token-identical, with requests of different adapters
and of none batched in the same steps; quantized base weights; prefix caching keyed by adapter."""

from __future__ import annotations

import pytest
import torch

from perfxlm import LLM, LoRARequest, SamplingParams
from tests.conftest import assert_pool_whole
from tests.lora.conftest import peft_greedy

NEW = 16


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in lengths]


def run(llm, prompts, loras, n=NEW):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False,
                        lora_request=loras)
    return [o.outputs[0].token_ids for o in outs]


def test_mixed_adapters_in_one_batch_match_peft(lora_base, adapters):
    llm = LLM(lora_base, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=96, enable_lora=True,
              max_loras=3, max_lora_rank=8)
    a, b, c = (LoRARequest(k, i, adapters[k]) for i, k in ((1, "a"), (2, "b"), (3, "c")))
    prompts = prompts_of((9, 1, 37, 20, 5))
    loras = [a, b, None, c, a]
    got = run(llm, prompts, loras)
    for prompt, lora, tokens in zip(prompts, loras, got):
        assert tokens == peft_greedy(lora_base, lora.lora_path if lora else None, prompt, NEW), lora
    assert got[0] != run(llm, prompts[:1], None)[0]  # the adapter changes the text
    out = llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=2), use_tqdm=False,
                       lora_request=a)[0]
    assert out.lora_request == a
    assert_pool_whole(llm)


def _spy_steps(llm):
    """Record the distinct adapters of every step the runner executes."""
    runner = llm.llm_engine.core.runner
    seen, execute = [], runner.execute

    def spy(so):
        seen.append({s.lora.lora_int_id for s in so.scheduled if s.lora is not None})
        return execute(so)

    runner.execute = spy
    return seen


def test_max_loras_bounds_each_step_and_slots_are_reused(lora_base, adapters):
    """Three adapters through one slot: no step holds two, each output equals its own adapter's run with
    room for all, and a chunked prefill keeps rows and adapters aligned."""
    loras = [LoRARequest(k, i, adapters[k]) for i, k in ((1, "a"), (2, "b"), (3, "c"))] * 2
    prompts = prompts_of((11, 30, 4, 7, 19, 2), seed=1)
    wide = LLM(lora_base, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=96, enable_lora=True,
               max_loras=3, max_lora_rank=8)
    expected = run(wide, prompts, loras)
    narrow = LLM(lora_base, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=96, enable_lora=True,
                 max_loras=1, max_lora_rank=8, max_num_batched_tokens=13)
    steps = _spy_steps(narrow)
    assert run(narrow, prompts, loras) == expected
    assert all(len(s) <= 1 for s in steps) and {frozenset(s) for s in steps if s} == {frozenset({i}) for i in (1, 2, 3)}
    assert narrow.llm_engine.core.runner.lora_slots.num_repacks >= 3
    assert_pool_whole(narrow)


def test_quantized_base_rows_independent_of_the_batch(lora_base, adapters):
    """int8 base weights: each request's greedy text with its adapter is the same alone and batched with
    requests of other adapters or none."""
    llm = LLM(lora_base, skip_tokenizer_init=True, dtype="float32", quantization="int8", num_kv_blocks=96,
              enable_lora=True, max_loras=2, max_lora_rank=8)
    a, b = LoRARequest("a", 1, adapters["a"]), LoRARequest("b", 2, adapters["b"])
    prompts = prompts_of((6, 23, 13), seed=2)
    loras = [a, None, b]
    batched = run(llm, prompts, loras)
    alone = [run(llm, [p], [l])[0] for p, l in zip(prompts, loras)]
    assert batched == alone
    assert run(llm, prompts[:1], None)[0] != batched[0]
    assert_pool_whole(llm)


def test_prefix_cache_never_shared_across_adapters(lora_base, adapters):
    llm = LLM(lora_base, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=96, enable_lora=True,
              max_loras=2, max_lora_rank=8)
    a, b = LoRARequest("a", 1, adapters["a"]), LoRARequest("b", 2, adapters["b"])
    prompt = prompts_of((50,), seed=3)[0]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def cached(lora):
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False, lora_request=lora)[0]
        return out.num_cached_tokens, out.outputs[0].token_ids

    first_a = cached(a)
    assert first_a[0] == 0
    assert cached(None)[0] == 0 and cached(b)[0] == 0  # the same tokens under another adapter: no hit
    again_a = cached(a)
    assert again_a[0] >= 48 and again_a[1] == first_a[1]  # the same adapter reuses its own blocks
    assert cached(None)[0] >= 48
    assert_pool_whole(llm)


def test_fused_decode_adds_the_adapters(lora_base, adapters):
    """enable_lora keeps every all-decode step on the fused decode layer: base-only steps give what an
    engine without LoRA gives, and steps with adapter rows (one adapter, or several and none mixed) give
    what the module path gives, logprobs included."""
    from perfxlm.ops import native

    prompts = prompts_of((5, 12, 9), seed=4)
    plain = LLM(lora_base, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=48)
    llm = LLM(lora_base, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=48, enable_lora=True,
              max_loras=3, max_lora_rank=8)
    fused = llm.llm_engine.core.model.model.fused_decode
    calls, fused_run = [], fused.run
    fused.run = lambda *a: calls.append(1) or fused_run(*a)
    assert run(llm, prompts, None) == run(plain, prompts, None)
    a, b, c = (LoRARequest(k, i, adapters[k]) for i, k in ((1, "a"), (2, "b"), (3, "c")))
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=3)
    cases = ([a, a, a], [a, None, c], [b, c, a])

    def outputs(loras):
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in got]

    calls.clear()
    fused_outputs = [outputs(list(loras)) for loras in cases]
    if native.kernels() is not None:
        assert calls and fused.eligible and fused.lora_fits
    fused.eligible = False  # the module path: the reference the fused layer must agree with
    for loras, got in zip(cases, fused_outputs):
        _assert_same(got, outputs(list(loras)), loras)
    assert_pool_whole(llm)


def _assert_same(got, want, what, tolerance=1e-4):
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got, want, strict=True):
        assert tokens == ref_tokens, what
        for step, ref_step in zip(logprobs, ref_logprobs):
            assert step.keys() == ref_step.keys()
            for t in step:
                assert abs(step[t].logprob - ref_step[t].logprob) < tolerance, what


def test_fused_decode_adapters_at_many_rows(lora_base, adapters):
    """70 decode rows over two adapters and none (many row tiles per slot, both passes split across
    threads): the fused layer gives what the module path gives."""
    llm = LLM(lora_base, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=160, enable_lora=True,
              max_loras=2, max_lora_rank=8, max_num_seqs=80)
    a, c = LoRARequest("a", 1, adapters["a"]), LoRARequest("c", 3, adapters["c"])
    prompts = prompts_of([3 + i % 5 for i in range(70)], seed=6)
    loras = [(a, None, c)[i % 3] for i in range(70)]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2)

    def outputs():
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in got]

    from perfxlm.ops import native

    fused = llm.llm_engine.core.model.model.fused_decode
    rows, fused_run = [], fused.run
    fused.run = lambda x, *a, **k: rows.append(x.shape[0]) or fused_run(x, *a, **k)
    got = outputs()
    if native.kernels() is not None:
        assert max(rows) == 70
    fused.eligible = False
    _assert_same(got, outputs(), "70 rows")
    assert_pool_whole(llm)


def test_fused_decode_adapters_with_quantized_base_products(lora_base, adapters):
    """int8 base weights: the fused layer runs each projection and its adapters in one parallel region (each
    thread its output columns: q|k|v's 126 split at 64, so the ranges cut across q, k and v), at one row and
    at several: what the module path gives, logprobs included."""
    from perfxlm.ops import native

    llm = LLM(lora_base, skip_tokenizer_init=True, dtype="float32", quantization="int8", num_kv_blocks=48,
              enable_lora=True, max_loras=3, max_lora_rank=8)
    a, b, c = (LoRARequest(k, i, adapters[k]) for i, k in ((1, "a"), (2, "b"), (3, "c")))
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=3)
    cases = (([5], [a]), ([5, 12, 9, 3], [a, None, c, b]))

    def outputs(lengths, loras):
        got = llm.generate([{"prompt_token_ids": p} for p in prompts_of(lengths, seed=8)], params, use_tqdm=False,
                           lora_request=loras)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in got]

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        fused_outputs = [outputs(*case) for case in cases]
        fused = llm.llm_engine.core.model.model.fused_decode
        if native.kernels() is not None:
            assert fused.steps and fused.lora_fits
        fused.eligible = False  # the module path: the reference
        for (lengths, loras), got in zip(cases, fused_outputs):
            _assert_same(got, outputs(lengths, loras), loras)
    finally:
        torch.set_num_threads(threads)
    assert_pool_whole(llm)


def test_adapter_replaced_under_its_name_while_requests_run(lora_base, adapters):
    """An adapter unloaded and another folder loaded under its name and id while a request of the old one
    is still decoding (as /v1/unload_lora_adapter then /v1/load_lora_adapter do), then a third adapter
    taking a slot mid-flight: each request keeps its own adapter's weights to the end (the fused layer's
    per-layer adapter blocks follow every repack; none is left stale), token for token peft's."""
    llm = LLM(lora_base, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=96, enable_lora=True,
              max_loras=2, max_lora_rank=8)
    engine = llm.llm_engine
    old, new = LoRARequest("a", 1, adapters["a"]), LoRARequest("a", 1, adapters["c"])
    b = LoRARequest("b", 2, adapters["b"])
    prompts = prompts_of((7, 11, 5), seed=9)
    lengths = {"old": 20, "new": NEW, "b": 6}

    def add(rid, prompt, lora):
        engine.add_request(rid, {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=lengths[rid],
                                                                             ignore_eos=True), lora_request=lora)

    done = {}

    def steps(n=None):
        while engine.has_unfinished_requests() and (n is None or n > 0):
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
            n = None if n is None else n - 1

    add("old", prompts[0], old)
    steps(4)
    assert engine.loras.remove(1)
    add("new", prompts[1], new)
    steps(4)
    add("b", prompts[2], b)  # both slots busy: it waits for one, then evicts that adapter mid-flight
    steps()
    assert done["old"] == peft_greedy(lora_base, adapters["a"], prompts[0], lengths["old"])
    assert done["new"] == peft_greedy(lora_base, adapters["c"], prompts[1], lengths["new"])
    assert done["b"] == peft_greedy(lora_base, adapters["b"], prompts[2], lengths["b"])
    from perfxlm.ops import native

    if native.kernels() is not None:
        assert llm.llm_engine.core.model.model.fused_decode.steps > 0
    assert llm.llm_engine.core.runner.lora_slots.num_repacks >= 3
    assert_pool_whole(llm)

"""One request must never hurt another: edge validation of every field, per-request failures that end
only their request, reserved sibling ids, and process-wide state an engine must leave alone."""

import gc
import threading

import pytest
import torch

from perfxlm import LLM, SamplingParams
from perfxlm.engine.input_processor import SIBLING_SEP
from perfxlm.sampling_params import RequestOutputKind
from tests.conftest import assert_pool_whole

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [5 + i, 17, 40 + 3 * i, 9]} for i in range(4)]


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return LLM(tiny_llama, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=128, max_num_seqs=8)


@pytest.mark.parametrize("kwargs,field", [
    ({"temperature": 1.0, "seed": 10**23}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"top_k": 2.0}, "top_k"),
    ({"temperature": float("nan")}, "temperature"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"n": 9}, "n"),  # max_num_seqs is 8
    ({"n": 2, "best_of": 10**6}, "best_of"),
    ({"logprobs": 21}, "logprobs"),  # max_logprobs defaults to 20
    ({"prompt_logprobs": 10**9}, "prompt_logprobs"),
])
def test_out_of_range_field_fails_at_the_edge_and_loses_no_prompt(tiny, kwargs, field):
    with pytest.raises(ValueError, match=field):
        tiny.generate(PROMPTS[:2], [GREEDY, SamplingParams(max_tokens=4, **kwargs)], use_tqdm=False)
    assert_pool_whole(tiny)
    # The engine is untouched: the good prompt still runs.
    assert len(tiny.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 8


def test_max_logprobs_is_an_engine_argument(tiny_llama):
    llm = LLM(tiny_llama, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=32, max_logprobs=3)
    with pytest.raises(ValueError, match=r"max_logprobs \(3\)"):
        llm.generate(PROMPTS[0], SamplingParams(logprobs=4), use_tqdm=False)
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=2, logprobs=3), use_tqdm=False)[0]
    assert all(len(lp) >= 3 for lp in out.outputs[0].logprobs)


def test_huge_top_k_is_no_filter(tiny):
    params = SamplingParams(temperature=1.0, seed=7, top_k=2**70, max_tokens=6, ignore_eos=True)
    off = SamplingParams(temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    a, b = tiny.generate([PROMPTS[0], PROMPTS[0]], [params, off], use_tqdm=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_seed_minus_one_is_random_and_extreme_seeds_run(tiny):
    assert SamplingParams(seed=-1).seed is None
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=3, n=2) for s in (2**63 - 1, -(2**63))]
    outs = tiny.generate(PROMPTS[:2], params, use_tqdm=False)  # siblings' seed + 1 wraps, no overflow
    assert all(len(c.token_ids) == 3 for o in outs for c in o.outputs)


def test_a_request_whose_sampling_state_fails_ends_alone(tiny):
    """A bad value smuggled past the edge (here a seed no generator takes) fails its request only; the
    others produce exactly what they produce without it."""
    engine = tiny.llm_engine
    ref = [o.outputs[0].token_ids for o in tiny.generate(PROMPTS[:3], GREEDY, use_tqdm=False)]
    seeded = SamplingParams(temperature=0.9, seed=3, max_tokens=8, ignore_eos=True)
    for i, p in enumerate(PROMPTS[:3]):
        engine.add_request(f"ok{i}", p, GREEDY)
    engine.add_request("bad", PROMPTS[3], seeded)
    engine.scheduler.requests["bad"].sampling_params.seed = 2**70
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals["bad"].outputs[0].finish_reason == "abort"
    assert [finals[f"ok{i}"].outputs[0].token_ids for i in range(3)] == ref
    assert_pool_whole(tiny)


def test_a_failing_sibling_ends_its_request_not_the_batch(tiny):
    engine = tiny.llm_engine
    ref = tiny.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    engine.add_request("ok", PROMPTS[0], GREEDY)
    engine.add_request("fam", PROMPTS[1], SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=4))
    engine.scheduler.requests[f"fam{SIBLING_SEP}0"].fork_children[1][1].seed = 2**70
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert [c.finish_reason for c in finals["fam"].outputs] == ["abort"] * 3
    assert finals["ok"].outputs[0].token_ids == ref
    assert_pool_whole(tiny)


def test_user_ids_cannot_collide_with_sibling_ids(tiny):
    engine = tiny.llm_engine
    engine.add_request("x", PROMPTS[0], SamplingParams(n=2, max_tokens=3))
    engine.add_request("0_x", PROMPTS[1], SamplingParams(max_tokens=3))  # the old sibling spelling is a plain id
    engine.add_request("1_x", PROMPTS[2], SamplingParams(max_tokens=3))
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request(f"x{SIBLING_SEP}1", PROMPTS[3], SamplingParams(max_tokens=3))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x", PROMPTS[3], SamplingParams(max_tokens=3))
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert sorted(finals) == ["0_x", "1_x", "x"] and len(finals["x"].outputs) == 2
    assert_pool_whole(tiny)


def test_forked_siblings_respect_max_num_seqs(tiny_llama):
    llm = LLM(tiny_llama, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64, max_num_seqs=3)
    engine = llm.llm_engine
    engine.add_request("a", PROMPTS[0], SamplingParams(n=3, temperature=0.8, seed=0, max_tokens=5, ignore_eos=True))
    engine.add_request("b", PROMPTS[1], SamplingParams(max_tokens=5, ignore_eos=True))
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        assert engine.scheduler.num_running <= 3
        engine.check_invariants()
    assert all(len(c.token_ids) == 5 for c in finals["a"].outputs)
    assert len(finals["b"].outputs[0].token_ids) == 5


def test_two_engines_in_two_threads_do_not_share_a_forward_context(tiny_llama):
    llms = [LLM(tiny_llama, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64) for _ in range(2)]
    prompts = [PROMPTS[0], {"prompt_token_ids": list(range(3, 40))}]
    refs = [llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for llm, p in zip(llms, prompts)]
    results: dict[int, list] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = [llms[i].generate(prompts[i], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
                          for _ in range(15)]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for i in range(2):
        assert all(r == refs[i] for r in results[i])


def test_engine_construction_leaves_process_state_alone(tiny_llama):
    from perfxlm.engine import engine_core

    old_dtype, old_threads = torch.get_default_dtype(), torch.get_num_threads()
    old_freeze = engine_core._freeze_gc_at_start
    engine_core.freeze_gc_at_engine_start(False)  # a CLI test earlier in this process may have opted in
    torch.set_default_dtype(torch.float64)
    try:
        gc.unfreeze()
        LLM(tiny_llama, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=8)
        assert torch.get_default_dtype() == torch.float64
        assert torch.get_num_threads() == old_threads
        assert gc.get_freeze_count() == 0  # only the CLI and the server may freeze the collector
    finally:
        torch.set_default_dtype(old_dtype)
        engine_core.freeze_gc_at_engine_start(old_freeze)


def test_gguf_load_restores_thread_count(default_model):
    threads = torch.get_num_threads()
    LLM(default_model, dtype="float32", num_kv_blocks=8)
    assert torch.get_num_threads() == threads and torch.get_default_dtype() == torch.float32

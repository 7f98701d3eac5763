"""Scheduler tests with a fake model: sampled tokens are made up, no forward pass runs."""

from perfxlm.engine.kv_cache_manager import KVCacheManager
from perfxlm.engine.messages import ModelRunnerOutput
from perfxlm.engine.request import Request
from perfxlm.engine.scheduler import Scheduler
from perfxlm.sampling_params import SamplingParams


def make(num_blocks=64, block_size=4, max_num_seqs=8, max_tokens_per_step=32, caching=True):
    kv = KVCacheManager(num_blocks, block_size, caching)
    return Scheduler(kv, max_num_seqs, max_tokens_per_step, max_model_len=1024), kv


def add(sched, rid, n_prompt, max_tokens=5, eos=None, first_token=0):
    params = SamplingParams(max_tokens=max_tokens)
    r = Request(rid, list(range(first_token, first_token + n_prompt)), params, max_tokens, eos or set())
    sched.add_request(r)
    return r


def run_step(sched, token=7):
    so = sched.schedule()
    mro = ModelRunnerOutput({s.request_id: token for s in so.scheduled if s.do_sample})
    return so, sched.update_from_output(so, mro)


def test_chunked_prefill_respects_budget_and_mixes_with_decode():
    sched, kv = make(max_tokens_per_step=16)
    add(sched, "short", 3)
    so, _ = run_step(sched)
    assert so.num_batched_tokens == 3
    add(sched, "long", 40)
    so, _ = run_step(sched)
    sizes = {s.request_id: len(s.token_ids) for s in so.scheduled}
    assert sizes == {"short": 1, "long": 15}
    assert not [s for s in so.scheduled if s.request_id == "long"][0].do_sample
    so, _ = run_step(sched)
    assert {s.request_id: len(s.token_ids) for s in so.scheduled} == {"short": 1, "long": 15}
    so, outs = run_step(sched)
    long = [s for s in so.scheduled if s.request_id == "long"][0]
    assert len(long.token_ids) == 10 and long.do_sample
    assert any(o.request_id == "long" for o in outs)
    kv.check_invariants()


def test_max_num_seqs_caps_running():
    sched, _ = make(max_num_seqs=2)
    for i in range(4):
        add(sched, f"r{i}", 2, first_token=10 * i)
    so, _ = run_step(sched)
    assert len(so.scheduled) == 2 and sched.num_waiting == 2


def test_finishes_on_length_eos_and_stop_token():
    sched, kv = make()
    add(sched, "len", 2, max_tokens=3)
    r_eos = add(sched, "eos", 2, max_tokens=10, eos={7}, first_token=100)
    outs_all = []
    while sched.has_unfinished_requests():
        outs_all += run_step(sched)[1]
    reasons = {o.request_id: o.finish_reason for o in outs_all if o.finish_reason}
    assert reasons == {"len": "length", "eos": "stop"}
    assert r_eos.num_output_tokens == 1
    assert kv.check_invariants()["used"] == 0


def test_preemption_under_tiny_pool_finishes_everyone():
    # Each request needs 3 blocks in the end (8 prompt + 4 output tokens, block 4); the pool holds 7.
    sched, kv = make(num_blocks=7, block_size=4, max_num_seqs=8, max_tokens_per_step=64)
    reqs = [add(sched, f"r{i}", 8, max_tokens=4, first_token=20 * i) for i in range(6)]
    preemptions = 0
    for _ in range(200):
        if not sched.has_unfinished_requests():
            break
        so, _ = run_step(sched)
        preemptions += so.num_preemptions
        kv.check_invariants()
    assert not sched.has_unfinished_requests()
    assert preemptions > 0
    assert all(r.num_output_tokens == 4 for r in reqs)
    assert kv.check_invariants()["used"] == 0


def test_prefix_cache_hit_is_reported():
    sched, kv = make(block_size=4)
    a = add(sched, "a", 12)
    while sched.has_unfinished_requests():
        run_step(sched)
    b = add(sched, "b", 12)  # same tokens
    so, _ = run_step(sched)
    assert b.num_cached_tokens == 8
    assert len(so.scheduled[0].token_ids) == 4
    assert a.num_cached_tokens == 0


def test_abort_waiting_and_running():
    sched, kv = make(max_num_seqs=1)
    from perfxlm.engine.request import RequestStatus

    add(sched, "run", 3)
    add(sched, "wait", 3, first_token=50)
    run_step(sched)
    sched.finish_requests(["run", "wait", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished_requests()
    assert kv.check_invariants()["used"] == 0
    assert sched.schedule().finished_request_ids == {"run", "wait"}

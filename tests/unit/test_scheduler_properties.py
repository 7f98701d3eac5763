"""Property-based test: random add / abort / step / fork / preempt / fail sequences drive the scheduler
and the KV cache manager against a fake model runner, and the invariants hold after every step."""

import random

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from perfxlm.engine.input_processor import sibling_id
from perfxlm.engine.kv_cache_manager import KVCacheManager
from perfxlm.engine.messages import ModelRunnerOutput
from perfxlm.engine.request import Request, RequestStatus
from perfxlm.engine.scheduler import Scheduler
from perfxlm.sampling_params import SamplingParams

EOS = 0
MAX_MODEL_LEN = 64


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(6, 40), block_size=st.sampled_from([1, 2, 4, 8]),
                max_num_seqs=st.integers(1, 6), budget=st.integers(1, 48), caching=st.booleans())
    def setup(self, num_blocks, block_size, max_num_seqs, budget, caching):
        self.kv = KVCacheManager(num_blocks, block_size, caching)
        self.sched = Scheduler(self.kv, max_num_seqs, budget, MAX_MODEL_LEN)
        self.max_num_seqs = max_num_seqs
        self.pool_tokens = num_blocks * block_size
        self.counter = 0
        self.families: dict[str, list[str]] = {}  # user request -> its sequence ids

    # ---- operations ----------------------------------------------------------------------
    @rule(prompt_len=st.integers(1, 30), max_tokens=st.integers(1, 12), n=st.integers(1, 4),
          shared=st.booleans(), eos=st.booleans(), seed=st.integers(0, 2**16))
    def add(self, prompt_len, max_tokens, n, shared, eos, seed):
        # What the input processor guarantees: the sequence fits max_model_len and the whole pool.
        max_tokens = min(max_tokens, MAX_MODEL_LEN - prompt_len - 1, self.pool_tokens - prompt_len)
        if max_tokens < 1:
            return
        rng = random.Random(seed)
        prompt = [7] * prompt_len if shared else [rng.randrange(1, 50) for _ in range(prompt_len)]
        rid = f"r{self.counter}"
        self.counter += 1
        params = SamplingParams(n=n, max_tokens=max_tokens, min_tokens=rng.choice([0, 0, max_tokens]))
        ids = [rid] if n == 1 else [sibling_id(rid, i) for i in range(n)]
        request = Request(ids[0], prompt, params, max_tokens, {EOS} if eos else set())
        request.fork_children = [(cid, params.clone()) for cid in ids[1:]]
        self.sched.add_request(request)
        self.families[rid] = ids

    @precondition(lambda self: self.families)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.families)))
        self.sched.finish_requests(self.families.pop(rid), RequestStatus.FINISHED_ABORTED)

    @precondition(lambda self: self.sched.running)
    @rule()
    def preempt_newest(self):
        # What schedule() does when blocks run out, forced between steps.
        victim = self.sched.running.pop()
        self.sched._preempt(victim)

    @rule(seed=st.integers(0, 2**16), fail=st.booleans(), stop_one=st.booleans())
    def step(self, seed, fail, stop_one):
        rng = random.Random(seed)
        so = self.sched.schedule()
        assert so.num_batched_tokens <= self.sched.max_num_batched_tokens
        assert len(so.scheduled) <= self.max_num_seqs
        for sr in so.scheduled:
            assert len(sr.block_ids) * self.kv.block_size >= sr.num_computed_tokens + len(sr.token_ids)
        mro = ModelRunnerOutput({})
        for sr in so.scheduled:
            if sr.do_sample:
                for rid in [sr.request_id, *(cid for cid, _ in sr.fork_children)]:
                    mro.sampled_token_ids[rid] = rng.choice([EOS, 3, 5, 9, 11])
        if fail and so.scheduled:
            mro.failed[rng.choice(so.scheduled).request_id] = "injected"
        outs = self.sched.update_from_output(so, mro)
        for out in outs:
            assert out.finish_reason in (None, "stop", "length", "abort")
        if stop_one and self.sched.running:  # a stop string found by the detokenizer
            victim = rng.choice(self.sched.running)
            self.sched.finish_requests([victim.request_id], RequestStatus.FINISHED_STOPPED, "stop")
        self._forget_finished()

    def _forget_finished(self):
        live = set(self.sched.requests)
        for rid, ids in list(self.families.items()):
            if not any(i in live for i in ids) and not self._unborn(ids):
                del self.families[rid]

    def _unborn(self, ids):
        return any(cid in ids for r in self.sched.requests.values() for cid, _ in r.fork_children)

    # ---- invariants ----------------------------------------------------------------------
    @invariant()
    def pool_and_queues_are_consistent(self):
        if not hasattr(self, "sched"):
            return
        counts = self.kv.check_invariants()
        sched = self.sched
        running = {r.request_id for r in sched.running}
        waiting = {r.request_id for r in sched.waiting}
        assert len(sched.running) <= self.max_num_seqs
        assert not running & waiting and running | waiting == set(sched.requests)
        assert len(running) == len(sched.running) and len(waiting) == len(sched.waiting)
        for r in sched.running:
            assert r.status == RequestStatus.RUNNING
            assert len(self.kv.block_ids(r.request_id)) * self.kv.block_size >= r.num_computed_tokens
            assert r.num_computed_tokens <= r.num_tokens <= MAX_MODEL_LEN
            assert r.num_output_tokens <= r.max_tokens
        for r in sched.waiting:
            assert not r.status.is_finished and not self.kv.block_ids(r.request_id)
        assert set(self.kv.req_to_blocks) <= running
        if not sched.requests:
            assert counts["used"] == 0

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        # Whatever happened, the engine drains: every request ends and the pool is whole again.
        for _ in range(2000):
            if not self.sched.has_unfinished_requests():
                break
            self.step(seed=1, fail=False, stop_one=False)
        assert not self.sched.has_unfinished_requests()
        assert self.kv.check_invariants()["used"] == 0


SchedulerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_scheduler_and_kv_cache_invariants = SchedulerMachine.TestCase

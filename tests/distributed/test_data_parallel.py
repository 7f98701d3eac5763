"""Data-parallel replicas on this machine (one core each): greedy output equal to one engine whichever
replica serves a request, requests spread over both, aborts reach the replica holding the request, a
request a replica cannot rebuild fails alone, and a lost or hung replica ends the engine within seconds with no
process left."""

from __future__ import annotations

import os
import signal
import time

import pytest

from perfxlm import LLM, SamplingParams
from tests.distributed.test_tensor_parallel import PROMPTS

pytestmark = pytest.mark.timeout(180)



def _replicas_gone(pids: list[int], timeout: float = 10.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        alive = []
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                        alive.append(pid)
            except OSError:
                pass
        if not alive:
            return True
        time.sleep(0.1)
    return False


def _generate(path: str, dp: int, **plan) -> tuple[list, list]:
    from perfxlm.ops import cpu_plan

    previous = cpu_plan.use(**plan) if plan else None  # a plan put in force here, as an override would
    try:
        llm = LLM(path, dtype="float32", skip_tokenizer_init=True, data_parallel_size=dp, block_size=4,
                  num_kv_blocks=64)
    finally:
        if previous is not None:
            cpu_plan.use(previous)
    try:
        if dp > 1:  # each replica runs the engine's resolved plan, pinned to the cores resolved for it
            core = llm.llm_engine.core
            assert [i["cpus"] for i in core.infos] == list(core.config.resolved.process_cpus)
            assert all(i["cpu_plan"] == core.config.resolved.cpu_plan.describe() for i in core.infos)
            assert all(f"native_max_rows={plan['native_max_rows']} " in i["cpu_plan"] for i in core.infos)
        params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, detokenize=False, logprobs=2),
                  SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=6, ignore_eos=True, detokenize=False),
                  SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, detokenize=False)] * 2
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS * 2], params, use_tqdm=False)
        assert llm.llm_engine.check_invariants()["used"] == 0
        stats = llm.llm_engine.core.replica_stats() if dp > 1 else []
        return [[c.token_ids for c in o.outputs] for o in outs], stats
    finally:
        llm.llm_engine.shutdown()


def test_offline_replicas_equal_one_engine(llama):
    ref, _ = _generate(llama, 1)
    got, stats = _generate(llama, 2, native_max_rows=5)
    assert got == ref  # greedy and seeded rows alike, whichever replica ran them
    assert all(s["prefix_queries"] > 0 and s["inflight"] == 0 for s in stats)  # both served, both drained
    assert _replicas_gone([s["pid"] for s in stats])


def test_refuses_replicas_of_shards(llama):
    with pytest.raises(ValueError, match="data_parallel_size"):
        LLM(llama, skip_tokenizer_init=True, data_parallel_size=2, tensor_parallel_size=2)


def _explode():
    import multiprocessing

    if multiprocessing.current_process().name.startswith("perfxlm-dp"):
        raise RuntimeError("cannot be rebuilt here")
    return _Unloadable()


class _Unloadable:
    """Copies in the front end, fails to unpickle in a replica."""

    def __reduce__(self):
        return _explode, ()


def _until(cond, timeout: float = 20.0) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, "timed out"
        time.sleep(0.01)


def test_threaded_engine_routes_aborts_and_dies_cleanly(llama):
    from perfxlm.config import EngineConfig
    from perfxlm.engine.threaded_engine import EngineDeadError, ThreadedEngine

    engine = ThreadedEngine(EngineConfig(model=llama, dtype="float32", skip_tokenizer_init=True,
                                         data_parallel_size=2, num_kv_blocks=64))
    dp = engine.core
    pids = [p.pid for p in dp.procs]
    try:
        long = SamplingParams(max_tokens=400, ignore_eos=True, detokenize=False)
        got: dict[str, list] = {"a": [], "b": [], "c": []}
        engine.add_request("a", {"prompt_token_ids": PROMPTS[0]}, long, got["a"].append)
        engine.add_request("b", {"prompt_token_ids": PROMPTS[1]}, long, got["b"].append)
        _until(lambda: dp.inflight == [1, 1] and got["b"])  # one per replica, both stepping
        assert dp._owner["a"][0] == 0 and dp._owner["b"][0] == 1
        # freeze replica 1 so that `b` is certainly still open when it is killed below, however fast
        # the host (400 tokens of this model can otherwise end before the kill); ties route to replica 0
        os.kill(pids[1], signal.SIGSTOP)
        assert not got["b"][-1].finished
        engine.abort("a")  # reaches replica 0, which frees its seat
        _until(lambda: dp.inflight == [0, 1])
        engine.add_request("c", {"prompt_token_ids": PROMPTS[2]}, long, got["c"].append)
        _until(lambda: "c" in dp._owner)
        assert dp._owner["c"][0] == 0  # the least busy replica
        assert got["a"][-1].finished and got["a"][-1].outputs[0].finish_reason == "abort"
        # a request that a replica cannot rebuild fails alone; the engine goes on
        bad = SamplingParams(max_tokens=2, detokenize=False, extra_args={"x": _Unloadable()})
        got["x"] = []
        engine.add_request("x", {"prompt_token_ids": PROMPTS[0]}, bad, got["x"].append)
        _until(lambda: got["x"] and got["x"][-1].finished)
        assert got["x"][-1].outputs[0].finish_reason == "abort"
        engine.check_health()
        _until(lambda: "x" not in dp._owner)
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.time()
        while not got["b"] or not isinstance(got["b"][-1], BaseException):
            assert time.time() - t0 < 10, got["b"][-1:]
            time.sleep(0.05)
        assert isinstance(got["b"][-1], EngineDeadError)  # the open requests end with the error
        while not got["c"] or not isinstance(got["c"][-1], BaseException):
            assert time.time() - t0 < 10
            time.sleep(0.05)
        with pytest.raises(EngineDeadError):
            engine.check_health()
        with pytest.raises(EngineDeadError):
            engine.add_request("d", {"prompt_token_ids": [5, 6]}, long, lambda _: None)
    finally:
        engine.shutdown()
    assert _replicas_gone(pids)


def test_hung_replica_ends_the_engine(llama, monkeypatch):
    from perfxlm.config import EngineConfig
    from perfxlm.engine.threaded_engine import EngineDeadError, ThreadedEngine

    monkeypatch.setenv("PERFXLM_STEP_TIMEOUT", "2")
    engine = ThreadedEngine(EngineConfig(model=llama, dtype="float32", skip_tokenizer_init=True,
                                         data_parallel_size=2, num_kv_blocks=64))
    pids = [p.pid for p in engine.core.procs]
    try:
        got: list = []
        engine.add_request("a", {"prompt_token_ids": PROMPTS[0]},
                           SamplingParams(max_tokens=400, ignore_eos=True, detokenize=False), got.append)
        _until(lambda: got)  # replica 0 is stepping
        os.kill(pids[0], signal.SIGSTOP)
        t0 = time.time()
        _until(lambda: isinstance(got[-1], BaseException), timeout=10)
        assert isinstance(got[-1], EngineDeadError) and time.time() - t0 < 10
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        engine.shutdown()
    assert _replicas_gone(pids)

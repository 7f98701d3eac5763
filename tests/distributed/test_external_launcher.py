"""distributed_executor_backend="external_launcher": two ranks started as torchrun starts them (its
variables set by hand, MASTER_ADDR on the loopback address), each running the whole engine on its shard;
greedy output equal to one process token for token on both ranks, over shared memory and over gloo's TCP
transport (the path between machines), and with speculative decoding (rank 0's drafts). Every rank process is killed at the end, pass or fail."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from perfxlm import LLM, SamplingParams
from tests.distributed.test_tensor_parallel import PROMPTS
from tests.server.conftest import free_port

pytestmark = pytest.mark.timeout(180)

_RANK_SCRIPT = """
import json, sys
from perfxlm import LLM, SamplingParams
path, out, prompts, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
llm = LLM(path, dtype="float32", skip_tokenizer_init=True, tensor_parallel_size=2,
          distributed_executor_backend="external_launcher", block_size=4, max_num_batched_tokens=16,
          speculative_config=spec)
greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, detokenize=False)
sampled = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, detokenize=False)
outs = llm.generate([{"prompt_token_ids": p} for p in prompts * 2], [greedy] * len(prompts) + [sampled] * len(prompts),
                    use_tqdm=False)
core = llm.llm_engine.core
llm.llm_engine.shutdown()
json.dump({"tokens": [o.outputs[0].token_ids for o in outs], "proposes": core.proposer is not None,
           "spec": core.scheduler.spec_stats.as_dict()}, open(out, "w"))
"""



def _launch(path: str, tmp_path, env_extra: dict[str, str], spec: dict | None = None) -> list[dict]:
    port = free_port()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    procs = []
    try:
        for rank in range(2):
            env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": "2",
                   "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2", "PERFXLM_COLLECTIVE_TIMEOUT": "20",
                   **env_extra}  # fmt: skip
            procs.append(subprocess.Popen(
                [sys.executable, "-c", _RANK_SCRIPT, path, str(tmp_path / f"out{rank}.json"), json.dumps(PROMPTS),
                 json.dumps(spec)],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.time() + 120
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.time()))
            assert p.returncode == 0, out.decode()[-3000:]
        return [json.load(open(tmp_path / f"out{rank}.json")) for rank in range(2)]
    finally:
        for p in procs:  # the rank and anything it started
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()


def _reference(path: str) -> list[list[int]]:  # greedy rows
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, block_size=4, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, detokenize=False)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                                         use_tqdm=False)]


@pytest.mark.parametrize("allreduce", ["shm", "gloo"])
def test_two_launched_ranks_equal_one_process(llama, tmp_path, allreduce):
    rank0, rank1 = _launch(llama, tmp_path, {"PERFXLM_ALLREDUCE": allreduce})
    assert rank0["tokens"] == rank1["tokens"]  # sampled rows too: every rank goes on with rank 0's tokens
    assert rank0["tokens"][: len(PROMPTS)] == _reference(llama)


def test_launched_ranks_verify_rank_0s_drafts(llama, tmp_path):
    """A draft model loads on rank 0 alone; every rank verifies rank 0's drafts, so the ranks schedule
    the same steps and the greedy output is one process's."""
    rank0, rank1 = _launch(llama, tmp_path, {}, {"model": llama, "num_speculative_tokens": 3})
    assert (rank0["proposes"], rank1["proposes"]) == (True, False)
    assert rank0["tokens"] == rank1["tokens"] and rank0["spec"] == rank1["spec"]
    assert rank0["spec"]["num_accepted_tokens"] > 0
    assert rank0["tokens"][: len(PROMPTS)] == _reference(llama)


def test_needs_the_launcher_variables(llama, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="torchrun"):
        LLM(llama, skip_tokenizer_init=True, tensor_parallel_size=2, distributed_executor_backend="external_launcher")
    with pytest.raises(ValueError, match="not supported"):
        LLM(llama, skip_tokenizer_init=True, distributed_executor_backend="ray")

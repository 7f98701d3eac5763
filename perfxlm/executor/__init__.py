"""The boundary between the engine core and the model: `Executor.execute(SchedulerOutput) ->
ModelRunnerOutput`.

- `InProcessExecutor` (tensor_parallel_size 1, the default): the model and runner live in the engine's
  process and `execute` is the runner's own method, no copy, no extra call.
- `MultiprocExecutor` (tensor_parallel_size N > 1): N spawned worker processes, one per NUMA node (or
  per core group), each holding 1/N of the model. Each step's SchedulerOutput is sent to every worker
  as a value (new requests once, then new tokens and blocks: `executor/delta.py`), every worker runs the
  same step, and rank 0 sends the ModelRunnerOutput back.
"""

from __future__ import annotations

from typing import Any


def make_executor(config: Any) -> Any:
    if getattr(config, "tensor_parallel_size", 1) > 1:
        from perfxlm.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config)
    from perfxlm.executor.uniproc import InProcessExecutor

    return InProcessExecutor(config)

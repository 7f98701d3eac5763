"""The boundary between the engine core and the model: `Executor.execute(SchedulerOutput) ->
ModelRunnerOutput`, the interface in `executor/base.py`.

- `ModuleExecutor` (tensor_parallel_size 1, the default): the model and runner live in the engine's
  process and `execute` is the runner's own method, no copy, no extra call.
- `MultiprocExecutor` (tensor_parallel_size N > 1): N spawned worker processes, one per NUMA node (or
  per core group), each holding 1/N of the model. Each step's SchedulerOutput is sent to every worker
  as a value (new requests once, then new tokens and blocks: `executor/delta.py`), every worker runs the
  same step, and rank 0 sends the ModelRunnerOutput back.
- `ExternalLauncherExecutor` (distributed_executor_backend="external_launcher"): this process is one
  rank of a job that torchrun started (several machines); every rank runs the whole engine and goes on
  with rank 0's sampled tokens (`executor/external.py`).
- `OnnxExecutor` (load_format "onnx"): an exported graph run by ONNX Runtime in-process, under the same
  scheduler (`executor/onnx.py`, `worker/onnx_runner.py`).
- `GraphExecutor` (load_format "onnx", a `perfxlm`-flavor folder): the graph's nodes on the engine's own
  kernels, under the ordinary model runner (`executor/graph.py`, `model/graph/`); with enable_lora, the
  Linear nodes the export recorded as targets take the step's adapters (`model/graph/lora.py`).
"""

from __future__ import annotations

from typing import Any

from perfxlm.executor.base import Executor


def make_executor(config: Any) -> Executor:
    if getattr(config, "load_format", None) == "onnx":
        from perfxlm.export.manifest import read_manifest

        if read_manifest(config.model).get("flavor") == "perfxlm":
            from perfxlm.executor.graph import GraphExecutor

            return GraphExecutor(config)
        from perfxlm.executor.onnx import OnnxExecutor

        return OnnxExecutor(config)
    if getattr(config, "distributed_executor_backend", None) == "external_launcher":
        from perfxlm.executor.external import ExternalLauncherExecutor

        return ExternalLauncherExecutor(config)
    if getattr(config, "tensor_parallel_size", 1) > 1:
        from perfxlm.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config)
    from perfxlm.executor.uniproc import ModuleExecutor

    return ModuleExecutor(config)

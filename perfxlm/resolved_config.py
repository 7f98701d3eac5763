"""The engine's decisions as one immutable value.

`EngineConfig` holds what the user asked for, `auto` included; `EngineConfig.resolve()` decides every
`auto` once (compute and weight dtypes, the activation mode of quantized products, the ISA tier and the
CPU plan, the KV cache format, the quantized weights' format) and freezes the result here. The loader,
the executors and the model runners read this value instead of deciding again, and it travels to
tensor-parallel workers as a value: a worker runs the CPU plan the engine chose (`cpu_plan.use`), not
one it detects itself. It is printed once at start-up (`describe`, as vLLM's config log line).

`max_model_len` is resolved from the user or the model here; the KV pool fits it after the model is
loaded (the bytes per block are known only then), and the engine core keeps that as its own frozen value,
`EngineCore.resolved` (this one with the fitted `max_model_len`; a data-parallel front end: the smallest
of its replicas'), which the scheduler and the input checks read. Nothing rewrites the user's config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _cores(cpus: list[int] | None) -> str:
    if cpus is None:
        return "all"
    contiguous = cpus == list(range(cpus[0], cpus[-1] + 1))
    return f"{cpus[0]}-{cpus[-1]}" if contiguous and len(cpus) > 1 else ",".join(map(str, cpus))


@dataclass(frozen=True)
class ResolvedConfig:
    model: str
    load_format: str
    compute_dtype: torch.dtype  # activations
    weight_dtype: torch.dtype  # float linear and embedding weights as stored
    quant_config: Any  # quant.config.QuantizationConfig or None (a GGUF file's own blocks: None)
    quantized_source: str | None  # where quantized weights come from ("gguf", "int4", "awq", ...), or None
    quant_activations: Any  # quant.weight.ActivationMode, or None where no weight stays quantized
    kv_cache_spec: Any  # ops.kv_quant.KVCacheSpec
    block_size: int
    cpu_plan: Any  # ops.cpu_plan.CpuPlan, its ISA tier included
    tensor_parallel_size: int
    data_parallel_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    seed: int | None
    device: torch.device  # where weights, KV cache and sampling tensors live (cpu, or cuda: perfxlm/device.py)
    # the cores of each spawned process (tensor-parallel rank or data-parallel replica; None: not pinned),
    # planned once from the machine's NUMA nodes (distributed/topology.py); empty with one process
    process_cpus: tuple[list[int] | None, ...] = ()

    @property
    def isa(self) -> str:
        return self.cpu_plan.isa

    def describe(self) -> str:
        """One line of every decision, for the start-up log."""
        quant = "none" if self.quantized_source is None else (
            self.quant_config.describe() if self.quant_config is not None else self.quantized_source
        )  # fmt: skip
        fields = [
            ("model", self.model), ("load_format", self.load_format), ("dtype", _dtype_name(self.compute_dtype)),
            ("weight_dtype", _dtype_name(self.weight_dtype)), ("quantization", quant),
            ("quant_activations", self.quant_activations if self.quantized_source is not None else "n/a"),
            ("kv_cache_dtype", self.kv_cache_spec.name), ("block_size", self.block_size), ("isa", self.isa),
            ("cpu_plan", self.cpu_plan.describe()), ("tensor_parallel_size", self.tensor_parallel_size),
            ("data_parallel_size", self.data_parallel_size), ("max_num_seqs", self.max_num_seqs),
            ("max_num_batched_tokens", self.max_num_batched_tokens), ("max_model_len", self.max_model_len),
            ("seed", self.seed), ("device", self.device), ("process_cpus", " | ".join(map(_cores, self.process_cpus)) or "n/a"),
        ]  # fmt: skip
        return ", ".join(f"{k}={v}" for k, v in fields)

"""The model in the engine's own process (tensor_parallel_size 1)."""

from __future__ import annotations

from typing import Any

from perfxlm.executor.base import InProcessExecutor
from perfxlm.lora.layers import wrap_model
from perfxlm.lora.slots import LoRASlots
from perfxlm.model.layers.attention import common_head_dim
from perfxlm.model.loader import load_model
from perfxlm.worker.cuda_graphs import GraphPlan
from perfxlm.worker.model_runner import ModelRunner


class ModuleExecutor(InProcessExecutor):
    """The engine's own modules, loaded in this process."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.model = load_model(config)
        self.runner: ModelRunner | None = None
        # enable_lora: the targeted projections wrapped once, after loading (what adapters are checked against)
        self.lora_targets = self.lora_wrappers = None
        if config.lora_config is not None:
            self.lora_targets, self.lora_wrappers = wrap_model(self.model)

    def kv_bytes_per_block(self, block_size: int, spec: Any) -> int:
        return ModelRunner.kv_bytes_per_block(self.model, block_size, spec)

    def head_dim(self) -> int | None:
        return common_head_dim(self.model)

    def kv_budget_bytes(self) -> int | None:
        c = self.config
        if c.torch_device.type != "cuda":
            return None
        from perfxlm.worker.gpu_memory import kv_budget_bytes

        return kv_budget_bytes(self.model, c.torch_device, c.gpu_memory_utilization, c.max_num_batched_tokens,
                               c.max_num_seqs)  # fmt: skip

    def initialize_cache(self, num_blocks: int) -> None:
        c = self.config
        slots = None
        if c.lora_config is not None:
            slots = LoRASlots(self.lora_wrappers, c.lora_config.max_loras, c.torch_dtype,
                              c.lora_storage_dtype())
        r = c.resolved
        graphs = None
        if r.device.type == "cuda" and not c.enforce_eager:
            graphs = GraphPlan.of(r.max_num_seqs, c.max_model_len, r.block_size)
        self.runner = ModelRunner(self.model, num_blocks, r.block_size, r.kv_cache_spec, slots, graphs)

    def describe(self) -> str:
        return "in-process" if self.config.torch_device.type == "cpu" else f"in-process on {self.config.torch_device}"

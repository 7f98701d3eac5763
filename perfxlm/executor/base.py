"""What the engine core asks of whatever runs the model: one interface, five implementations (in-process
modules, an ONNX graph in ONNX Runtime, a perfxlm-flavor graph on the engine's kernels, spawned
tensor-parallel workers, ranks of an external launcher)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class Executor(ABC):
    world_size: int = 1
    model: Any = None  # the module model in this process (a rank's shard under external launch), else None
    runner: Any = None  # this process's model runner, once the cache is allocated (else None)
    lora_targets: Any = None  # what LoRA adapters are checked against (enable_lora, one process)
    # whether this process's engine proposes speculative draft tokens (else it takes rank 0's)
    proposes_drafts: bool = True

    @abstractmethod
    def kv_bytes_per_block(self, block_size: int, spec: Any) -> int:
        """Bytes one KV block of `block_size` tokens takes in this executor's cache (all layers, this rank)."""

    @abstractmethod
    def head_dim(self) -> int | None:
        """The attention head size when every layer has the same one (for the CPU plan's log line)."""

    @abstractmethod
    def initialize_cache(self, num_blocks: int) -> None:
        """Allocate the paged KV cache of `num_blocks` blocks and build the runner over it."""

    @abstractmethod
    def execute(self, so: Any) -> Any:
        """Run one step: SchedulerOutput -> ModelRunnerOutput."""

    @abstractmethod
    def describe(self) -> str:
        """Where the model runs, in a few words, for the start-up log."""

    def kv_budget_bytes(self) -> int | None:
        """Bytes this executor's KV pool may take where its device sets the limit (a GPU's
        gpu_memory_utilization), else None: the pool's CPU rule."""
        return None

    def agree_num_blocks(self, num_blocks: int) -> int:
        """The pool size every rank's scheduler uses: this process's own plan unless ranks must agree."""
        return num_blocks

    def agree_draft_tokens(self, drafts: dict[str, list[int]]) -> dict[str, list[int]]:
        """The draft tokens (by request id) every rank's scheduler uses next step: this process's own
        unless ranks must agree."""
        return drafts

    def check_health(self) -> None:
        """Raise if a part of the executor (a worker process) has died."""

    def shutdown(self) -> None:
        """Release processes and memory; called once when the engine stops."""


class InProcessExecutor(Executor, ABC):
    """A runner in the engine's own process: a step is the runner's own call, no copy."""

    def execute(self, so: Any) -> Any:
        return self.runner.execute(so)

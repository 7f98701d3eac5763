"""What the engine and a tensor-parallel worker say to each other, besides the messages every child
speaks (`distributed/supervision.py`: Ready, Failed, Stop, StatsQuery / Stats).

The worker sends `Ready(info)` once its shard is loaded; the engine answers `InitCache(num_blocks)`, the
worker `CacheReady()` once its cache exists; then `Step(delta)` per step, answered by rank 0 with
`StepOutput(output)`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class InitCache:
    num_blocks: int


@dataclass(frozen=True)
class CacheReady:
    pass


@dataclass(frozen=True)
class Step:
    delta: Any  # executor.delta.StepDelta: what changed since the last step


@dataclass(frozen=True)
class StepOutput:
    output: Any  # worker.model_runner.ModelRunnerOutput

"""An exported ONNX graph (`perfxlm export onnx`, load_format "onnx") run in the engine's own process by
ONNX Runtime: `OnnxModelRunner` stands where the module model's runner stands."""

from __future__ import annotations

from typing import Any

import torch

from perfxlm.executor.base import InProcessExecutor
from perfxlm.worker.onnx_graph import OnnxDecoderGraph
from perfxlm.worker.onnx_runner import OnnxModelRunner


class OnnxExecutor(InProcessExecutor):
    # no module model (Executor.model stays None): the graph is the model

    def __init__(self, config: Any) -> None:
        self.config = config
        self.graph = OnnxDecoderGraph(config.model, torch.get_num_threads())
        self.runner: OnnxModelRunner | None = None

    def kv_bytes_per_block(self, block_size: int, spec: Any) -> int:
        return block_size * self.graph.kv_bytes_per_token

    def head_dim(self) -> int | None:
        return self.graph.head_dim

    def initialize_cache(self, num_blocks: int) -> None:
        c = self.config
        self.runner = OnnxModelRunner(self.graph, num_blocks, c.block_size, c.kv_cache_spec)

    def describe(self) -> str:
        return f"in-process, ONNX graph ({self.graph.flavor} flavor) in ONNX Runtime"

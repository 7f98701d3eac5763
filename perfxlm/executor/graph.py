"""A `perfxlm`-flavor export (`perfxlm export onnx --flavor perfxlm`) run by the engine itself: the graph's
nodes bound to the engine's kernels (`model/graph/`) stand where a family's model stands, under the
ordinary `ModelRunner` (paged KV cache, prefix caching, chunked prefill, batched decodes)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from perfxlm.executor.base import InProcessExecutor
from perfxlm.export.engine_choices import EngineChoices, run_notes
from perfxlm.export.manifest import GRAPH_FILE, read_manifest
from perfxlm.lora.slots import LoRASlots
from perfxlm.model.graph.kernels import AS_STORED, HeldAs
from perfxlm.model.graph.lora import wrap_graph
from perfxlm.ops import cpu_plan
from perfxlm.quant.layouts import all_for_plan
from perfxlm.model.graph.model import GraphModel
from perfxlm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class GraphExecutor(InProcessExecutor):
    # Executor.model stays None: there is no family module; the graph stands where it would

    def __init__(self, config: Any) -> None:
        self.config = config
        manifest = read_manifest(config.model)
        self.graph = GraphModel(config.model, manifest.get("graph", GRAPH_FILE), held_as(config))
        self.runner: ModelRunner | None = None
        # enable_lora: the targeted Linear nodes wrapped once, as ModuleExecutor wraps a family's projections
        self.lora_targets = self.lora_wrappers = None
        if config.lora_config is not None:
            self.lora_targets, self.lora_wrappers = wrap_graph(self.graph)

    def kv_bytes_per_block(self, block_size: int, spec: Any) -> int:
        return ModelRunner.kv_bytes_per_block(self.graph, block_size, spec)

    def head_dim(self) -> int | None:
        dims = {a.head_dim for a in self.graph.attention_layers}
        return dims.pop() if len(dims) == 1 else None

    def initialize_cache(self, num_blocks: int) -> None:
        c = self.config
        slots = None
        if c.lora_config is not None:
            slots = LoRASlots(self.lora_wrappers, c.lora_config.max_loras, c.torch_dtype,
                              c.lora_storage_dtype())
        self.runner = ModelRunner(self.graph, num_blocks, c.block_size, c.kv_cache_spec, slots)

    def describe(self) -> str:
        return f"in-process, perfxlm-flavor ONNX graph ({len(self.graph.kernels)} nodes on the engine's kernels)"


def held_as(config: Any) -> HeldAs:
    """The run's weights as the engine resolved them for the folder (EngineConfig.resolve: the module path's
    choices for the exported model on this CPU, with the dtype asked for), each difference from the
    choices the export recorded logged; a folder that recorded none runs as stored."""
    recorded = config.export_choices
    if recorded is None:
        return AS_STORED
    if config.torch_dtype != torch.float32:
        raise ValueError(f"{config.model!r}: a perfxlm-flavor graph runs float32 activations; this run resolves "
                         f"{config.torch_dtype} (PERFXLM_BF16_COMPUTE): unset it to run the graph.")
    for note in run_notes(recorded, EngineChoices.of(config)):
        logger.warning("%s: %s.", config.model, note)
    # the module path's code layouts too (a tied head's few-row layout is the module path's alone: a graph's
    # head node does not say it is one, so under row_groups_k "head" a K-quant head stays plain here)
    plan = cpu_plan.plan()
    return HeldAs(config.weight_dtype, config.quant_activation_mode, all_for_plan(plan.row_groups, plan.row_groups_k))

"""LoRA adapters on a graph: the Linear nodes an adapter may target wrapped in the module path's own
`LoRALinear`, so a step's adapters are added by the same `LoRABatch` products (and, on all-decode steps,
by the fused decode layer's LoRA kernel) as on a family's modules.

Adapters are bound at run time, not graph inputs: the graph holds the base model only, and the runner's
`LoRASlots` fills the wrappers with whichever adapters the step's requests name (vLLM's model: adapters
come and go with requests, the model is loaded once). Which nodes are targets, and how an adapter's
checkpoint module names land on them (q_proj -> rows of qkv_proj), is what the export recorded in the
graph (export/lora_record.py); a node the record names must be a Linear of the recorded shape."""

from __future__ import annotations

from perfxlm.export.lora_record import LORA_KEY, read_lora_record
from perfxlm.lora.layers import LoRALinear
from perfxlm.lora.targets import LoRATargets
from perfxlm.model.graph.kernels import Linear
from perfxlm.model.graph.model import GraphModel


def wrap_graph(graph: GraphModel) -> tuple[LoRATargets, list[LoRALinear]]:
    """Wrap every Linear node the graph's record names; (the targets adapters are checked against, the
    wrappers in node order). ValueError where the graph has no record or does not hold what it names."""
    targets = read_lora_record(graph.metadata.get(LORA_KEY), graph.path)
    wrappers = []
    for name, target in targets.modules.items():
        kernel = graph.named.get(name)
        if not isinstance(kernel, Linear):
            raise ValueError(f"{graph.path}: the graph's LoRA targets name {name!r}, which is not a Linear node "
                             "of the graph: export the model again.")
        if (kernel.in_features, kernel.out_features) != (target.in_features, target.out_features):
            raise ValueError(f"{graph.path}: Linear node {name!r} takes {kernel.in_features} inputs to "
                             f"{kernel.out_features} outputs; the graph's LoRA targets record "
                             f"{target.in_features} to {target.out_features}: export the model again.")
        wrapper = LoRALinear(kernel, name)
        graph.replace_kernel(kernel, wrapper)
        wrappers.append(wrapper)
    return targets, wrappers

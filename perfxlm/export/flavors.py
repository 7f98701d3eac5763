"""The flavors `perfxlm export onnx --flavor` knows: a name -> its `GraphOps` (a new target runtime is one
subclass and one entry here)."""

from __future__ import annotations

from perfxlm.export.graph import Graph
from perfxlm.export.graph_ops import GraphOps, OrtOps
from perfxlm.export.perfxlm_ops import PerfxlmOps

FLAVORS: dict[str, type[GraphOps]] = {"ort": OrtOps, "standard": GraphOps, "perfxlm": PerfxlmOps}


def graph_ops(flavor: str, g: Graph) -> GraphOps:
    try:
        cls = FLAVORS[flavor]
    except KeyError:
        raise ValueError(f"ONNX flavor {flavor!r} is not known (known: {', '.join(FLAVORS)}).") from None
    return cls(g)

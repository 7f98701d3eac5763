"""What an exported folder promises the engine that runs it: `perfxlm_onnx.json` (format version,
flavor, family) and the op types its graphs may hold. Read by the exporter, which writes it, and by the
engine's ONNX runner, which refuses a folder whose version or ops it does not know before starting."""

from __future__ import annotations

import json
import os
from typing import Any

FORMAT_VERSION = 1
MANIFEST = "perfxlm_onnx.json"
GRAPH_FILE = "model.onnx"
GENAI_CONFIG = "genai_config.json"
ENGINE_KEY = "engine"  # a perfxlm-flavor export's EngineChoices (export/engine_choices.py)

# The perfxlm flavor's custom ops (export/perfxlm_ops.py defines them, model/graph/ runs them): their domain
# and its version, raised when an op's inputs, outputs or attributes change meaning.
PERFXLM_DOMAIN = "perfxlm"
PERFXLM_OPSET = 4
# version 2: PagedAttention's logit_soft_cap attribute (Gemma 2). A graph is written at the lowest version
# that holds it (one without a soft cap at 1), so engines that run version 1 still run those; this engine
# runs every version up to PERFXLM_OPSET
SOFT_CAP_OPSET = 2
# version 3: OPT's, gpt-oss's and DeepSeek's pieces: the ops Add, PositionEmbedding, LayerNorm, Activation,
# TopKSoftmax, GroupedTopK, Experts and LatentAttention, PagedAttention's sinks input and query_scale
# attribute
FAMILIES_OPSET = 3
# version 4: 5- and 6-bit codes (a weight's bits attribute 5 or 6) hold their bit planes in the order of
# perfxlm/quant/code_layout.py's PLANE_BIT; graphs of version 3 and below held them in GGUF Q5_0's order
# (element e at bit e of a block's word), which this engine no longer reads
PLANES_OPSET = 4

# domain -> op types the exporter writes (graph_ops.py); the runner refuses any other
KNOWN_OPS = {
    "": {"Add", "And", "Cast", "Clip", "Concat", "ConstantOfShape", "CumSum", "Div", "Erf", "Expand", "Gather",
         "GatherElements", "Gemm", "Greater", "Identity", "LayerNormalization", "LessOrEqual", "MatMul", "Min",
         "Mul", "Neg", "NonZero", "OneHot", "Range", "Reciprocal", "ReduceMax", "ReduceMean", "ReduceSum", "Relu",
         "Reshape", "ScatterND", "Shape", "Sigmoid", "SimplifiedLayerNormalization", "Slice", "Softmax", "Split",
         "Sqrt", "Sub", "Tanh", "Tile", "TopK", "Transpose", "Unsqueeze", "Where"},
    "com.microsoft": {"GroupQueryAttention", "MatMulNBits", "RotaryEmbedding",
                      "SkipSimplifiedLayerNormalization"},
}


def is_export(folder: str) -> bool:
    return os.path.isdir(folder) and os.path.isfile(os.path.join(folder, MANIFEST))


def read_manifest(folder: str) -> dict[str, Any]:
    """The folder's manifest; ValueError naming what is missing or not known."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        raise ValueError(f"{folder!r} is not an ONNX export of perfxlm: it has no {MANIFEST} "
                         "(write one with `perfxlm export onnx`).")
    with open(path) as f:
        manifest = json.load(f)
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise ValueError(f"{path}: format_version {version!r} is not known to this engine (it runs version "
                         f"{FORMAT_VERSION}); export the model again with this version of perfxlm.")
    # the perfxlm flavor is the engine's own graph: no onnxruntime-genai description
    needed = [manifest.get("graph", GRAPH_FILE)] + ([] if manifest.get("flavor") == "perfxlm" else [GENAI_CONFIG])
    for name in needed:
        if not os.path.isfile(os.path.join(folder, name)):
            raise ValueError(f"ONNX export {folder!r} lacks {name}.")
    return manifest


def read_engine_choices(folder: str, manifest: dict[str, Any]) -> Any:
    """The EngineChoices a perfxlm-flavor export recorded, or None where it predates them (its weights
    then run as float32 exports did: weight-only products)."""
    from perfxlm.export.engine_choices import EngineChoices

    if ENGINE_KEY not in manifest:
        return None
    return EngineChoices.from_json(manifest[ENGINE_KEY], os.path.join(folder, MANIFEST))


def check_graph_ops(graph_path: str) -> None:
    """ValueError naming the first node whose op type (or domain) the engine does not run."""
    import onnx

    model = onnx.load(graph_path, load_external_data=False)
    for node in model.graph.node:
        if node.op_type not in KNOWN_OPS.get(node.domain or "", ()):
            domain = node.domain or "ai.onnx"
            raise ValueError(f"{graph_path}: node {node.name!r} is op {domain}::{node.op_type}, which the "
                             f"engine does not run (it runs the graphs `perfxlm export onnx` writes).")

"""What a LoRA adapter may target in a `perfxlm`-flavor graph, recorded in the graph at export.

An adapter names modules as its checkpoint does (`model.layers.3.self_attn.q_proj`); the graph's Linear
nodes are the engine's fused projections (`...self_attn.qkv_proj`), named as the module path names them.
Without the family's module code the engine cannot place one on the other, so the export writes, in the
ONNX model's metadata (`LORA_KEY`), the projections the module path would let an adapter target
(`LoRATargets.of`: each one's input width, output width and the output rows of each fused part) and the
model's checkpoint-name tables (`renames`, `stacked_params`), from which the run rebuilds the same
`LoRATargets` the module path checks adapters against. The record is data the run reads; it does not
change what any op computes, so the op set's version stays.
"""

from __future__ import annotations

import json
from typing import Any

from perfxlm.lora.targets import LoRATargets, TargetModule
from perfxlm.model.models.base import CheckpointNames

LORA_KEY = "perfxlm.lora_targets"
RECORD_VERSION = 1


def lora_record(model: Any) -> str:
    """The record for a loaded module model (the one the graph is written from)."""
    targets = LoRATargets.of(model)
    return json.dumps({
        "version": RECORD_VERSION,
        "renames": [list(r) for r in model.renames],
        "stacked_params": [list(s) for s in model.stacked_params],
        "modules": {name: {"in": t.in_features, "out": t.out_features,
                           "parts": {shard: list(span) for shard, span in t.parts.items()}}
                    for name, t in targets.modules.items()},
    })


def read_lora_record(text: str | None, path: str) -> LoRATargets:
    """The LoRATargets a graph's record describes; ValueError where there is none or it is not this
    version's."""
    if text is None:
        raise ValueError(f"{path}: the graph records no LoRA targets (it was exported before LoRA ran on "
                         "graphs): export the model again with this version of perfxlm to serve adapters.")
    try:
        record = json.loads(text)
        if record.get("version") != RECORD_VERSION:
            raise ValueError(f"version {record.get('version')!r}, this engine reads {RECORD_VERSION}")
        modules = {name: TargetModule(name, int(m["in"]), int(m["out"]),
                                      {shard: (int(s[0]), int(s[1])) for shard, s in m["parts"].items()})
                   for name, m in record["modules"].items()}
        names = CheckpointNames([tuple(r) for r in record["renames"]], [tuple(s) for s in record["stacked_params"]])
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
        raise ValueError(f"{path}: the graph's LoRA target record ({LORA_KEY}) is not one this engine "
                         f"reads ({exc}): export the model again with this version of perfxlm.") from None
    return LoRATargets(modules, names.locate)

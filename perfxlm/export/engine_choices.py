"""What the engine chose for a model when it was exported: the weight, activation and KV-cache dtypes
`EngineConfig.resolve` settled on, the quantized products' activation rounding, and the CPU facts the
kernels are bound by (the native build's tier, whether it has int8 dot products, the bf16 layout).

A `perfxlm`-flavor export writes these into its manifest (`perfxlm_onnx.json`, key "engine"); the
weights are stored as the engine held them (bf16 where it held bf16). The engine running the folder
resolves its own choices with the same code, from the same options and the recorded quantized source,
so on the exporting CPU both sides are equal and the graph binds the module path's kernels; on a CPU
where they differ, this CPU's choices run (as the module path's would here) and `differences` names
what moved. Nothing here decides anything: it reads decisions already made."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype))


@dataclass(frozen=True)
class EngineChoices:
    dtype: str  # the dtype option resolved: "auto", "float32" or "bfloat16"
    quantized_source: str | None  # where quantized weights come from ("gguf", "int4", ...), None: all float
    weight_dtype: str  # float matrices held (and stored in the graph) as
    compute_dtype: str  # activations
    kv_cache_dtype: str  # the paged KV cache's element format (ops.kv_quant.KVCacheSpec name)
    quant_activations: str  # quantized products' activations (quant.weight.ActivationMode value)
    isa: str  # the tier the native kernels are built for; "none" without them
    int8_dots: bool  # whether that build rounds activations to int8 blocks for its quantized GEMV
    bf16_layout: str  # how bf16 matrices are laid out for products ("rows" | "panels")

    # what only says where the weights came from: a difference there is not the CPU's
    _SOURCE_FIELDS = ("dtype", "quantized_source")

    @classmethod
    def of(cls, config: Any) -> "EngineChoices":
        """The choices a resolved EngineConfig made, with the CPU facts its kernels will be bound by."""
        from perfxlm.model.loader import linear_plan
        from perfxlm.ops import cpu_plan, native

        built = native.kernels() is not None
        layout = linear_plan(config.weight_dtype, config.torch_dtype, None).layout
        return cls(
            # an explicit dtype option is the weights' (aliases such as "fp32" spelled out)
            dtype="auto" if config.dtype == "auto" else dtype_name(config.weight_dtype),
            quantized_source=config._quantized_source(),
            weight_dtype=dtype_name(config.weight_dtype), compute_dtype=dtype_name(config.torch_dtype),
            kv_cache_dtype=config.kv_cache_spec.name, quant_activations=str(config.quant_activation_mode),
            isa=cpu_plan.plan().isa if built else "none", int8_dots=cpu_plan.has_int8_dots(), bf16_layout=layout,
        )  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Any, where: str) -> "EngineChoices":
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(data, dict) or set(data) != names:
            raise ValueError(f"{where}: its \"engine\" entry must hold exactly {', '.join(sorted(names))}; "
                             "export the model again with this version of perfxlm.")
        return cls(**data)

    def differences(self, here: "EngineChoices") -> list[str]:
        """`name: exported -> here` for each choice that differs (the weights' source fields aside)."""
        out = []
        for f in dataclasses.fields(self):
            mine, theirs = getattr(self, f.name), getattr(here, f.name)
            if f.name not in self._SOURCE_FIELDS and mine != theirs:
                out.append(f"{f.name}: {mine} -> {theirs}")
        return out


def run_notes(recorded: EngineChoices, here: EngineChoices) -> list[str]:
    """What a user running an export should know where this run's choices are not the recorded ones:
    another CPU (the same options resolved otherwise), or another dtype asked for at run time."""
    notes = []
    moved = recorded.differences(here)
    if moved and here.dtype == recorded.dtype:
        notes.append(f"exported where the engine chose otherwise for this model ({'; '.join(moved)}); it runs "
                     "with the choices made here (this CPU, these options), as the module path does, so its "
                     "output is the module path's here, not the exporting machine's")
    elif here.dtype != recorded.dtype:
        notes.append(f"exported with dtype={recorded.dtype!r}, run with dtype={here.dtype!r}: weights, "
                     "activations and KV cache as the module path holds them with that dtype"
                     + (f" ({'; '.join(moved)})" if moved else ""))
    if recorded.weight_dtype == "bfloat16" and here.weight_dtype != "bfloat16":
        notes.append(f"its float matrices were stored in bfloat16 at export: widened to {here.weight_dtype} "
                     "here they keep their bf16 values (export with --dtype float32 for float32 weights)")
    return notes

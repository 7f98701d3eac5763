"""The projections of a built model an adapter may target, and where a PEFT module name lands.

PEFT names modules as the checkpoint does (`model.layers.3.self_attn.q_proj`); the engine fuses q|k|v
and gate|up into one projection. The model's own checkpoint tables (`CausalLM.locate`) say which fused
projection and which slice of its output a name is; an adapter's B for q_proj then fills the q rows.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from perfxlm.model.layers.linear import Linear, MergedLinear


@dataclass(frozen=True)
class TargetModule:
    """One projection an adapter may target: its input width and the output slices it is made of."""

    name: str  # the engine's module name, e.g. model.layers.3.self_attn.qkv_proj
    in_features: int
    out_features: int
    parts: dict[str, tuple[int, int]]  # shard -> (first output row, rows); {} for a plain projection

    def rows(self, shard: str | None) -> tuple[int, int]:
        return (0, self.out_features) if shard is None else self.parts[shard]


@dataclass(frozen=True)
class LoRATargets:
    modules: dict[str, TargetModule]
    locate: object  # the model's CausalLM.locate: checkpoint name -> (parameter name, shard)

    @classmethod
    def of(cls, model: nn.Module) -> "LoRATargets":
        """Every decoder-layer projection (routers and gates excluded, as quantization excludes them)."""
        modules = {}
        for name, m in model.named_modules():
            if isinstance(m, Linear) and m.quantize_weight and ".layers." in f".{name}":
                parts = {s: (m.offsets[s], n) for s, n in m.output_sizes.items()} if isinstance(m, MergedLinear) else {}
                modules[name] = TargetModule(name, m.in_features, m.out_features, parts)
        return cls(modules, model.locate)

    def resolve(self, peft_module: str) -> tuple[TargetModule, str | None]:
        """(target, shard) for an adapter's module name; ValueError when the model has no such projection."""
        param, shard = self.locate(f"{peft_module}.weight")  # type: ignore[operator]
        module = param.rsplit(".", 1)[0]
        target = self.modules.get(module)
        if target is None or (shard is not None and shard not in target.parts):
            example = next(iter(self.modules), "")
            raise ValueError(
                f"the adapter targets {peft_module!r}, which is not a projection of this model's decoder layers "
                f"(attention and MLP projections such as {example!r}): the adapter was trained for another "
                "base model or targets modules LoRA is not supported on here (embeddings, the LM head)."
            )
        return target, shard

"""What a layer declares about its weights to the quantized-weight sink, so that quant never imports the
model's layer classes: which parameters may hold a `QuantizedWeight`, of which kind, and whether
`quantization=` quantizes them at load."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

LINEAR, EXPERTS, TABLE = "linear", "experts", "table"


@dataclass(frozen=True)
class QuantizableWeight:
    param: str  # the parameter's name on the layer
    kind: str  # LINEAR (one [N, K] matrix), EXPERTS (a stack [E, N, K]) or TABLE (embedding / LM head rows)
    in_features: int
    at_load: bool = True  # whether quantization= quantizes it (MoE routers and gates stay float)
    # TABLE only: the rows are only looked up (an embedding), never multiplied (an LM head); a table all
    # of whose owners only look it up may take narrower codes (`perfxlm.quant.mixed`)
    lookup: bool = False


@runtime_checkable
class QuantizableLayer(Protocol):
    def quantizable_weights(self) -> list[QuantizableWeight]: ...

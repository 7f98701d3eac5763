"""The loading seam of tensor-parallel layers: a layer that holds one rank's shard of a weight cuts that
shard out of each checkpoint tensor bound for it (`rank_part`), before the quantized-weight sink or the
plain copy sees the tensor. Layers without it take checkpoint tensors whole (replicated).

The cuts take float tensors and quantized ones (`QuantizedWeight`: a GGUF file's blocks) alike: output
rows are moved as rows of codes, input columns as whole groups (`QuantizedWeight.narrow_columns`), so a
rank's linear method gets the shard in the form the whole weight had. Dims count from the end, so the
same cut serves one matrix [N, K] and an expert stack [E, N, K]."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from perfxlm.quant import joining
from perfxlm.quant.weight import QuantizedWeight

ROWS, COLUMNS = -2, -1


@runtime_checkable
class RankSharded(Protocol):
    def rank_part(self, param_name: str, tensor: Any, shard: str | None, expert: int | None) -> Any:
        """This rank's part of checkpoint `tensor`, bound for parameter `param_name` (shard `shard` of a
        fused parameter, of expert `expert` of a stacked one, else the whole parameter)."""
        ...


def check_whole(tensor: Any, dim: int, whole: int) -> None:
    """A checkpoint tensor must be the whole weight before a rank cuts it (at one rank the parameter's own
    shape check does this): a wrong size is an error, not a shard of the wrong rows."""
    d = 0 if len(tensor.shape) == 1 else dim
    if tensor.shape[d] != whole:
        raise ValueError(f"checkpoint shape {tuple(tensor.shape)}: the model expects {whole} along dim {d % len(tensor.shape)}")


def narrow(tensor: Any, dim: int, start: int, size: int, whole: int | None = None) -> Any:
    """`tensor`'s [start, start + size) along `dim` (ROWS or COLUMNS; a 1-D bias: its only dim), contiguous
    (what a sink quantizes or a copy reads); `whole`: the size `tensor` must have along `dim`."""
    if whole is not None:
        check_whole(tensor, dim, whole)
    if isinstance(tensor, QuantizedWeight):
        if dim == ROWS:
            return tensor.narrow_rows(start, size)
        return tensor.narrow_columns(start, size)
    if tensor.dim() == 1:
        dim = 0
    return tensor.narrow(dim, start, size).contiguous()


def take_parts(tensor: Any, dim: int, pieces: list[tuple[int, int]], whole: int | None = None) -> Any:
    """The (start, size) pieces of `tensor` along `dim`, concatenated in order (rows of a fused weight)."""
    if whole is not None:
        check_whole(tensor, dim, whole)
    parts = [narrow(tensor, dim, start, size) for start, size in pieces]
    if isinstance(tensor, QuantizedWeight):
        return joining.cat_rows(parts)
    return torch.cat(parts, dim=0 if tensor.dim() == 1 else dim)


def pad_rows(tensor: Any, rows: int) -> Any:
    """`tensor` with zero rows appended up to `rows` (the last rank's vocabulary shard)."""
    missing = rows - tensor.shape[0]
    if missing <= 0:
        return tensor
    if isinstance(tensor, QuantizedWeight):
        return joining.cat_rows([tensor, tensor.zero_rows(missing)])
    return torch.cat([tensor, torch.zeros((missing, *tensor.shape[1:]), dtype=tensor.dtype)])

"""Tensor-parallel linear layers: each owns its rank's shard of the weight and the collective its
product needs, as vLLM's ColumnParallelLinear / RowParallelLinear / QKVParallelLinear /
MergedColumnParallelLinear.

A layer reads the group it is built for once (`distributed.parallel_state.tp_group()`; one rank outside
a tensor-parallel load) and sizes its weight to its shard, so the linear method bound at load (float,
bf16 rows or panels, a quantized format) works on the shard as it would on a whole weight. The loader
offers each checkpoint tensor to the layer first (`rank_part`, the `RankSharded` seam): the layer cuts its
rows or columns out, and the quantized-weight sink and `load_shard` see only those.

- Column-parallel (q|k|v, gate|up): the output rows are split; no collective, each rank's slice of y feeds
  the row-parallel layer after it. QKV splits the KV heads in contiguous groups as evenly as they go
  (3 KV heads over 2 ranks: 2 and 1), each rank taking its KV heads' query heads, so attention needs no
  communication and each rank's KV cache holds its own heads.
- Row-parallel (o, down): the input columns are split the way the column-parallel layer before it split
  its outputs (`input_part`); the partial products are summed by one all-reduce in `forward` (or by the
  caller where several partial sums are added first, `reduce_results=False`: a MoE block's experts and
  shared expert); a bias is added once, by rank 0.

With one rank every layer here is its plain kind (`Linear`, `MergedLinear`) with the same parameters,
and `forward` calls no collective.
"""

from __future__ import annotations

from typing import Any

import torch

from perfxlm.distributed.parallel_state import TPGroup, tp_group
from perfxlm.model.layers.linear import Linear, MergedLinear
from perfxlm.model.layers.rank_sharded import COLUMNS, ROWS, check_whole, narrow, take_parts


class ColumnParallelLinear(Linear):
    """y[:, rank's rows] = x W[rank's rows]^T + b[rank's rows]."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        output_part: tuple[int, int] | None = None,  # the rows this rank holds, where whole heads decide it
    ) -> None:
        tp = tp_group()
        start, size = output_part if output_part is not None and tp.parallel else tp.part(out_features)
        super().__init__(in_features, size, bias)
        self.tp: TPGroup = tp
        self.output_part = (start, size)
        self.full_out_features = out_features

    def rank_part(self, param_name: str, tensor: Any, shard: str | None, expert: int | None) -> Any:
        if not self.tp.parallel:
            return tensor
        return narrow(tensor, ROWS, *self.output_part, whole=self.full_out_features)


class RowParallelLinear(Linear):
    """y = sum over ranks of x[:, rank's columns] W[:, rank's columns]^T, plus b once."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        reduce_results: bool = True,
        input_part: tuple[int, int] | None = None,  # the columns the layer before gave this rank
    ) -> None:
        tp = tp_group()
        start, size = input_part if input_part is not None else tp.part(in_features)
        super().__init__(size, out_features, bias)
        self.tp = tp
        self.input_part = (start, size)
        self.full_in_features = in_features
        self.reduces_output = reduce_results and tp.parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x, self.bias)
        return self.tp.all_reduce(y) if self.reduces_output else y

    def rank_part(self, param_name: str, tensor: Any, shard: str | None, expert: int | None) -> Any:
        if not self.tp.parallel:
            return tensor
        if param_name == "bias":  # summed over ranks: rank 0 adds it, the others add zeros
            check_whole(tensor, 0, self.out_features)
            return tensor if self.tp.rank == 0 else torch.zeros_like(tensor)
        return narrow(tensor, COLUMNS, *self.input_part, whole=self.full_in_features)


class _MergedColumnParallel(MergedLinear):
    """Several column-parallel projections stacked: part `name` of the whole weight has `full_sizes[name]`
    rows, of which this rank holds `ranges[name]` = (start within the part, size)."""

    def __init__(
        self, in_features: int, full_sizes: dict[str, int], ranges: dict[str, tuple[int, int]], bias: bool,
        tp: TPGroup,
    ) -> None:  # fmt: skip
        super().__init__(in_features, {name: ranges[name][1] for name in full_sizes}, bias)
        self.tp = tp
        self.full_sizes = full_sizes
        self.ranges = ranges

    def rank_part(self, param_name: str, tensor: Any, shard: str | None, expert: int | None) -> Any:
        if not self.tp.parallel:
            return tensor
        if shard is not None:  # one part's checkpoint tensor (q_proj, gate_proj)
            return narrow(tensor, ROWS, *self.ranges[shard], whole=self.full_sizes[shard])
        # the checkpoint stores the parts already fused (Phi-3's qkv_proj, gate_up_proj)
        pieces, offset = [], 0
        for name, full in self.full_sizes.items():
            start, size = self.ranges[name]
            pieces.append((offset + start, size))
            offset += full
        return take_parts(tensor, ROWS, pieces, whole=offset)


class MergedColumnParallelLinear(_MergedColumnParallel):
    """gate|up: each part's rows split evenly across ranks."""

    def __init__(self, in_features: int, output_sizes: dict[str, int], bias: bool = False) -> None:
        tp = tp_group()
        super().__init__(in_features, dict(output_sizes), {n: tp.part(s) for n, s in output_sizes.items()}, bias, tp)


class QKVParallelLinear(_MergedColumnParallel):
    """q|k|v split by KV heads: this rank's KV heads and the query heads of their groups. `num_heads` /
    `num_kv_heads` are this rank's; `q_part` is the columns of the output projection they feed."""

    def __init__(
        self, in_features: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False
    ) -> None:
        tp = tp_group()
        q_start, heads, kv_start, kv_heads = 0, num_heads, 0, num_kv_heads
        if tp.parallel:
            if num_heads % num_kv_heads:
                raise ValueError(f"{num_heads} attention heads do not form groups over {num_kv_heads} KV heads.")
            if tp.world_size > num_kv_heads:
                raise ValueError(f"tensor_parallel_size={tp.world_size} exceeds the model's {num_kv_heads} KV "
                                 "heads: each rank needs at least one KV head.")
            group = num_heads // num_kv_heads
            kv_start, kv_heads = tp.part(num_kv_heads)
            q_start, heads = kv_start * group, kv_heads * group
        full = {"q": num_heads * head_dim, "k": num_kv_heads * head_dim, "v": num_kv_heads * head_dim}
        kv = (kv_start * head_dim, kv_heads * head_dim)
        ranges = {"q": (q_start * head_dim, heads * head_dim), "k": kv, "v": kv}
        super().__init__(in_features, full, ranges, bias, tp)
        self.head_dim = head_dim
        self.num_heads = heads
        self.num_kv_heads = kv_heads
        self.q_part = ranges["q"]

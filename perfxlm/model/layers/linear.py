"""Linear layers, including the fused ones (QKV, gate|up) that load several checkpoint tensors."""

from __future__ import annotations

import torch
from torch import nn

from perfxlm.ops.linear import linear, unpack_bf16


class Linear(nn.Module):
    """`weight` is a Parameter [N, K], or a `perfxlm.quant.QuantizedWeight` once a quantized checkpoint
    or `quantization=` replaced it (ops.linear dispatches on which)."""

    # whether `quantization=` quantizes this projection (MoE routers and gates stay float, as in vLLM)
    quantize_weight = True

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.out_features)

    def weight_matrix(self) -> torch.Tensor:
        """W as a plain [N, K] tensor whatever its storage (packed bf16 panels, quantized codes): for
        code that uses W otherwise than in x W^T (MLA folds it into per-head matrices)."""
        w = self.weight
        if not isinstance(w, torch.Tensor):
            return w.dequantize()
        return unpack_bf16(w, self.out_features) if w.dim() == 3 else w


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dim; each checkpoint
    tensor is loaded into its slice (`shard`)."""

    def __init__(self, in_features: int, output_sizes: dict[str, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(output_sizes.values()), bias)
        self.output_sizes = output_sizes
        self.offsets: dict[str, int] = {}
        offset = 0
        for name, size in output_sizes.items():
            self.offsets[name] = offset
            offset += size

    def expected_shards(self, param_name: str) -> list[str]:
        """Shards the checkpoint must provide for `weight` / `bias` (or one tensor already fused)."""
        return list(self.output_sizes)

    def load_shard(
        self, param: nn.Parameter, loaded: torch.Tensor, shard: str, expert: int | None = None
    ) -> None:
        if expert is not None:
            raise ValueError(f"shard {shard!r}: a per-expert tensor cannot load into a dense projection")
        start, size = self.offsets[shard], self.output_sizes[shard]
        target = param.data.narrow(0, start, size)
        if target.shape != loaded.shape:
            raise ValueError(
                f"shard {shard!r}: checkpoint shape {tuple(loaded.shape)} != {tuple(target.shape)}"
            )
        target.copy_(loaded)

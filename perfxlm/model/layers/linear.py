"""Linear layers, including the fused ones (QKV, gate|up) that load several checkpoint tensors."""

from __future__ import annotations

import torch
from torch import nn

from perfxlm.model.layers.activation import get_activation
from perfxlm.model.layers.linear_methods.base import LinearMethod, LinearPlan
from perfxlm.model.layers.linear_methods.registry import method_for
from perfxlm.model.layers.linear_methods.unquantized import UnquantizedLinear
from perfxlm.quant.targets import LINEAR, QuantizableWeight


class Linear(nn.Module):
    """y = x W^T + b by the layer's `method` (model/layers/linear_methods/): the float method while the
    model is built and loaded, then the one chosen at load for what `weight` holds (a Parameter in the
    plan's float layout, or a `perfxlm.quant.QuantizedWeight` the quantized-weight sink installed)."""

    # whether `quantization=` quantizes this projection (MoE routers and gates stay float, as in vLLM)
    quantize_weight = True
    # whether forward sums the ranks' partial products (a row-parallel layer under tensor parallelism):
    # the fused decode layer, which runs the product itself, has no place for that collective
    reduces_output = False

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.method: LinearMethod = UnquantizedLinear()
        self.method.create_weights(self, in_features, out_features, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, self.bias)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """self(x) + residual, the sum in the product's own last pass where the method has one (W8A8's
        integer-GEMM epilogue). A subclass whose forward adds work (a collective, adapters) keeps it."""
        if type(self).forward is not Linear.forward:
            return self(x) + residual
        return self.method.apply_add(self, x, self.bias, residual)

    def forward_act(self, x: torch.Tensor, act: str) -> torch.Tensor:
        """act(self(x)) for a transformers `hidden_act` name, the activation in the product's own last pass
        where the method has one (W8A8's integer-GEMM epilogue: GELU). A subclass whose forward adds work
        keeps it."""
        if type(self).forward is not Linear.forward:
            return get_activation(act)(self(x))
        return self.method.apply_act(self, x, self.bias, act)

    def quantizable_weights(self) -> list[QuantizableWeight]:
        return [QuantizableWeight("weight", LINEAR, self.in_features, self.quantize_weight)]

    def bind_linear_method(self, plan: LinearPlan) -> None:
        self.method = method_for(self.weight, plan)
        self.method.process_after_loading(self, plan)

    def weight_matrix(self) -> torch.Tensor:
        """W as a plain [N, K] tensor whatever its storage (packed bf16 panels, quantized codes): for
        code that uses W otherwise than in x W^T (MLA folds it into per-head matrices)."""
        return self.method.weight_matrix(self.weight, self.out_features)


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

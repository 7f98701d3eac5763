"""Mixture-of-experts MLP: softmax top-k routing, then each expert runs once on the tokens routed to it.

The (token, expert) pairs are sorted by expert so every expert's tokens form one contiguous group: one
pair of matrix multiplications per expert that got any token, never a loop over tokens. The experts run
in one native call (`ops/fused_moe.py`) where the kernels are built and take the weights; the torch loop
over experts (`grouped_experts_torch`) is the same ops in the same order, and its reference.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from perfxlm.distributed.parallel_state import tp_group
from perfxlm.model.layers.activation import ClampedSwiGLU, GeluAndMul, SiluAndMul, act_and_mul
from perfxlm.model.layers.linear import Linear
from perfxlm.model.layers.linear_methods.base import LinearMethod, LinearPlan
from perfxlm.model.layers.linear_methods.registry import method_for
from perfxlm.model.layers.rank_sharded import COLUMNS, ROWS, check_whole, narrow, take_parts
from perfxlm.ops import cpu_plan
from perfxlm.ops.fused_moe import ExpertActivation, ExpertsCall, experts_call, prepare
from perfxlm.ops.linear import linear
from perfxlm.quant.targets import EXPERTS, QuantizableWeight

Multiply = Callable[[torch.Tensor, Any, "torch.Tensor | None", int], torch.Tensor]


def _any_weight(x: torch.Tensor, w: Any, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return linear(x, w, bias, out_features)  # the weight's form read per call: stacks no FusedMoE owns


def expert_activation(act: nn.Module) -> ExpertActivation | None:
    """The native kernel's name for an experts' activation module, or None (torch version only)."""
    if type(act) is SiluAndMul:
        return ExpertActivation(0)
    if type(act) is GeluAndMul:
        return ExpertActivation(1 if act.approximate == "tanh" else 2)
    if type(act) is ClampedSwiGLU:
        return ExpertActivation(3, act.alpha, act.limit)
    return None


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits -> (weights [T, k] float32, expert ids [T, k] int64)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_experts(
    x: torch.Tensor,  # [T, hidden]
    weights: torch.Tensor,  # [T, k]
    expert_ids: torch.Tensor,  # [T, k] int64
    gate_up: torch.Tensor,  # [E, 2 * inter, hidden] (or a quantized stack)
    down: torch.Tensor,  # [E, hidden, inter]
    act: nn.Module,
    gate_up_bias: torch.Tensor | None = None,  # [E, 2 * inter] (gpt-oss)
    down_bias: torch.Tensor | None = None,  # [E, hidden]
    gate_up_multiply: Multiply = _any_weight,  # the stacks' linear methods' products (FusedMoE's)
    down_multiply: Multiply = _any_weight,
    bf16_gemm: bool = False,  # quantized stacks' many rows may take the CPU's bf16 GEMM (their methods' decision)
) -> torch.Tensor:  # [T, hidden]
    activation = expert_activation(act)
    if activation is not None:
        out = experts_call(x, weights, expert_ids, gate_up, down, activation, gate_up_bias, down_bias, bf16_gemm)
        if out is not None:
            return out
    return grouped_experts_torch(x, weights, expert_ids, gate_up, down, act, gate_up_bias, down_bias,
                                 gate_up_multiply, down_multiply)


def grouped_experts_torch(
    x: torch.Tensor,
    weights: torch.Tensor,
    expert_ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: nn.Module,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    gate_up_multiply: Multiply = _any_weight,
    down_multiply: Multiply = _any_weight,
) -> torch.Tensor:
    """grouped_experts in torch ops, one expert after another."""
    num_tokens, top_k = expert_ids.shape
    flat = expert_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token_of = order // top_k  # the token each sorted pair belongs to
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    xs = x.index_select(0, token_of)
    ws = weights.reshape(-1).index_select(0, order).to(x.dtype).unsqueeze(1)
    out_sorted = torch.empty_like(xs)
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        end = start + n
        # torch's own where the stacks share the activations' dtype; bf16 stacks under float32 activations
        # go to the native row kernel (or the CPU's bf16 GEMM), never widened whole.
        w = gate_up[expert]
        b = None if gate_up_bias is None else gate_up_bias[expert]
        h = gate_up_multiply(xs[start:end], w, b, w.shape[-2])
        h = act(h)
        w = down[expert]
        out = down_multiply(h, w, None if down_bias is None else down_bias[expert], w.shape[-2])
        out_sorted[start:end] = out * ws[start:end]
        start = end
    # Pairs are added in expert order, as transformers accumulates them: the same float32 sums.
    return torch.zeros_like(x).index_add_(0, token_of, out_sorted)


class FusedMoE(nn.Module):
    """`num_experts` gated MLPs stored stacked: gate_up_proj [E, 2 * inter, hidden] and down_proj
    [E, hidden, inter], transformers 5's layout, so its fused checkpoints load as they are; per-expert
    checkpoint tensors load through `load_shard`.

    Under tensor parallelism every rank holds every expert with its share of the intermediate size (vLLM's
    default for MoE under TP): routing is replicated, the stacks are column- (gate|up) and row-parallel
    (down), and the partial outputs are summed by one all-reduce (by the caller with
    `reduce_results=False`, where a shared expert's partial output is added first)."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        activation: str = "silu",
        reduce_results: bool = True,
        bias: bool = False,  # gpt-oss: a bias per expert on both products
        act: nn.Module | None = None,  # an activation no `hidden_act` names (gpt-oss's clamped SwiGLU)
        interleaved: bool = False,  # gate and up rows alternate in gate_up_proj (gpt-oss), else gate then up
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be in [1, num_experts ({num_experts})].")
        self.tp = tp_group()
        self.inter_part = self.tp.part(intermediate_size)
        self.full_intermediate_size = intermediate_size
        intermediate_size = self.inter_part[1]
        self.reduces_output = reduce_results and self.tp.parallel
        self.interleaved = interleaved
        self.num_experts = num_experts
        self.top_k = top_k
        self.intermediate_size = intermediate_size
        self.renormalize = renormalize
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size), requires_grad=False
        )
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False
        )
        def biases(*shape: int) -> nn.Parameter | None:
            return nn.Parameter(torch.empty(*shape), requires_grad=False) if bias else None

        self.gate_up_proj_bias = biases(num_experts, 2 * intermediate_size)
        self.down_proj_bias = biases(num_experts, hidden_size)
        self.act = act if act is not None else act_and_mul(activation)
        # the stacks' linear methods, chosen at load (until then: the weight's form read per call)
        self.gate_up_method: LinearMethod | None = None
        self.down_method: LinearMethod | None = None
        # the quantized stacks' methods' decision (a bfloat16 model's many rows on the CPU's bf16 GEMM)
        self.quant_bf16_gemm = False
        # the native call's arguments for the plan and stacks they were prepared under (`native_call`)
        self._native: tuple[Any, ...] | None = None

    def quantizable_weights(self) -> list[QuantizableWeight]:
        return [QuantizableWeight(p, EXPERTS, getattr(self, p).shape[-1]) for p in ("gate_up_proj", "down_proj")]

    def bind_linear_method(self, plan: LinearPlan) -> None:
        """Expert stacks are read expert by expert, as rows (never bf16 panels)."""
        for param, attr in (("gate_up_proj", "gate_up_method"), ("down_proj", "down_method")):
            method = method_for(getattr(self, param), plan, panels=False)
            if method.quantized:
                method.decide(getattr(self, param), plan, f"FusedMoE.{param}")  # type: ignore[attr-defined]
            setattr(self, attr, method)
        quantized = [m for m in (self.gate_up_method, self.down_method) if m is not None and m.quantized]
        self.quant_bf16_gemm = bool(quantized) and all(m.bf16_gemm for m in quantized)  # type: ignore[attr-defined]

    def expected_shards(self, param_name: str) -> list[str]:
        parts = ("gate", "up") if param_name == "gate_up_proj" else ("down",)
        return [f"{e}.{p}" for e in range(self.num_experts) for p in parts]

    def rank_part(self, param_name: str, tensor: Any, shard: str | None, expert: int | None) -> Any:
        """This rank's intermediate rows (gate, up) or columns (down), of one expert's tensor or a stack;
        of the biases, gate|up's entries of those rows, and down's whole on rank 0 only (the ranks' partial
        outputs are summed: the bias is added once)."""
        if not self.tp.parallel:
            return tensor
        start, size = self.inter_part
        whole = self.full_intermediate_size
        if param_name == "down_proj_bias":  # [E, H]
            check_whole(tensor, COLUMNS, self.down_proj.shape[-2])
            return tensor if self.tp.rank == 0 else torch.zeros_like(tensor)
        # gate|up already fused in the checkpoint: [E, 2I, H], its bias [E, 2I]
        if shard is None and param_name in ("gate_up_proj", "gate_up_proj_bias"):
            dim = ROWS if param_name == "gate_up_proj" else COLUMNS
            if self.interleaved:  # gate row i at 2i, up row i at 2i + 1: this rank's rows are one run
                return narrow(tensor, dim, 2 * start, 2 * size, whole=2 * whole)
            return take_parts(tensor, dim, [(start, size), (whole + start, size)], whole=2 * whole)
        # one expert's [I, H] / [H, I], a stack of one part [E, I, H] (GGUF), or down's stack [E, H, I]
        dim = ROWS if shard in ("gate", "up") else COLUMNS
        return narrow(tensor, dim, start, size, whole=self.full_intermediate_size)

    def load_shard(
        self, param: nn.Parameter, loaded: torch.Tensor, shard: str, expert: int | None = None
    ) -> None:
        if expert is None or not 0 <= expert < self.num_experts:
            raise ValueError(f"expert index {expert} out of range for {self.num_experts} experts")
        target = param.data[expert]
        if shard in ("gate", "up"):
            inter = self.intermediate_size
            target = target.narrow(0, 0 if shard == "gate" else inter, inter)
        if target.shape != loaded.shape:
            raise ValueError(
                f"expert {expert} shard {shard!r}: checkpoint shape {tuple(loaded.shape)} "
                f"!= {tuple(target.shape)}"
            )
        target.copy_(loaded)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = route(router_logits, self.top_k, self.renormalize)
        return self.reduce(self.run_routed(x, weights, ids))

    def forward_with_router(self, x: torch.Tensor, router: nn.Module) -> torch.Tensor:
        """forward(x, router(x)) for a plain float router `Linear` (no adapters): at few rows (decode) the
        router's product, the routing and the experts in one native call (`ExpertsCall.run_routed`, the
        same ops), which saves the Python between them; else the modules."""
        call = self.native_call()
        if call is not None and type(router) is Linear and not router.method.quantized:
            out = call.run_routed(x, router.weight, router.bias, self.top_k, self.renormalize)
            if out is not None:
                return self.reduce(out)
        return self(x, router(x))

    def native_call(self) -> ExpertsCall | None:
        """The native experts call's prepared arguments (None: the torch loop), made once per plan and
        stacks (a plan reset, or stacks replaced, prepares them again)."""
        activation = expert_activation(self.act)
        if activation is None:
            return None
        plan, gate_up, down = cpu_plan.plan(), self.gate_up_proj, self.down_proj
        held = self._native
        if held is None or held[0] is not plan or held[1] is not gate_up or held[2] is not down:
            call = prepare(gate_up, down, activation, self.gate_up_proj_bias, self.down_proj_bias,
                           self.quant_bf16_gemm)  # fmt: skip
            held = self._native = (plan, gate_up, down, call)
        return held[3]

    def reduce(self, out: torch.Tensor) -> torch.Tensor:
        """The ranks' partial outputs summed where this layer reduces its own (`reduce_results`): what a
        family with a router of its own calls after `run_routed`."""
        return self.tp.all_reduce(out) if self.reduces_output else out

    def run_routed(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """Experts chosen by a router of the family's own (DeepSeek's grouped top-k): [T, k] each."""
        call = self.native_call()
        out = None if call is None else call.run(x, weights, expert_ids)
        if out is not None:
            return out
        gate_up = _any_weight if self.gate_up_method is None else self.gate_up_method.multiply
        down = _any_weight if self.down_method is None else self.down_method.multiply
        return grouped_experts_torch(
            x, weights, expert_ids, self.gate_up_proj, self.down_proj, self.act, self.gate_up_proj_bias,
            self.down_proj_bias, gate_up, down)  # fmt: skip

"""A mixture of experts' routed experts as one native call (`moe_experts` in csrc/moe_kernels.cpp).

The torch version (`model/layers/moe.py`'s grouped_experts_torch) sorts the (token, expert) pairs by
expert and then loops in Python over the experts that got tokens: six or so torch ops per expert, which at
decode (top-k experts per token, dozens of layers) costs more in dispatch than the products do. The native
op runs the same ops in the same order in one call, so both give the same bits; each expert's weights
(a float, bf16 or quantized stack, whatever `project` takes) are read once per step however many tokens
chose it.

`prepare` decides whether the kernel takes the stacks (quantized weights only where the kernel would round
activations as the torch path does) and holds the op's weight arguments (`ExpertsCall`, which a layer keeps
per plan; `experts_call` prepares per call); None, or a call's None, means the caller runs the torch
version. `ExpertsCall.run_routed` adds the router's product and softmax top-k routing to the same call
(`moe_routed_experts`) for steps within the row kernels' rows (decode): one call per MoE layer and step. Under int8 activation blocks and the plan's int8 GEMM, an expert's rows from the
plan's GEMM row count run the int8 GEMM (`quant_block_gemm`, as `run_linear_q` does for the torch loop)
instead of a float32 GEMM on dequantized experts; stacks the native GEMM does not read as the torch loop
does (K-quants' two-level scales, which the loop multiplies out per call) leave such steps to the loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from perfxlm.ops import cpu_plan, native
from perfxlm.ops.linear import gemm_rows, gemm_takes, native_int8_blocks
from perfxlm.quant.weight import ActivationMode, QuantizedWeight


@dataclass(frozen=True, slots=True)
class ExpertActivation:
    """The experts' gated activation as the kernel names it: 0 SiLU, 1 GELU-tanh, 2 GELU over [gate | up];
    3 gpt-oss's clamped SwiGLU over interleaved gate/up columns, with its alpha and limit."""

    code: int
    alpha: float = 0.0
    limit: float = 0.0


def _stack_parts(stack: torch.Tensor | QuantizedWeight) -> tuple[list[torch.Tensor], QuantizedWeight | None] | None:
    """[w] for a float / bf16 stack [E, N, K], or a quantized stack's native_parts() (an act-order stack's
    input orders [E, K] with them: the kernel gathers each expert's rows once); None where the kernel does
    not take it (FP8 byte tables)."""
    if isinstance(stack, torch.Tensor):
        return [stack], None
    if not stack.kernel_levels:
        return None
    return stack.native_parts(), stack


@dataclass(frozen=True, slots=True)
class ExpertsCall:
    """What `experts_call` decides from the stacks and the plan alone, once: the native op's weight
    arguments and flags. A layer keeps one per plan (`prepare`'s result is the same for the same stacks
    and plan), so a decode step's call does none of this work."""

    plan: cpu_plan.CpuPlan
    up_parts: list[torch.Tensor]
    down_parts: list[torch.Tensor]
    quantized: tuple[QuantizedWeight, ...]
    gate_up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None
    activation: ExpertActivation
    num_experts: int
    inter: int
    bf16_gemm: bool
    int8_blocks: bool
    int8_gemm: bool

    def takes(self, num_tokens: int) -> bool:
        """Whether the kernel runs a step of `num_tokens` rows as the torch loop would (int8 GEMM rows)."""
        return not (self.int8_gemm and any(_loop_only_gemm(w, num_tokens, self.plan) for w in self.quantized))

    def _tail(self) -> tuple:
        p = self.plan
        return (self.num_experts, self.inter, self.activation.code, self.activation.alpha, self.activation.limit,
                p.native_max_rows, self.bf16_gemm, self.int8_blocks, p.quant_max_rows, p.quant_block_max_rows,
                p.quant_gemm_rows if self.int8_gemm else -1)

    def run(self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor | None:
        """The experts of routed tokens, or None: run the torch version."""
        ops = native.kernels()  # read per call: a prepared call outlives a switch to the torch path
        if ops is None or x.dtype != torch.float32 or x.dim() != 2 or not self.takes(x.shape[0]):
            return None
        return ops.moe_experts(x.contiguous(), weights, expert_ids, self.up_parts, self.gate_up_bias,
                               self.down_parts, self.down_bias, *self._tail())

    def run_routed(self, x: torch.Tensor, router_weight: torch.Tensor, router_bias: torch.Tensor | None,
                   top_k: int, renormalize: bool) -> torch.Tensor | None:
        """route(x W_r^T + b_r) and the experts in one native call, the module path's bits (`route`'s ops,
        the router's row kernels), or None: a step of more rows than the row kernels take, or a router
        weight in a form the op does not multiply as its Linear would (run the modules)."""
        ops = native.kernels()
        if ops is None or x.dtype != torch.float32 or x.dim() != 2 or x.shape[0] > self.plan.native_max_rows:
            return None
        w = router_weight
        if not (w.dim() == 3 or w.dtype == torch.float32 or (w.dtype == torch.bfloat16 and w.is_contiguous())):
            return None
        if not self.takes(x.shape[0]):
            return None
        return ops.moe_routed_experts(
            x.contiguous(), w, router_bias, top_k, renormalize, self.up_parts, self.gate_up_bias, self.down_parts,
            self.down_bias, *self._tail())


def prepare(
    gate_up: torch.Tensor | QuantizedWeight,  # [E, 2 * inter, hidden]
    down: torch.Tensor | QuantizedWeight,  # [E, hidden, inter]
    activation: ExpertActivation,
    gate_up_bias: torch.Tensor | None = None,  # [E, 2 * inter]
    down_bias: torch.Tensor | None = None,  # [E, hidden]
    bf16_gemm: bool = False,  # the quantized stacks' linear methods' decision (a bfloat16 model's)
) -> ExpertsCall | None:
    """The native call's arguments for these stacks under the plan in force, or None where the kernel does
    not take them (no kernels, FP8 byte tables, mixed activation modes, int8 blocks the kernel would not
    round as the torch version does)."""
    if native.kernels() is None:
        return None
    up_parts, down_parts = _stack_parts(gate_up), _stack_parts(down)
    if up_parts is None or down_parts is None:
        return None
    quantized = tuple(w for w in (up_parts[1], down_parts[1]) if w is not None)
    modes = {w.activations for w in quantized}
    if len(modes) > 1:
        return None  # one int8_blocks flag for both products
    mode = modes.pop() if modes else ActivationMode.FLOAT
    if mode is ActivationMode.INT8 and not all(native_int8_blocks(w) for w in quantized):
        return None  # the torch version rounds these activations itself
    plan = cpu_plan.plan()
    int8_blocks = mode is not ActivationMode.FLOAT
    return ExpertsCall(
        plan, up_parts[0], down_parts[0], quantized, gate_up_bias, down_bias, activation, gate_up.shape[0],
        gate_up.shape[-2] // 2, plan.gemm == "bf16" and (bf16_gemm or not quantized), int8_blocks,
        int8_blocks and plan.quant_gemm == "int8",
    )  # fmt: skip


def experts_call(
    x: torch.Tensor,  # [T, hidden]
    weights: torch.Tensor,  # [T, k]
    expert_ids: torch.Tensor,  # [T, k] int64
    gate_up: torch.Tensor | QuantizedWeight,  # [E, 2 * inter, hidden]
    down: torch.Tensor | QuantizedWeight,  # [E, hidden, inter]
    activation: ExpertActivation,
    gate_up_bias: torch.Tensor | None = None,  # [E, 2 * inter]
    down_bias: torch.Tensor | None = None,  # [E, hidden]
    bf16_gemm: bool = False,  # the quantized stacks' linear methods' decision (a bfloat16 model's)
) -> torch.Tensor | None:  # [T, hidden], or None: run the torch version
    if x.dtype != torch.float32 or x.dim() != 2:
        return None
    call = prepare(gate_up, down, activation, gate_up_bias, down_bias, bf16_gemm)
    return None if call is None else call.run(x, weights, expert_ids)


def _loop_only_gemm(weight: QuantizedWeight, num_tokens: int, plan: cpu_plan.CpuPlan) -> bool:
    """Whether an expert of `num_tokens` rows could reach the int8 GEMM in the torch loop but not in the
    native `linear_q` (two-level scales; a layout its int8 block products do not take): the two would
    round differently."""
    if num_tokens < gemm_rows(weight, plan) or not gemm_takes(weight):  # the cheap test first: every decode step
        return False
    return weight.two_level or not native_int8_blocks(weight)

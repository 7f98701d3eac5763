"""A mixture of experts in standard ONNX ops (the `standard` and `ort` flavors; the `perfxlm` flavor has its
one MoE op): routing (softmax or sigmoid scores, top-k, grouped top-k, renormalised and scaled weights),
then each expert's gated MLP on the rows routed to it only, added into the output in expert order, as the
engine's `FusedMoE` sums them.

Only routed rows are computed (NonZero, Gather, ScatterND add), not every expert on every token: a
128-expert model computes 8 experts' products per token, as the engine does. Each expert is its own
initializers (float, or a Linear's packed form where the flavor keeps one: MatMulNBits)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
from onnx import numpy_helper

ROUTINGS = ("softmax", "topk_softmax", "sigmoid")


@dataclass
class Routing:
    """How a token's experts and their weights are chosen from the router's logits (moe.route's and
    moe_router.GroupedTopKRouter's ways)."""

    top_k: int
    renormalize: bool
    # softmax: top k of the softmax over all experts (Mixtral, Qwen-MoE, DeepSeek-V2); topk_softmax: softmax
    # of the top-k logits (gpt-oss); sigmoid: top k of sigmoid scores + a correction bias (DeepSeek-V3)
    scoring: str = "softmax"
    num_groups: int | None = None  # grouped top-k: experts only from the `topk_group` best groups
    topk_group: int | None = None
    correction_bias: np.ndarray | None = None  # [E] added to choose, not to weigh (sigmoid scoring)
    scale: float = 1.0  # routed_scaling_factor
    renormalize_eps: float = 0.0  # added to the sum the weights are divided by (DeepSeek's 1e-20)
    # DeepSeek's router (moe_router.GroupedTopKRouter: float32 logits of its own float32 weight); False: the
    # router is a Linear whose logits the routing reads
    grouped_router: bool = False


@dataclass
class Experts:
    num_experts: int
    hidden: int
    inter: int
    act: Any  # the experts' gated activation module (SiluAndMul, GeluAndMul, ClampedSwiGLU)
    expert: Callable[[str, int], Any]  # ("gate_up" | "down", expert) -> that expert's LinearWeight
    gate_up: Any = None  # the stacks as the engine holds them (the perfxlm flavor's MoE op)
    down: Any = None
    formats: tuple[str | None, str | None] = (None, None)  # the stacks' linear-method names, if quantized
    gate_up_bias: Any = None  # [E, 2I] and [E, H] float32 (gpt-oss's biased experts), or None
    down_bias: Any = None


class MoeOps:
    """Mixed into GraphOps: `moe` and `shared_expert` from its linear, activation and graph helpers."""

    g: Any

    def moe(self, x: str, router: Any, experts: Experts, routing: Routing, name: str) -> str:
        """x [b, s, hidden] -> the routed experts' weighted sum, [b, s, hidden]."""
        g = self.g
        e_count, hidden = experts.num_experts, experts.hidden
        logits = g.op("Reshape", [self.linear(x, router), g.const([-1, e_count])])  # type: ignore[attr-defined]
        weights, ids = self.route(logits, routing, e_count)
        one_hot = g.op("OneHot", [ids, g.const(e_count), g.const([0.0, 1.0], np.float32)], axis=-1)
        dense = g.op("ReduceSum", [g.op("Mul", [one_hot, g.op("Unsqueeze", [weights, g.const([-1])])]),
                                   g.const([1])], keepdims=0)  # [T, E]: a token's weight of each expert
        flat = g.op("Reshape", [x, g.const([-1, hidden])])
        zero = numpy_helper.from_array(np.zeros(1, np.float32))
        out = g.op("ConstantOfShape", [g.op("Shape", [flat])], value=zero)
        for e in range(e_count):
            weight = g.op("Gather", [dense, g.const(e)], axis=1)  # [T]
            rows = g.op("Reshape", [g.op("NonZero", [g.op("Greater", [weight, g.const(0.0, np.float32)])]),
                                    g.const([-1])])
            xe = g.op("Gather", [flat, rows], axis=0)
            h = self.linear(xe, experts.expert("gate_up", e), rows=True)  # type: ignore[attr-defined]
            h = self.act_and_mul(h, experts.inter, experts.act)  # type: ignore[attr-defined]
            y = self.linear(h, experts.expert("down", e), rows=True)  # type: ignore[attr-defined]
            y = g.op("Mul", [y, g.op("Unsqueeze", [g.op("Gather", [weight, rows], axis=0), g.const([-1])])])
            out = g.op("ScatterND", [out, g.op("Unsqueeze", [rows, g.const([-1])]), y], reduction="add",
                       name=f"{name}.{e}")
        return g.op("Reshape", [out, self.with_last(hidden)])  # type: ignore[attr-defined]

    def route(self, logits: str, routing: Routing, e_count: int) -> tuple[str, str]:
        """logits [T, E] -> (weights float [T, k], expert ids int64 [T, k])."""
        g = self.g
        k = g.const([routing.top_k])
        if routing.scoring == "topk_softmax":
            top, ids = g.op("TopK", [logits, k], num_outputs=2, axis=-1)
            weights = g.op("Softmax", [top], axis=-1)
        else:
            softmax = routing.scoring == "softmax"
            scores = g.op("Softmax" if softmax else "Sigmoid", [logits], **({"axis": -1} if softmax else {}))
            choice = scores
            if routing.correction_bias is not None:
                choice = g.op("Add", [scores, g.weight("router.correction_bias", routing.correction_bias)])
            if routing.num_groups:
                choice = self._best_groups(choice, routing, e_count, fill=0.0 if softmax else -np.inf)
            top, ids = g.op("TopK", [choice, k], num_outputs=2, axis=-1)
            # a bias chooses, the scores weigh (without one the chosen values are the scores)
            weights = top if routing.correction_bias is None else g.op("GatherElements", [scores, ids], axis=1)
        if routing.renormalize:
            total = g.op("ReduceSum", [weights, g.const([-1])], keepdims=1)
            if routing.renormalize_eps:
                total = g.op("Add", [total, g.const(routing.renormalize_eps, np.float32)])
            weights = g.op("Div", [weights, total])
        if routing.scale != 1.0:
            weights = g.op("Mul", [weights, g.const(routing.scale, np.float32)])
        return weights, ids

    def _best_groups(self, choice: str, routing: Routing, e_count: int, fill: float) -> str:
        """choice [T, E] with the experts outside each token's `topk_group` best groups set to `fill`; a
        group ranks by its best score (softmax) or the sum of its two best (sigmoid), as DeepSeek's routers."""
        g = self.g
        groups = routing.num_groups
        per = e_count // groups
        grouped = g.op("Reshape", [choice, g.const([0, groups, per])])
        if routing.scoring == "softmax":
            best = g.op("ReduceMax", [grouped], axes=[-1], keepdims=0)
        else:
            two = g.op("TopK", [grouped, g.const([2])], num_outputs=2, axis=-1)[0]
            best = g.op("ReduceSum", [two, g.const([-1])], keepdims=0)
        chosen = g.op("TopK", [best, g.const([routing.topk_group])], num_outputs=2, axis=-1)[1]
        keep = g.op("ReduceMax", [g.op("OneHot", [chosen, g.const(groups), g.const([0.0, 1.0], np.float32)],
                                       axis=-1)], axes=[1], keepdims=0)  # [T, groups]
        keep = g.op("Reshape", [g.op("Tile", [g.op("Unsqueeze", [keep, g.const([-1])]), g.const([1, 1, per])]),
                                g.const([0, e_count])])
        return g.op("Where", [g.op("Greater", [keep, g.const(0.5, np.float32)]), choice,
                              g.const(fill, np.float32)])

    def shared_expert(self, x: str, routed: str, gate_up: Any, down: Any, inter: int, act: Any,
                      gate: Any, name: str) -> str:
        """routed + mlp(x), under sigmoid(x gate^T) where there is a gate (Qwen2-MoE; DeepSeek's shared
        experts have none)."""
        g = self.g
        h = self.act_and_mul(self.linear(x, gate_up), inter, act)  # type: ignore[attr-defined]
        shared = self.linear(h, down)  # type: ignore[attr-defined]
        if gate is not None:
            shared = g.op("Mul", [g.op("Sigmoid", [self.linear(x, gate)]), shared])  # type: ignore[attr-defined]
        return g.op("Add", [routed, shared], name=name)

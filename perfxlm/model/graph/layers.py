"""The graph's decoder layers found again among its nodes, so all-decode steps take the engine's fused
decode layer (`model/fused_decode.py`: one native call per layer) as the module path does.

A layer is the run of nodes a Llama-shaped block exports to, each reading the one before it:

    RMSNorm (first layer) | AddRMSNorm -> Linear (qkv) -> [HeadRMSNorm] -> Rotary -> PagedAttention
    -> Linear (o) -> [RMSNorm] -> AddRMSNorm -> Linear (gate|up) -> SiluAndMul | GeluAndMul -> Linear (down)
    -> [RMSNorm]

(a mixture's MLP, any nodes from the AddRMSNorm's output to the value the next AddRMSNorm adds, runs as
the module the fused call hands its output to: `GraphMLP`; the bracketed RMSNorms: the norms after each sublayer of Gemma 2 / 3 and GLM-4, in every layer or in
none; the kernel's sandwich layer), and the layers run from the embedding's output to the final
AddRMSNorm. Each layer's Rotary node names its table (Gemma 3's local and global layers rotate with their
own). A graph whose nodes are not exactly that (another block, other wiring) is simply interpreted node
by node on every step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from perfxlm.model.fused_decode import FusedLayer, fused_attention, fused_layer, fused_mlp
from perfxlm.model.graph.kernels import Activation, AddNorm, HeadNorm, Linear, Norm, PagedAttention, Rotary
from perfxlm.model.graph.steps import Step, run_steps


class GraphMLP(nn.Module):
    """A layer's MLP the fused decode layer does not run (a mixture of experts: its router, MoE or routing
    and Experts nodes, shared expert), as the module it calls on the post-attention norm's output: the
    layer's share of the graph's steps, as exported."""

    def __init__(self, steps: list[Step], input_name: str, output_name: str) -> None:
        super().__init__()
        self.steps, self.input_name, self.output_name = steps, input_name, output_name
        self.kernels = nn.ModuleList(s.kernel for s in steps if s.kernel is not None)

    def forward(self, x: Any) -> Any:
        values = {self.input_name: x}
        run_steps(self.steps, values)
        return values[self.output_name]


class GraphLayer(nn.Module):
    """One decoder layer's kernels, in the shape `FusedDecode` reads (`self_attn.attn.kv_cache`,
    `fused_decode_layer()`)."""

    def __init__(self, kernels: dict[str, Any]) -> None:
        super().__init__()
        self.input_norm, self.qkv, self.head_norm = kernels["input_norm"], kernels["qkv"], kernels.get("head_norm")
        self.rotary, self.self_attn, self.o = kernels["rotary"], kernels["attn"], kernels["o"]
        self.post_norm, self.gate_up, self.act, self.down = (kernels["post_norm"], kernels.get("gate_up"),
                                                             kernels.get("act"), kernels.get("down"))
        self.mlp: GraphMLP | None = kernels.get("mlp")  # a mixture's nodes, instead of gate_up / act / down
        # a sandwich layer's norms after attention and after the MLP (None: a pre-norm layer)
        self.attn_out_norm, self.mlp_out_norm = kernels.get("attn_out_norm"), kernels.get("mlp_out_norm")

    @property
    def sandwich(self) -> bool:
        return self.attn_out_norm is not None

    def fused_decode_layer(self) -> FusedLayer | None:
        norms = () if self.head_norm is None else (self.head_norm.q_norm, self.head_norm.k_norm)
        attention = fused_attention(self.qkv, self.o, self.self_attn.attn, *norms)
        # the kernel's order: input, after attention, before the MLP, after the MLP
        sublayer_norms = ([self.input_norm.norm, self.attn_out_norm.norm, self.post_norm.norm, self.mlp_out_norm.norm]
                          if self.sandwich else [self.input_norm.norm, self.post_norm.norm])
        if self.mlp is not None:
            return fused_layer(sublayer_norms, attention, None, module_mlp=self.mlp)
        return fused_layer(sublayer_norms, attention, fused_mlp(self.gate_up, self.down, self.act.fn))


@dataclass
class LayerRun:
    layers: list[GraphLayer]
    first: int  # index of the first layer's first step
    end: int  # index after the last layer's last step
    input_name: str  # the embedding's output: the first layer's x and residual
    x_name: str  # the last layer's output
    residual_name: str  # and the residual stream after it
    rotary: Rotary  # whose table gives the step's (cos, sin)
    # sandwich layers: the fused call returns the whole stream, which the graph holds as x + residual
    sandwich: bool = False
    per_layer_ropes: bool = False  # the layers' Rotary nodes read more than one table

    def ropes(self, positions: Any) -> list[Any] | None:
        """Each layer's (cos, sin) at the step's positions where layers rotate differently, else None."""
        return [layer.rotary.table.at(positions) for layer in self.layers] if self.per_layer_ropes else None


def _module_mlp(steps: list[Step], start: int, value: str, residual: str) -> GraphMLP | None:
    """The steps from `start` up to the next AddRMSNorm adding `residual`, as a GraphMLP of input `value`,
    where they read nothing but `value` and each other's outputs."""
    made = {value}
    for end in range(start, len(steps)):
        step = steps[end]
        if isinstance(step.kernel, AddNorm) and step.inputs[1] == residual:
            if end == start or step.inputs[0] not in made - {value}:
                return None
            return GraphMLP(steps[start:end], value, step.inputs[0])
        if not set(step.inputs) <= made:
            return None
        made.update(step.outputs)
    return None


def find_layers(steps: list[Any]) -> LayerRun | None:
    """The decoder layers among `steps` (the graph body's, steps.py), or None where they are not all the
    Llama-shaped block wired as exported."""
    i = next((k for k, s in enumerate(steps) if isinstance(s.kernel, Norm)), None)
    if i is None:
        return None
    first, input_name = i, steps[i].inputs[0]
    x, residual = None, input_name
    layers: list[GraphLayer] = []

    def take(kind: type, *inputs: str | None) -> Any:
        nonlocal i
        if i >= len(steps) or type(steps[i].kernel) is not kind:
            return None
        step = steps[i]
        if any(want is not None and got != want for got, want in zip(step.inputs, inputs)):
            return None
        i += 1
        return step

    while True:
        start, stream = i, residual
        found: dict[str, Any] = {}
        norm = take(Norm, residual) if not layers else take(AddNorm, x, residual)
        if norm is None:
            i = start
            break
        found["input_norm"] = norm.kernel
        if layers:
            residual = norm.outputs[1]
        chain = [("qkv", Linear), ("head_norm", HeadNorm), ("rotary", Rotary), ("attn", PagedAttention),
                 ("o", Linear)]
        value = norm.outputs[0]
        for key, kind in chain:
            step = take(kind, value)
            if step is None and key == "head_norm":
                continue
            if step is None and key == "qkv" and layers:  # the final norm: the layers have ended
                break
            if step is None:
                return None
            found[key], value = step.kernel, step.outputs[0]
        if "qkv" not in found:
            i, residual = start, stream
            break
        out_norm = take(Norm, value)  # a sandwich layer's norm after attention
        if out_norm is not None:
            found["attn_out_norm"], value = out_norm.kernel, out_norm.outputs[0]
        post = take(AddNorm, value, residual)
        if post is None:
            return None
        found["post_norm"], value, residual = post.kernel, post.outputs[0], post.outputs[1]
        mlp_start, dense, h = i, {}, value
        for key, kind in (("gate_up", Linear), ("act", Activation), ("down", Linear)):
            step = take(kind, h)
            if step is None:
                break
            dense[key], h = step.kernel, step.outputs[0]
        if len(dense) == 3:
            found.update(dense)
            value = h
        else:  # a mixture: its nodes up to the next AddRMSNorm of the stream, as one module
            i = mlp_start
            mlp = _module_mlp(steps, i, value, residual)
            if mlp is None or out_norm is not None:
                return None
            found["mlp"], value = mlp, mlp.output_name
            i += len(mlp.steps)
        if out_norm is not None:
            step = take(Norm, value)
            if step is None:
                return None
            found["mlp_out_norm"], value = step.kernel, step.outputs[0]
        layers.append(GraphLayer(found))
        x = value
    if not layers or len({layer.sandwich for layer in layers}) != 1:
        return None
    per_layer = len({id(layer.rotary.table) for layer in layers}) > 1
    return LayerRun(layers, first, i, input_name, x, residual, layers[0].rotary, layers[0].sandwich, per_layer)

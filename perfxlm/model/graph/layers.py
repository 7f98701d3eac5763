"""The graph's decoder layers found again among its nodes, so all-decode steps take the engine's fused
decode layer (`model/fused_decode.py`: one native call per layer) as the module path does.

A layer is the run of nodes a Llama-shaped block exports to, each reading the one before it:

    RMSNorm (first layer) | AddRMSNorm -> Linear (qkv) -> [HeadRMSNorm] -> Rotary -> PagedAttention
    -> Linear (o) -> AddRMSNorm -> Linear (gate|up) -> SiluAndMul | GeluAndMul -> Linear (down)

and the layers run from the embedding's output to the final AddRMSNorm. A graph whose nodes are not
exactly that (another block, other wiring) is simply interpreted node by node on every step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from perfxlm.model.fused_decode import FusedLayer, fused_attention, fused_layer, fused_mlp
from perfxlm.model.graph.kernels import Activation, AddNorm, HeadNorm, Linear, Norm, PagedAttention, Rotary


class GraphLayer(nn.Module):
    """One decoder layer's kernels, in the shape `FusedDecode` reads (`self_attn.attn.kv_cache`,
    `fused_decode_layer()`)."""

    def __init__(self, kernels: dict[str, Any]) -> None:
        super().__init__()
        self.input_norm, self.qkv, self.head_norm = kernels["input_norm"], kernels["qkv"], kernels.get("head_norm")
        self.rotary, self.self_attn, self.o = kernels["rotary"], kernels["attn"], kernels["o"]
        self.post_norm, self.gate_up, self.act, self.down = (kernels["post_norm"], kernels["gate_up"],
                                                             kernels["act"], kernels["down"])

    def fused_decode_layer(self) -> FusedLayer | None:
        norms = () if self.head_norm is None else (self.head_norm.q_norm, self.head_norm.k_norm)
        attention = fused_attention(self.qkv, self.o, self.self_attn.attn, *norms)
        return fused_layer([self.input_norm.norm, self.post_norm.norm], attention,
                           fused_mlp(self.gate_up, self.down, self.act.fn))


@dataclass
class LayerRun:
    layers: list[GraphLayer]
    first: int  # index of the first layer's first step
    end: int  # index after the last layer's last step
    input_name: str  # the embedding's output: the first layer's x and residual
    x_name: str  # the last layer's output
    residual_name: str  # and the residual stream after it
    rotary: Rotary  # whose table gives the step's (cos, sin)


def find_layers(steps: list[Any]) -> LayerRun | None:
    """The decoder layers among `steps` (model.py's _Step list), or None where they are not all the
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
        post = take(AddNorm, value, residual)
        if post is None:
            return None
        found["post_norm"], value, residual = post.kernel, post.outputs[0], post.outputs[1]
        for key, kind in (("gate_up", Linear), ("act", Activation), ("down", Linear)):
            step = take(kind, value)
            if step is None:
                return None
            found[key], value = step.kernel, step.outputs[0]
        layers.append(GraphLayer(found))
        x = value
    if not layers or len({id(layer.rotary.table) for layer in layers}) != 1:
        return None  # (a rope table per layer kind would need FusedDecode's layer_ropes)
    return LayerRun(layers, first, i, input_name, x, residual, layers[0].rotary)

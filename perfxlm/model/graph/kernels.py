"""The `perfxlm` domain's ops, each bound to the kernel the engine's module path calls for it, so a graph
run gives the module path's numbers: RMSNorm / add+RMSNorm through `RMSNorm` (the native kernels, the
residual added in place), rotary through `apply_rotary`, attention through the `Attention` layer (its
backend reads the step's block tables, sequence lengths and slots from the forward context, the same
values the graph names as inputs, and writes the paged cache the runner allocates for it), products
through the engine's `Linear` layer with its linear method bound as the loader binds it (float, bf16
rows or panels, each quantized format), mixtures through `route` and `grouped_experts`.

A kernel is built once per node at load (`KERNELS[op_type](node, attrs, held, weights)`), holding its
weights as `held` says (the run's own choices: EngineConfig.resolve's for the folder); calling it runs
the node. `mutates` lists the inputs it may overwrite (the interpreter hands it a copy
where a value is still needed later)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from perfxlm.model.layers.activation import Activation as EngineActivation
from perfxlm.model.layers.activation import ClampedSwiGLU, GeluAndMul, SiluAndMul, soft_cap
from perfxlm.model.layers.attention import Attention
from perfxlm.model.layers.embed_head import LearnedPositionalEmbedding
from perfxlm.model.layers.linear import Linear as EngineLinear
from perfxlm.model.layers.mla import attend_latent
from perfxlm.model.layers.moe import FusedMoE
from perfxlm.model.layers.moe_router import GroupedTopKRouter
from perfxlm.model.layers.norm import LayerNorm as EngineLayerNorm
from perfxlm.model.layers.norm import RMSNorm
from perfxlm.model.layers.rotary import apply_rotary
from perfxlm.quant.layout_choice import chosen_layout
from perfxlm.quant.layouts import CodeLayout
from perfxlm.quant.weight import ActivationMode, QuantizedWeight


class Kernel(nn.Module):
    mutates: tuple[int, ...] = ()


@dataclass(frozen=True)
class HeldAs:
    """How a run holds the graph's weights: the engine's choices for the folder on this CPU, which are the
    module path's for the exported model (None: as the graph stores them and its nodes say)."""

    weight_dtype: torch.dtype | None = None  # float matrices (Linear, Embedding, MoE stacks)
    activations: ActivationMode | None = None  # quantized products' activation rounding
    # the code layouts the CPU plan gives quantized matrices (layouts.all_for_plan: the first that takes a
    # weight), as the loader does
    layout: tuple[CodeLayout, ...] = (CodeLayout.PLAIN,)


AS_STORED = HeldAs()


def _norm(weight: torch.Tensor, eps: float) -> RMSNorm:
    norm = RMSNorm(weight.shape[0], eps)
    norm.weight = nn.Parameter(weight.float(), requires_grad=False)
    return norm


def _weight(node: str, attrs: dict[str, Any], held: HeldAs, w: torch.Tensor, scales: Any, mins: Any,
            levels: Any, order: Any = None) -> Any:
    """A weight as the engine holds it: a float tensor (bits 0: `GraphModel` gave it the run's dtype) or a
    QuantizedWeight from its parts, its activations the run's where the run decides them."""
    bits = attrs.get("bits", 0)
    if bits == 0:
        return w
    if scales is None:  # (mins absent: centred codes, w = scale * code)
        raise ValueError(f"node {node!r}: a {bits}-bit weight needs its scales input.")
    try:  # codes [N, K * bits / 8], or [E, N, K * bits / 8] for an expert stack
        q = QuantizedWeight(w, scales, mins, levels, bits, attrs["group"], attrs.get("act", "float"), w.shape[-2],
                            w.shape[-1] * 8 // bits, input_order=order)
        q.use_activations(held.activations or ActivationMode(attrs.get("activations", "float32")), node)
    except (KeyError, ValueError) as exc:
        raise ValueError(f"node {node!r}: its weight is not one the engine holds: {exc}") from None
    return chosen_layout(q, list(held.layout))  # expert stacks too: the module path's FusedMoE holds them so


class Embedding(Kernel):
    def __init__(self, node: str, attrs: dict[str, Any], held: HeldAs, w, scales=None, mins=None,
                 levels=None) -> None:
        super().__init__()
        self.weight = _weight(node, attrs, held, w, scales, mins, levels)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if type(self.weight) is QuantizedWeight:  # only the rows looked up widen
            return self.weight.embedding(ids)
        return F.embedding(ids, self.weight).float()


def _format(weight: QuantizedWeight, attrs: dict[str, Any]) -> str:
    """The linear method of a quantized weight: the one the export names, else the format that admits it."""
    if "format" in attrs:
        return attrs["format"]
    return "nf4" if weight.levels is not None else "w8a8" if weight.act != "float" else "gguf"


class Linear(Kernel):
    """The engine's own `Linear` layer holding the node's weight, its method bound as the loader binds it
    (`bind_linear_method`: bf16 panels or rows by the CPU plan, the quantized format's decisions), so the
    product is the module path's."""

    reduces_output = False  # a graph runs in one process: no rank sums its products

    def __init__(self, node: str, attrs: dict[str, Any], held: HeldAs, w, bias=None, scales=None, mins=None,
                 levels=None, order=None) -> None:
        super().__init__()
        from perfxlm.model.loader import linear_plan

        weight = _weight(node, attrs, held, w, scales, mins, levels, order)
        n, k = weight.shape[-2], weight.shape[-1]
        with torch.device("meta"):  # placeholders replaced below: no allocation
            self.layer = EngineLinear(k, n, bias is not None)
        quantized = isinstance(weight, QuantizedWeight)
        del self.layer.weight  # a QuantizedWeight is a plain attribute where the Parameter was (as the sink puts it)
        self.layer.weight = weight if quantized else nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            self.layer.bias = nn.Parameter(bias.float(), requires_grad=False)
        # the model's weight dtype, as the loader's plan has it for every layer: for quantized codes it decides
        # whether many rows may run the CPU's bf16 GEMM (a bf16 model's choice)
        stored = (held.weight_dtype or torch.float32) if quantized else weight.dtype
        try:
            plan = linear_plan(stored, torch.float32, _format(weight, attrs) if quantized else None)
            self.layer.bind_linear_method(plan)
        except ValueError as exc:
            raise ValueError(f"node {node!r}: {exc}") from None
        self.out_features, self.in_features = n, k

    @property
    def weight(self) -> Any:  # what the fused decode layer reads
        return self.layer.weight

    @property
    def bias(self) -> Any:
        return self.layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


class Norm(Kernel):
    def __init__(self, node: str, attrs: dict[str, Any], held: HeldAs, weight) -> None:
        super().__init__()
        self.norm = _norm(weight, attrs["epsilon"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


class AddNorm(Kernel):
    mutates = (0, 1)  # the native kernel adds the residual in place and normalises x in place

    def __init__(self, node: str, attrs: dict[str, Any], held: HeldAs, weight) -> None:
        super().__init__()
        self.norm = _norm(weight, attrs["epsilon"])

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.norm(x, residual)


class HeadNorm(Kernel):
    """RMSNorm of each q and each k head of a fused QKV row (Qwen3), as the module path's q_norm / k_norm."""

    def __init__(self, node: str, attrs: dict[str, Any], held: HeldAs, q_weight, k_weight) -> None:
        super().__init__()
        self.q_norm, self.k_norm = _norm(q_weight, attrs["epsilon"]), _norm(k_weight, attrs["epsilon"])
        self.heads, self.kv_heads, self.head_dim = attrs["num_heads"], attrs["num_kv_heads"], attrs["head_dim"]

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        n, h, d = qkv.shape[0], self.heads, self.head_dim
        qk = qkv[:, : (h + self.kv_heads) * d].view(n, -1, d)
        q, k = self.q_norm(qk[:, :h]), self.k_norm(qk[:, h:])
        return torch.cat((q.reshape(n, -1), k.reshape(n, -1), qkv[:, qk.shape[1] * d :]), dim=1)


class RopeTable:
    """cos / sin rows at the step's positions, looked up once per step for every Rotary node (as the module
    path's RotaryEmbedding.cos_sin)."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.cos, self.sin = cos.float(), sin.float()
        self._last: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._last is None or self._last[0] is not positions:
            self._last = (positions, self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1))
        return self._last[1], self._last[2]


class Rotary(Kernel):
    mutates = (0,)  # rotated in place, as the module path rotates q and k heads in one pass

    def __init__(self, node: str, attrs: dict[str, Any], held: HeldAs, table: RopeTable) -> None:
        super().__init__()
        self.table, self.heads, self.head_dim = table, attrs["num_heads"], attrs["head_dim"]

    def forward(self, qkv: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        n, d = qkv.shape[0], self.head_dim
        qk = qkv[:, : self.heads * d].view(n, self.heads, d)
        rotated = apply_rotary(qk, *self.table.at(positions))
        if rotated is not qk:  # the torch path returns a new tensor
            qkv = qkv.clone()
            qkv[:, : self.heads * d] = rotated.reshape(n, -1)
        return qkv


class PagedAttention(Kernel):
    def __init__(self, node: str, attrs: dict[str, Any], held: HeldAs, sinks=None) -> None:
        super().__init__()
        window = attrs.get("sliding_window", 0)
        heads = attrs["num_heads"]
        self.attn = Attention(heads, attrs["num_kv_heads"], attrs["head_dim"], attrs["scale"],
                              sliding_window=window or None, logit_soft_cap=attrs.get("logit_soft_cap"),
                              sinks=sinks is not None)
        if sinks is not None:  # gpt-oss: the attention layer's own parameter, as the loader fills it
            if tuple(sinks.shape) != (heads,):
                raise ValueError(f"node {node!r}: sinks must be [num_heads] = [{heads}], not {tuple(sinks.shape)}.")
            self.attn.sinks = nn.Parameter(sinks.float(), requires_grad=False)
        # OPT: the queries scaled before attention (at scale 1), as its module path rounds them
        self.query_scale = attrs.get("query_scale")

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        a = self.attn
        n, d = qkv.shape[0], a.head_dim
        qk_size = (a.num_heads + a.num_kv_heads) * d
        qk = qkv[:, :qk_size].view(n, -1, d)
        v = qkv[:, qk_size:].view(n, a.num_kv_heads, d)
        q = qk[:, : a.num_heads]
        if self.query_scale is not None:
            q = q * self.query_scale
        return a(q, qk[:, a.num_heads :], v)


class LatentAttention(Kernel):
    """DeepSeek's multi-head latent attention between its projections (`mla.attend_latent`, the module
    path's own core) over an `Attention` layer whose cache holds the latent row once (value_is_key)."""

    def __init__(self, node: str, attrs: dict[str, Any], held: HeldAs, table: "RopeTable", kv_norm, w_uk,
                 w_uv_t) -> None:
        super().__init__()
        heads, nope, rank, v = attrs["num_heads"], attrs["nope_dim"], attrs["kv_lora_rank"], attrs["v_dim"]
        rope_dim = attrs["rope_dim"]
        shapes = {"w_uk": (tuple(w_uk.shape), (heads, nope, rank)), "w_uv_t": (tuple(w_uv_t.shape), (heads, rank, v)),
                  "kv_norm": (tuple(kv_norm.shape), (rank,)), "cos": (tuple(table.cos.shape[1:]), (rope_dim,))}
        for what, (got, want) in shapes.items():
            if got != want:
                raise ValueError(f"node {node!r}: {what} is {got}, the attributes make it {want}.")
        self.table, self.nope_dim = table, nope
        self.kv_norm = _norm(kv_norm, attrs["epsilon"])
        self.w_uk, self.w_uv_t = w_uk.float(), w_uv_t.float()
        # the latent decode kernel's matrices as the module path's `MLAttention.decode_weights` holds them:
        # bf16 in a bf16 model whose kv_b_proj is a bf16 matrix (the stored float32 values are then bf16's:
        # exact), else float32 (a float32 model; a quantized kv_b_proj, dequantized)
        self.decode = (self.w_uk, self.w_uv_t)
        if held.weight_dtype == torch.bfloat16 and all(_bf16_exact(w) for w in self.decode):
            self.decode = (self.w_uk.bfloat16(), self.w_uv_t.bfloat16())
        self.attn = Attention(heads, 1, rank + rope_dim, attrs["scale"], value_is_key=True)

    def forward(self, q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # a step's decode rows take the latent decode kernel (self.decode: the absorbed matrices as the
        # module path holds them for this weight dtype); its prefill rows the composition
        return attend_latent(self.attn, self.kv_norm, self.w_uk.to(q.dtype), self.w_uv_t.to(q.dtype), self.nope_dim,
                             self.table.at(positions), q, kv, self.decode)


def _bf16_exact(w: torch.Tensor) -> bool:
    return bool(torch.equal(w.bfloat16().float(), w))


class Activation(Kernel):
    def __init__(self, node: str, attrs: dict[str, Any], held: HeldAs, fn: nn.Module) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


def _expert_act(node: str, attrs: dict[str, Any], allowed: tuple[str, ...]) -> nn.Module:
    kind = attrs.get("activation", "SiluAndMul")
    if kind not in allowed:
        raise ValueError(f"node {node!r}: expert activation {kind!r} is not known ({', '.join(allowed)}).")
    if kind == "ClampedSwiGLU":
        return ClampedSwiGLU(attrs["alpha"], attrs["limit"])
    return SiluAndMul() if kind == "SiluAndMul" else GeluAndMul(attrs.get("approximate", "none"))


def _fused_moe(node: str, attrs: dict[str, Any], held: HeldAs, act: nn.Module, top_k: int, renormalize: bool,
               gate_up, down, parts: tuple, biases: tuple = (None, None)) -> FusedMoE:
    """The engine's own `FusedMoE` layer holding the node's expert stacks (and biases), their linear methods
    bound as the loader binds them (bf16 rows, each quantized format's decisions)."""
    from perfxlm.model.loader import linear_plan

    if gate_up is None or down is None or gate_up.dim() != 3 or down.dim() != 3:
        raise ValueError(f"node {node!r}: experts take stacks gate_up [E, 2I, H] and down [E, H, I].")
    gu_attrs = {k[len("gate_up_"):]: v for k, v in attrs.items() if k.startswith("gate_up_")}
    dn_attrs = {k[len("down_"):]: v for k, v in attrs.items() if k.startswith("down_")}
    stacks = {"gate_up_proj": _weight(node, gu_attrs, held, gate_up, *parts[:3]),
              "down_proj": _weight(node, dn_attrs, held, down, *parts[3:6])}
    experts, two_inter, hidden = stacks["gate_up_proj"].shape
    gate_up_bias, down_bias = biases
    if (gate_up_bias is None) != (down_bias is None):
        raise ValueError(f"node {node!r}: expert biases come in pairs (gate_up_bias and down_bias).")
    if gate_up_bias is not None and (tuple(gate_up_bias.shape) != (experts, two_inter)
                                     or tuple(down_bias.shape) != (experts, hidden)):
        raise ValueError(f"node {node!r}: expert biases must be [{experts}, {two_inter}] and [{experts}, {hidden}].")
    with torch.device("meta"):  # placeholders replaced below: no allocation
        moe = FusedMoE(experts, top_k, hidden, two_inter // 2, renormalize, act=act, bias=gate_up_bias is not None)
    quantized = None
    for name, w in stacks.items():
        delattr(moe, name)  # a QuantizedWeight is a plain attribute where the Parameter was
        if isinstance(w, QuantizedWeight):
            quantized = _format(w, gu_attrs if name == "gate_up_proj" else dn_attrs)
            setattr(moe, name, w)
        else:
            setattr(moe, name, nn.Parameter(w, requires_grad=False))
    if gate_up_bias is not None:
        moe.gate_up_proj_bias = nn.Parameter(gate_up_bias.float(), requires_grad=False)
        moe.down_proj_bias = nn.Parameter(down_bias.float(), requires_grad=False)
    stored = (held.weight_dtype or torch.float32) if quantized else stacks["gate_up_proj"].dtype
    try:
        moe.bind_linear_method(linear_plan(stored, torch.float32, quantized))
    except ValueError as exc:
        raise ValueError(f"node {node!r}: {exc}") from None
    return moe


class MoE(Kernel):
    """The engine's own `FusedMoE` layer holding the node's expert stacks, so softmax top-k routing and
    experts are the module path's (Mixtral, Qwen-MoE)."""

    def __init__(self, node: str, attrs: dict[str, Any], held: HeldAs, gate_up, down, *parts) -> None:
        super().__init__()
        act = _expert_act(node, attrs, ("SiluAndMul", "GeluAndMul"))
        self.experts = _fused_moe(node, attrs, held, act, attrs["top_k"], bool(attrs.get("renormalize", 0)),
                                  gate_up, down, parts)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        return self.experts(x, router_logits)


class Experts(Kernel):
    """Routed experts after a routing node of the family's own (gpt-oss, DeepSeek): `FusedMoE.run_routed`,
    what their MLP modules call."""

    def __init__(self, node: str, attrs: dict[str, Any], held: HeldAs, gate_up, down, *parts) -> None:
        super().__init__()
        act = _expert_act(node, attrs, ("SiluAndMul", "GeluAndMul", "ClampedSwiGLU"))
        # (top_k and renormalize are the routing node's: FusedMoE only checks k against the experts)
        self.experts = _fused_moe(node, attrs, held, act, 1, False, gate_up, down, parts[:6], parts[6:8])

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.experts.run_routed(x, weights, ids)


class TopKSoftmax(Kernel):
    """gpt-oss's router after its Linear: the softmax of each row's top-k logits (GptOssMLP's)."""

    def __init__(self, node: str, attrs: dict[str, Any], held: HeldAs) -> None:
        super().__init__()
        self.top_k = attrs["top_k"]

    def forward(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        return torch.softmax(top, dim=-1), ids


class GroupedTopK(Kernel):
    """DeepSeek's router: the engine's `GroupedTopKRouter` holding the node's float32 weight (and V3's
    correction bias)."""

    def __init__(self, node: str, attrs: dict[str, Any], held: HeldAs, weight, bias=None) -> None:
        super().__init__()
        groups = attrs.get("num_groups", 0)
        experts, hidden = weight.shape
        try:
            with torch.device("meta"):
                self.router = GroupedTopKRouter(
                    hidden, experts, attrs["top_k"], attrs["scoring"], "group_limited_greedy" if groups else "greedy",
                    groups or None, attrs.get("topk_group") or None, bool(attrs.get("renormalize", 0)),
                    attrs.get("routed_scaling_factor", 1.0))  # fmt: skip
        except ValueError as exc:
            raise ValueError(f"node {node!r}: {exc}") from None
        if (bias is not None) != (attrs["scoring"] == "sigmoid"):
            raise ValueError(f"node {node!r}: a correction bias comes with sigmoid scoring, and only with it.")
        self.router.weight = nn.Parameter(weight.float(), requires_grad=False)
        if bias is not None:
            self.router.e_score_correction_bias = nn.Parameter(bias.float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.router(x)


class Add(Kernel):
    def __init__(self, node: str, attrs: dict[str, Any], held: HeldAs) -> None:
        super().__init__()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x + y


class PositionEmbedding(Kernel):
    """The engine's `LearnedPositionalEmbedding` (OPT's table, `offset` rows in) holding the node's table."""

    def __init__(self, node: str, attrs: dict[str, Any], held: HeldAs, table) -> None:
        super().__init__()
        offset = attrs.get("offset", 0)
        if table is None or table.dim() != 2 or table.shape[0] <= offset:
            raise ValueError(f"node {node!r}: the position table must be [positions + {offset}, hidden].")
        with torch.device("meta"):
            self.embed = LearnedPositionalEmbedding(table.shape[0] - offset, table.shape[1], offset)
        self.embed.weight = nn.Parameter(table, requires_grad=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return self.embed(positions)


class LayerNorm(Kernel):
    def __init__(self, node: str, attrs: dict[str, Any], held: HeldAs, weight=None, bias=None) -> None:
        super().__init__()
        if weight is None or weight.dim() != 1:
            raise ValueError(f"node {node!r}: LayerNorm takes its weight [hidden] as input 1.")
        with torch.device("meta"):
            self.norm = EngineLayerNorm(weight.shape[0], attrs["epsilon"], bias=bias is not None)
        self.norm.weight = nn.Parameter(weight.float(), requires_grad=False)
        if bias is not None:
            self.norm.bias = nn.Parameter(bias.float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


def _activation(node: str, attrs: dict[str, Any], held: HeldAs) -> "Activation":
    try:
        return Activation(node, attrs, held, EngineActivation(attrs["function"]))
    except ValueError as exc:
        raise ValueError(f"node {node!r}: {exc}") from None


class SigmoidGatedAdd(Kernel):
    """x + sigmoid(gate) * y: a shared expert's output added under its gate, as Qwen2-MoE's block adds it."""

    def __init__(self, node: str, attrs: dict[str, Any], held: HeldAs) -> None:
        super().__init__()

    def forward(self, x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return x + torch.sigmoid(gate) * y


class Scale(Kernel):
    """x times a constant, as the module path's embedding scales its rows (Gemma)."""

    def __init__(self, node: str, attrs: dict[str, Any], held: HeldAs) -> None:
        super().__init__()
        self.factor = torch.tensor(attrs["factor"], dtype=torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor.to(x.dtype)


class SoftCap(Kernel):
    """cap * tanh(x / cap): the LM head's soft cap (Gemma), the module path's own function."""

    def __init__(self, node: str, attrs: dict[str, Any], held: HeldAs) -> None:
        super().__init__()
        self.cap = attrs["cap"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return soft_cap(x, self.cap)


# op type -> (builder(node name, attributes, HeldAs, weight inputs...), which inputs are weights (initializers),
# which are step values). PagedAttention's cache and step-layout inputs are bound by the runner, not here.
Builder = Callable[..., Kernel]
KERNELS: dict[str, tuple[Builder, tuple[int, ...], tuple[int, ...]]] = {
    "Embedding": (Embedding, (1, 2, 3, 4), (0,)),
    "Linear": (Linear, (1, 2, 3, 4, 5, 6), (0,)),
    "RMSNorm": (Norm, (1,), (0,)),
    "AddRMSNorm": (AddNorm, (2,), (0, 1)),
    "HeadRMSNorm": (HeadNorm, (1, 2), (0,)),
    "Rotary": (Rotary, (2, 3), (0, 1)),
    "PagedAttention": (PagedAttention, (7,), (0,)),
    "SiluAndMul": (lambda n, a, h: Activation(n, a, h, SiluAndMul()), (), (0,)),
    "GeluAndMul": (lambda n, a, h: Activation(n, a, h, GeluAndMul(a.get("approximate", "none"))), (), (0,)),
    "MoE": (MoE, (2, 3, 4, 5, 6, 7, 8, 9), (0, 1)),
    "SigmoidGatedAdd": (SigmoidGatedAdd, (), (0, 1, 2)),
    "Scale": (Scale, (), (0,)),
    "SoftCap": (SoftCap, (), (0,)),
    # op-set version 3 (OPT, gpt-oss, DeepSeek)
    "Add": (Add, (), (0, 1)),
    "PositionEmbedding": (PositionEmbedding, (1,), (0,)),
    "LayerNorm": (LayerNorm, (1, 2), (0,)),
    "Activation": (_activation, (), (0,)),
    "TopKSoftmax": (TopKSoftmax, (), (0,)),
    "GroupedTopK": (GroupedTopK, (1, 2), (0,)),
    "Experts": (Experts, (3, 4, 5, 6, 7, 8, 9, 10, 11, 12), (0, 1, 2)),
    "LatentAttention": (LatentAttention, (9, 10, 11, 12, 13), (0, 1, 8)),
}
# the op-set version that introduced each op (a graph importing an older one may not hold it)
OP_SINCE = {op: 3 for op in ("Add", "PositionEmbedding", "LayerNorm", "Activation", "TopKSoftmax", "GroupedTopK",
                             "Experts", "LatentAttention")}
# the inputs of each op that must be the graph's own step inputs, by name (see export/perfxlm_ops.py)
STEP_INPUTS = {"PagedAttention": {3: "block_tables", 4: "seq_lens", 5: "query_start_loc", 6: "slot_mapping"},
               "LatentAttention": {4: "block_tables", 5: "seq_lens", 6: "query_start_loc", 7: "slot_mapping",
                                   8: "positions"},
               "Rotary": {1: "positions"}, "Embedding": {0: "input_ids"}, "PositionEmbedding": {0: "positions"}}
# the inputs of each attention op that are its layer's K and V caches (graph inputs the runner allocates)
CACHE_INPUTS = {"PagedAttention": (1, 2), "LatentAttention": (2, 3)}
# the cos / sin inputs of each op reading a rotary table (one RopeTable per pair, looked up once a step)
ROPE_INPUTS = {"Rotary": (2, 3), "LatentAttention": (9, 10)}

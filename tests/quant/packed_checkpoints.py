"""Writers of pre-quantized checkpoints for the tests: AWQ and GPTQ packed as their loaders document it
(written out here, independent of the engine's unpacking), compressed-tensors by its own package.

Each writer takes a random-weight transformers model, quantizes its projections, saves the packed
tensors in place of their `.weight`, and sets the model's weights to the dequantized values, so the
model becomes the reference: transformers on the dequantized weights in float32."""

from __future__ import annotations

import json
import os
import re

import torch
from safetensors.torch import save_file

# projections real AWQ / GPTQ checkpoints quantize (routers and the head stay float)
PROJECTIONS = re.compile(
    r"\.(q_proj|k_proj|v_proj|o_proj|qkv_proj|gate_proj|up_proj|down_proj|gate_up_proj|fc1|fc2|out_proj|w1|w2|w3)$"
)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ GEMM: nibble j of a word holds output column 8 c + AWQ_ORDER[j]


def pack_int32(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] integers 0 .. 2^bits - 1 -> int32 [R, C bits / 32], along the last dim: word c holds
    elements c * 32 / bits + j, element j in bits [bits j, bits (j + 1)), lowest bits first (GPTQ's and
    compressed-tensors' order)."""
    per = 32 // bits
    v = values.to(torch.int64).reshape(values.shape[0], -1, per)
    words = (v << (torch.arange(per, dtype=torch.int64) * bits)).sum(-1)
    return ((words + 2**31) % 2**32 - 2**31).to(torch.int32)  # the same 32 bits as a signed int32


def quantize_groups(w: torch.Tensor, bits: int, group: int, sym: bool, order: torch.Tensor | None = None):
    """w [N, K] -> (q [N, K] in 0 .. 2^b - 1, scales float16 [N, G], zeros [N, G], dequantized [N, K]),
    group g being the channels order[g G : (g + 1) G] (the inputs in order without `order`);
    w_dq = scale * (q - zero) with scales rounded to float16 first."""
    n, k = w.shape
    group = k if group == -1 else group
    order = torch.arange(k) if order is None else order
    wp = w[:, order].reshape(n, k // group, group)
    top = 2**bits - 1
    if sym:
        scales = (wp.abs().amax(-1) / (2 ** (bits - 1) - 1)).half()
        zeros = torch.full(scales.shape, 2 ** (bits - 1), dtype=torch.int64)
    else:
        lo, hi = wp.amin(-1).clamp(max=0), wp.amax(-1).clamp(min=0)
        scales = ((hi - lo) / top).half()
        zeros = torch.round(-lo / scales.float()).clamp(1, top).to(torch.int64)  # >= 1: GPTQ v1 stores z - 1
    s = scales.float().unsqueeze(-1)
    q = (torch.round(wp / s) + zeros.unsqueeze(-1)).clamp(0, top).to(torch.int64)
    dq = (s * (q - zeros.unsqueeze(-1))).reshape(n, k)
    inverse = torch.argsort(order)
    return q.reshape(n, k)[:, inverse], scales, zeros, dq[:, inverse]


def gptq_parts(w, bits, group, sym, order=None, v2=False):
    """GPTQ tensors of w [N, K]: qweight [K b / 32, N] (packed along the inputs), qzeros [G, N b / 32]
    (z - 1 unless v2), scales [G, N] float16, g_idx [K] (group of each input channel)."""
    q, scales, zeros, dq = quantize_groups(w, bits, group, sym, order)
    k = w.shape[1]
    group = k if group == -1 else group
    g_idx = torch.arange(k) // group
    if order is not None:
        g_idx = torch.empty_like(g_idx).scatter_(0, order, torch.arange(k) // group)
    stored = zeros - (0 if v2 else 1)
    parts = {
        "qweight": pack_int32(q, bits).t().contiguous(),
        "qzeros": pack_int32(stored.t().contiguous(), bits),
        "scales": scales.t().contiguous(),
        "g_idx": g_idx.to(torch.int32),
    }
    return parts, dq


def awq_pack(values: torch.Tensor) -> torch.Tensor:
    """[R, C] 4-bit values -> int32 [R, C / 8] in AWQ's interleaved order."""
    r, c = values.shape
    v = values.to(torch.int64).reshape(r, c // 8, 8)[..., list(AWQ_ORDER)]
    return pack_int32(v.reshape(r, c), 4)


def awq_parts(w, group, sym=False):
    """AWQ GEMM tensors of w [N, K]: qweight [K, N / 8], qzeros [K / G, N / 8], scales [K / G, N] float16
    (sym: every zero point 8, as a symmetric AWQ quantization stores them)."""
    q, scales, zeros, dq = quantize_groups(w, 4, group, sym=sym)
    parts = {
        "qweight": awq_pack(q.t().contiguous()),
        "qzeros": awq_pack(zeros.t().contiguous()),
        "scales": scales.t().contiguous(),
    }
    return parts, dq


def _expert_weights(model, sd: dict[str, torch.Tensor]) -> None:
    """transformers 5's fused expert stacks -> the per-expert tensors quantized checkpoints hold."""
    mixtral = "Mixtral" in type(model).__name__
    for name in [n for n in sd if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        stack = sd.pop(name)
        base = name.rsplit(".", 1)[0]
        for e in range(stack.shape[0]):
            if name.endswith("gate_up_proj"):
                half = stack.shape[1] // 2
                g, u = ("w1", "w3") if mixtral else ("gate_proj", "up_proj")
                sd[f"{base}.{e}.{g}.weight"], sd[f"{base}.{e}.{u}.weight"] = stack[e, :half], stack[e, half:]
            else:
                sd[f"{base}.{e}.{'w2' if mixtral else 'down_proj'}.weight"] = stack[e]


def _set_reference(model, name: str, dq: torch.Tensor) -> None:
    """Put the dequantized values where the transformers model keeps weight `name`."""
    m = re.match(r"(.*experts)\.(\d+)\.(\w+)\.weight$", name)
    with torch.no_grad():
        if m is None:
            model.get_parameter(name).copy_(dq)
            return
        base, e, proj = m.group(1), int(m.group(2)), m.group(3)
        if proj in ("w2", "down_proj"):
            model.get_parameter(f"{base}.down_proj")[e].copy_(dq)
        else:
            stack = model.get_parameter(f"{base}.gate_up_proj")
            half = stack.shape[1] // 2
            stack[e, :half].copy_(dq) if proj in ("w1", "gate_proj") else stack[e, half:].copy_(dq)


def input_key(name: str) -> str:
    """Projections that read the same input share it (q/k/v; gate/up): GPTQ's act-order, which comes from
    that input's statistics, is then one permutation for them."""
    return re.sub(r"\.(q_proj|k_proj|v_proj)\.weight$", ".attn_in", re.sub(
        r"\.(gate_proj|up_proj|w1|w3)\.weight$", ".mlp_in", name))  # fmt: skip


def write_packed(path: str, model, make_parts, quantization_config: dict, projections=PROJECTIONS) -> None:
    """Save `model` to `path` with every projection (module names `projections` finds) replaced by
    `make_parts(name, weight) -> (parts, dequantized)`; the model then holds the dequantized weights."""
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    _expert_weights(model, sd)
    for name in sorted(sd):
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and projections.search(module) and sd[name].dim() == 2:
            parts, dq = make_parts(name, sd.pop(name).float())
            _set_reference(model, name, dq)
            sd.update({f"{module}.{p}": t.contiguous() for p, t in parts.items()})
    os.makedirs(path, exist_ok=True)
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(path)
    save_file(sd, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    set_quantization_config(path, quantization_config)


def set_quantization_config(path: str, quantization_config: dict | None) -> None:
    file = os.path.join(path, "config.json")
    with open(file) as f:
        config = json.load(f)
    if quantization_config is None:
        config.pop("quantization_config", None)
    else:
        config["quantization_config"] = quantization_config
    with open(file, "w") as f:
        json.dump(config, f, indent=2)


def write_compressed_tensors(path: str, model, scheme: dict, fmt: str) -> None:
    """compressed-tensors' own compressor writes `model` as `fmt` with one config group over every Linear
    but the head; the model then holds the package's own decompression of what it wrote."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig, QuantizationScheme, apply_quantization_config,
    )  # fmt: skip
    from compressed_tensors.quantization.utils import calculate_qparams

    config = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], **scheme)},
        ignore=["lm_head", "re:.*mlp.gate$"],
    )  # fmt: skip
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    apply_quantization_config(model, config)
    names = []
    for name, module in model.named_modules():
        if not hasattr(module, "weight_scale"):
            continue
        names.append(name)
        args = module.quantization_scheme.weights
        w = module.weight.data
        if args.strategy == "group":
            w = w.view(w.shape[0], -1, args.group_size)
            lo, hi = w.amin(-1), w.amax(-1)
        else:
            lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        scale, zp = calculate_qparams(lo, hi, args)
        module.weight_scale.data.copy_(scale.to(module.weight_scale.dtype))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zp.to(module.weight_zero_point.dtype))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(path)
    compressor.decompress_model(model)  # the package's own dequantization: the reference weights
    with torch.no_grad():
        for name in names:
            reference[f"{name}.weight"] = model.get_submodule(name).weight.detach().float().clone()
    return reference

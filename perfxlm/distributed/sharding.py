"""Tensor parallelism by sharding: each rank builds the model with its share of the heads and columns and
loads only its slices of the checkpoint.

- Attention: the KV heads are split among the ranks in contiguous groups (as evenly as they go; 3 KV heads
  over 2 ranks: 2 and 1), each rank taking the query heads of its KV heads. QKV is column-parallel (its
  rows narrowed), o_proj row-parallel (its columns narrowed); each rank's KV cache holds its KV heads only.
- MLP: gate|up column-parallel, down row-parallel, the intermediate size split evenly. MoE experts are
  split the same way, every expert on every rank with 1/N of its intermediate size (vLLM's default for
  MoE under TP): routing stays replicated, every rank works on every token, and the shared expert is
  split like a dense MLP.
- The partial outputs of attention and MLP are summed by one all-reduce each, so a decoder layer costs
  two all-reduces whatever the family (Gemma 2 normalises after attention: the sum comes first).
- Vocabulary-parallel embedding (rows outside the rank's range read as zero, then all-reduced) and LM
  head (each rank's logits all-gathered, the padding cut off).
- Row-parallel biases are added once, by rank 0.

The model classes stay unchanged: a rank builds its model from a copy of the config holding its own head
counts and sizes (`shard_config`); checkpoint tensors are narrowed before `load_weights` sees them
(`read_shard`), from safetensors through `get_slice`, so only the rank's rows leave the file; the
collectives are added by wrapping the forward of the layers after loading (`parallelize`).

Quantized (prequantized) weights are not sharded yet: `check_supported` refuses them with a ValueError.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn

# Families whose layers are Llama-shaped or Gemma 2's (attention in `self_attn`, MLP in `mlp`). GLM's
# q/k rows are reordered within each head after the rank's heads are read, so its shards reorder alike.
SUPPORTED = {
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM",
    "Gemma2ForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM", "Gemma3ForCausalLM",
    "Qwen3MoeForCausalLM", "GlmForCausalLM", "Glm4ForCausalLM",
}  # fmt: skip


def split_sizes(total: int, parts: int) -> list[int]:
    size, extra = divmod(total, parts)
    return [size + (1 if i < extra else 0) for i in range(parts)]


def _range(total: int, parts: int, rank: int) -> tuple[int, int]:
    sizes = split_sizes(total, parts)
    return sum(sizes[:rank]), sizes[rank]


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


@dataclass(frozen=True)
class TPShard:
    rank: int
    world_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    @classmethod
    def of(cls, hf_config: Any, rank: int, world_size: int) -> "TPShard":
        heads = hf_config.num_attention_heads
        kv = getattr(hf_config, "num_key_value_heads", None) or heads
        return cls(rank, world_size, heads, kv, _head_dim(hf_config), hf_config.vocab_size)

    # ---- what this rank holds --------------------------------------------------------------
    @property
    def kv_range(self) -> tuple[int, int]:
        return _range(self.num_kv_heads, self.world_size, self.rank)

    @property
    def q_range(self) -> tuple[int, int]:
        group = self.num_heads // self.num_kv_heads
        start, n = self.kv_range
        return start * group, n * group

    @property
    def vocab_shard(self) -> int:
        return math.ceil(self.vocab_size / self.world_size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_shard

    def shard_config(self, hf_config: Any) -> Any:
        """A copy of the config with this rank's head counts, intermediate sizes and vocabulary shard."""
        cfg = copy.deepcopy(hf_config)
        cfg.head_dim = self.head_dim
        cfg.num_attention_heads = self.q_range[1]
        cfg.num_key_value_heads = self.kv_range[1]
        for name in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
            value = getattr(hf_config, name, None)
            if isinstance(value, int) and value > 0:
                setattr(cfg, name, _range(value, self.world_size, self.rank)[1])
        cfg.vocab_size = self.vocab_shard
        return cfg

    # ---- which slices of a checkpoint tensor -------------------------------------------------
    def pieces(self, name: str, shape: tuple[int, ...]) -> tuple[int, list[tuple[int, int]]] | str | None:
        """(dim, [(start, length), ...]) to read and concatenate along dim; "rank0" for a row-parallel bias
        (whole on rank 0, zeros elsewhere); "vocab" for the vocabulary shard; None to read whole."""
        hd = self.head_dim
        q0, qn = self.q_range
        k0, kn = self.kv_range
        q_rows, kv_rows = (q0 * hd, qn * hd), (k0 * hd, kn * hd)
        if re.search(r"(^|\.)embed_tokens\.weight$", name) or name == "lm_head.weight":
            return "vocab"
        if re.search(r"\.q_proj\.(weight|bias)$", name):
            return 0, [q_rows]
        if re.search(r"\.(k_proj|v_proj)\.(weight|bias)$", name):
            return 0, [kv_rows]
        if re.search(r"\.qkv_proj\.(weight|bias)$", name):  # fused [q; k; v] (Phi-3)
            q_size, kv_size = self.num_heads * hd, self.num_kv_heads * hd
            return 0, [q_rows, (q_size + kv_rows[0], kv_rows[1]), (q_size + kv_size + kv_rows[0], kv_rows[1])]
        if re.search(r"\.o_proj\.weight$", name):
            return 1, [q_rows]
        if re.search(r"\.experts\.gate_up_proj$", name):  # stacked [E, 2I, H]
            return 1, self._halves(shape[1])
        if re.search(r"\.experts\.down_proj$", name):  # stacked [E, H, I]
            return 2, [_range(shape[2], self.world_size, self.rank)]
        if re.search(r"\.gate_up_proj\.(weight|bias)$", name):  # fused [gate; up] (Phi-3)
            return 0, self._halves(shape[0])
        if re.search(r"\.(gate_proj|up_proj|w1|w3)\.(weight|bias)$", name):
            return 0, [_range(shape[0], self.world_size, self.rank)]
        if re.search(r"\.(down_proj|w2)\.weight$", name):
            return 1, [_range(shape[1], self.world_size, self.rank)]
        if re.search(r"\.(o_proj|down_proj|w2)\.bias$", name):
            return "rank0"
        return None

    def _halves(self, fused: int) -> list[tuple[int, int]]:
        inter = fused // 2
        start, n = _range(inter, self.world_size, self.rank)
        return [(start, n), (inter + start, n)]

    def read_shard(self, name: str, shape: tuple[int, ...], read: Callable[[tuple], torch.Tensor]) -> torch.Tensor:
        """This rank's part of checkpoint tensor `name`; `read(index)` returns the tensor indexed by a tuple
        of slices (a safetensors slice, or a tensor already in memory)."""
        spec = self.pieces(name, shape)
        if spec is None:
            return read(tuple(slice(None) for _ in shape))
        if spec == "rank0":
            whole = read(tuple(slice(None) for _ in shape))
            return whole if self.rank == 0 else torch.zeros_like(whole)
        if spec == "vocab":
            start = min(self.vocab_start, shape[0])
            stop = min(start + self.vocab_shard, shape[0])
            part = read((slice(start, stop),) + tuple(slice(None) for _ in shape[1:]))
            if part.shape[0] < self.vocab_shard:  # the last shard: padded with zero rows
                pad = torch.zeros((self.vocab_shard - part.shape[0], *part.shape[1:]), dtype=part.dtype)
                part = torch.cat([part, pad])
            return part
        dim, ranges = spec  # type: ignore[misc]
        parts = []
        for start, n in ranges:
            index = tuple(slice(start, start + n) if d == dim else slice(None) for d in range(len(shape)))
            parts.append(read(index))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def check_supported(model_cls: type, world_size: int, hf_config: Any, quantized: bool = False) -> None:
    name = model_cls.__name__
    if name not in SUPPORTED:
        raise ValueError(
            f"tensor_parallel_size > 1 is not supported for {name} yet; supported: {', '.join(sorted(SUPPORTED))}."
        )
    if quantized:
        raise ValueError("tensor_parallel_size > 1 with quantized weights is not supported yet: use float32/bfloat16 weights.")
    heads = hf_config.num_attention_heads
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    if world_size > kv:
        raise ValueError(
            f"tensor_parallel_size={world_size} exceeds the model's {kv} KV heads: each rank needs at least one KV head."
        )
    if heads % kv:
        raise ValueError(f"{heads} attention heads do not form groups over {kv} KV heads.")


def tp_quantization(quantization: Any) -> Any:
    """The quantization a rank loads with: "none" (GGUF blocks dequantized to the model dtype, float
    checkpoints as they are); quantized weights are not split across ranks yet (ValueError)."""
    if quantization is None:
        return "none"
    from perfxlm.quant.config import QuantizationConfig

    config = quantization if isinstance(quantization, QuantizationConfig) else QuantizationConfig.resolve(quantization)
    if config is None or config.method in ("none", "gguf"):
        return "none"
    raise ValueError(
        f"tensor_parallel_size > 1 with quantization={config.method!r} is not supported yet: quantized weights are "
        "not split across ranks. Use float32 / bfloat16 weights (a GGUF file is dequantized)."
    )


def iter_shard_weights(
    shard: TPShard, model_path: str, hf_config: Any, load_format: str, renames: list[tuple[str, str]],
    full_weights: Callable[[], Iterator[tuple[str, torch.Tensor]]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, this rank's slice). Safetensors are read slice by slice; other formats yield whole
    tensors one at a time (`full_weights`), narrowed before the next is read."""
    compiled = [(re.compile(p), r) for p, r in renames]

    def canonical(name: str) -> str:
        for pattern, replacement in compiled:
            name = pattern.sub(replacement, name)
        return name

    if load_format == "safetensors":
        from safetensors import safe_open

        from perfxlm.model.loader.hf import safetensors_files

        for path in safetensors_files(model_path):
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    sl = f.get_slice(name)
                    shape = tuple(sl.get_shape())
                    yield name, shard.read_shard(canonical(name), shape, lambda idx, sl=sl: sl[idx])
        return
    for name, tensor in full_weights():
        if not isinstance(tensor, torch.Tensor) or not tensor.dtype.is_floating_point:
            raise ValueError(f"{name}: quantized weights cannot be split across ranks yet (tensor_parallel_size > 1)")
        yield name, shard.read_shard(canonical(name), tuple(tensor.shape), lambda idx, t=tensor: t[idx].contiguous())


def parallelize(model: nn.Module, shard: TPShard, comm: Any) -> nn.Module:
    """Add the collectives to a rank's loaded model (see the module's docstring)."""
    from perfxlm.model.layers.embed_head import LMHead, VocabEmbedding

    for module in model.modules():
        fused = getattr(module, "fused_decode", None)
        if fused is not None:
            fused.eligible = False  # one native call per layer has no place for the all-reduces
        if hasattr(module, "self_attn") and hasattr(module, "mlp"):
            for part in (module.self_attn, module.mlp):
                part.forward = _reduced(part.forward, comm)
        if isinstance(module, VocabEmbedding):
            module.forward = _vocab_parallel_embedding(module.forward, shard, comm)
        elif isinstance(module, LMHead):
            module.forward = _gathered_logits(module.forward, shard, comm)
    return model


def _reduced(forward: Callable[..., torch.Tensor], comm: Any) -> Callable[..., torch.Tensor]:
    def run(*args: Any, **kwargs: Any) -> torch.Tensor:
        return comm.all_reduce(forward(*args, **kwargs).contiguous())

    return run


def _vocab_parallel_embedding(forward: Callable, shard: TPShard, comm: Any) -> Callable:
    start, size = shard.vocab_start, shard.vocab_shard

    def run(input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - start
        outside = (local < 0) | (local >= size)
        x = forward(local.masked_fill(outside, 0))
        return comm.all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0).contiguous())

    return run


def _gathered_logits(forward: Callable, shard: TPShard, comm: Any) -> Callable:
    vocab = shard.vocab_size

    padded = shard.vocab_shard * shard.world_size != vocab

    def run(hidden: torch.Tensor) -> torch.Tensor:
        logits = comm.all_gather(forward(hidden))
        return logits[..., :vocab].contiguous() if padded else logits

    return run

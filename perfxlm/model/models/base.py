"""What every model shares: loading checkpoint tensors by name table (`CheckpointModel`), and the forward
contracts of causal LMs (`CausalLM`) and of encoders that only pool (`EncoderModel`).

A model file declares, as data, how checkpoint names map onto its parameters; the loader hands it
(hf_name, tensor) pairs and nothing model-specific:
- `renames`: regex rewrites applied to every checkpoint name first (e.g. Mixtral's block_sparse_moe -> mlp);
- `stacked_params`: checkpoint fragments that load as one shard of a fused parameter. A fragment with
  `{expert}` matches per-expert tensors of a parameter stacked as [num_experts, ...];
- `skip_substrings`: checkpoint tensors to ignore.
A checkpoint tensor whose name is already the fused parameter's (Phi-3's qkv_proj, transformers 5's
stacked experts) loads whole.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar, Iterable, Sequence

import torch
from torch import nn

from perfxlm.model.layers.rank_sharded import RankSharded


def _compile_stacked(table: list[tuple[str, str, str]]) -> list[tuple[re.Pattern[str], str, str]]:
    compiled = []
    for fused, original, shard in table:
        pattern = re.escape(original).replace(re.escape("{expert}"), r"(?P<expert>\d+)")
        compiled.append((re.compile(pattern), fused, shard))
    return compiled


def _as_float(tensor: Any) -> torch.Tensor:
    """A quantized checkpoint tensor (perfxlm.quant.QuantizedWeight) no sink kept, as float32 values."""
    return tensor if isinstance(tensor, torch.Tensor) else tensor.dense()


def _rank_part(
    module: nn.Module, name: str, local: str, tensor: Any, shard: str | None, expert: int | None
) -> Any:
    """What of a checkpoint tensor a tensor-parallel layer keeps (its rank's rows or columns); a
    replicated layer keeps it whole."""
    if not isinstance(module, RankSharded):
        return tensor
    try:
        return module.rank_part(local, tensor, shard, expert)
    except ValueError as e:  # e.g. a rank's share of a quantized weight's inputs is not whole groups
        part = "" if shard is None else f" ({shard if expert is None else f'expert {expert} {shard}'})"
        raise ValueError(f"{name}{part}: {e}") from None


def _shard_key(param: str, shard: str, expert: int | None) -> str:
    return f"{param}:{shard}" if expert is None else f"{param}:{expert}.{shard}"


@dataclass(frozen=True)
class CheckpointNames:
    """A model's checkpoint-name tables on their own, so names can be placed where no model module exists
    (an exported graph records its model's tables; perfxlm/export/lora_record.py)."""

    renames: Sequence[tuple[str, str]]
    stacked_params: Sequence[tuple[str, str, str]]

    def locate(self, name: str) -> tuple[str, str | None]:
        """CheckpointModel.locate's answer for these tables."""
        for pattern, replacement in self.renames:
            name = re.sub(pattern, replacement, name)
        for pattern, fused, shard in _compile_stacked(list(self.stacked_params)):
            m = pattern.search(name)
            if m is not None:  # a per-expert tensor has no projection of its own: returned as it is
                return (name, None) if "expert" in pattern.groupindex else (name[: m.start()] + fused + name[m.end() :], shard)
        return name, None


class CheckpointModel(nn.Module):
    # (regex, replacement) applied to checkpoint names in order
    renames: ClassVar[list[tuple[str, str]]] = []
    # (fused param fragment, checkpoint fragment, shard name) e.g. (".qkv_proj", ".q_proj", "q"); the
    # first matching entry wins, so per-expert entries go before the dense ones they contain
    stacked_params: ClassVar[list[tuple[str, str, str]]] = []
    # checkpoint tensors to ignore (e.g. precomputed rotary tables)
    skip_substrings: ClassVar[list[str]] = ["rotary_emb.inv_freq"]

    def tied_param_names(self) -> set[str]:
        return set()

    def locate(self, name: str) -> tuple[str, str | None]:
        """Where a checkpoint tensor name lands: (the model's parameter name, the shard of a fused
        parameter or None), by the same `renames` and `stacked_params` tables as load_weights. Used to
        place tensors named like the checkpoint's (a LoRA adapter's) without loading them."""
        return CheckpointNames(self.renames, self.stacked_params).locate(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], sink: Any = None) -> None:
        """`sink` (perfxlm.quant.loading.QuantizedLoader): offered each tensor before it is copied into its
        parameter; it keeps quantized weights (a GGUF file's blocks, or float weights it quantizes)."""
        params = dict(self.named_parameters(remove_duplicate=False))
        modules = dict(self.named_modules())
        renames = [(re.compile(p), r) for p, r in self.renames]
        stacked = _compile_stacked(self.stacked_params)
        expected = self._expected_loads()  # before a sink replaces parameters with quantized weights
        loaded: set[str] = set()
        for name, tensor in weights:
            if any(s in name for s in self.skip_substrings):
                continue
            for pattern, replacement in renames:
                name = pattern.sub(replacement, name)
            for pattern, fused, shard in stacked:
                m = pattern.search(name)
                if m is None:
                    continue
                target = name[: m.start()] + fused + name[m.end() :]
                if target not in params:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in the model ({target!r})")
                expert = int(m.group("expert")) if "expert" in pattern.groupindex else None
                parent, local = target.rsplit(".", 1)
                module = modules[parent]
                tensor = _rank_part(module, target, local, tensor, shard, expert)
                if sink is None or not sink.load(module, local, tensor, shard, expert):
                    tensor = _as_float(tensor)
                    module.load_shard(params[target], tensor, shard, expert)  # type: ignore[operator]
                loaded.add(_shard_key(target, shard, expert))
                break
            else:
                if name not in params:
                    if name in self.tied_param_names():
                        continue  # checkpoint stores the tied head too; it is the embedding
                    raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
                param = params[name]
                parent, local = name.rsplit(".", 1)
                tensor = _rank_part(modules[parent], name, local, tensor, None, None)
                if param.shape != tensor.shape:
                    raise ValueError(
                        f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(param.shape)}"
                    )
                if sink is None or not sink.load(modules[parent], local, tensor, None, None):
                    param.data.copy_(_as_float(tensor))
                loaded.add(name)
                shards = getattr(modules[parent], "expected_shards", None)
                if shards is not None:  # already fused in the checkpoint: every shard at once
                    loaded.update(f"{name}:{s}" for s in shards(local))
        if sink is not None:
            sink.finish()
        missing = expected - loaded
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {sorted(missing)[:3]}")

    def _expected_loads(self) -> set[str]:
        expected: set[str] = set()
        modules = dict(self.named_modules())
        tied = self.tied_param_names()
        for name, _ in self.named_parameters():  # duplicates (tied) removed
            parent, local = name.rsplit(".", 1)
            shards = getattr(modules[parent], "expected_shards", None)
            if shards is not None:
                expected.update(f"{name}:{s}" for s in shards(local))
            elif name not in tied:
                expected.add(name)
        return expected


class CausalLM(CheckpointModel):
    """A decoder with an LM head: what the generate runner serves (the pooling runner pools its last hidden
    states: a causal LM used as an embedder)."""

    # whether every layer that holds a weight is built from the parallel layers (model/layers/
    # parallel_linear.py, the vocabulary-parallel embedding and head), so a rank builds its shard
    supports_tensor_parallel: ClassVar[bool] = False

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[num_tokens] ids and positions -> [num_tokens, hidden] final hidden states."""
        raise NotImplementedError

    def forward_pre_norm(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(forward's final hidden states, the last decoder layer's output before the final norm): what a
        checkpoint's multi-token-prediction layers read (speculative decoding's `mtp`)."""
        raise NotImplementedError(f"{type(self).__name__} does not expose its hidden states before the final norm.")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_rows, hidden] -> [num_rows, vocab] float32."""
        raise NotImplementedError


def num_labels_of(config: Any) -> int:
    """A sequence-classification head's labels, as transformers counts them (num_labels, else id2label)."""
    labels = getattr(config, "num_labels", None) or len(getattr(config, "id2label", None) or {}) or 2
    return int(labels)


class EncoderModel(CheckpointModel):
    """A bidirectional encoder (BERT, XLM-RoBERTa): hidden states for pooling, no LM head, no KV cache; only
    the pooling runner serves it. Sequences of a batch attend to themselves only (the forward context's
    `CachelessBatch`)."""

    # what the checkpoint's own config means when nothing (sentence-transformers' modules.json) says more
    default_pooling_type: ClassVar[str] = "CLS"
    # the number of labels of a sequence-classification head (0: none, an embedder)
    num_labels: int = 0
    # the token whose state a classification head reads (decoders with a score head read the last)
    classifier_token: ClassVar[str] = "first"

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[num_tokens] ids, positions (0-based within each sequence) and segment ids -> [num_tokens, hidden]."""
        raise NotImplementedError

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """[num_seqs, hidden] pooled states -> [num_seqs, num_labels] float32 logits (classifiers only)."""
        raise ValueError(f"{type(self).__name__} has no classification head.")

    def max_positions(self) -> int:
        """The longest sequence the position table holds."""
        raise NotImplementedError

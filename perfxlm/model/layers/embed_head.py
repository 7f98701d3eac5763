"""Token embeddings and LM heads; the vocabulary-parallel ones hold one rank's rows of the table under
tensor parallelism (each rank ceil(V / ranks) rows, the last padded with zero rows)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from perfxlm.distributed.parallel_state import TPGroup, tp_group
from perfxlm.model.layers.activation import soft_cap
from perfxlm.model.layers.linear_methods.base import LinearMethod, LinearPlan
from perfxlm.model.layers.linear_methods.registry import method_for
from perfxlm.model.layers.linear_methods.unquantized import UnquantizedLinear
from perfxlm.model.layers.rank_sharded import ROWS, check_whole, narrow, pad_rows
from perfxlm.quant.targets import TABLE, QuantizableWeight
from perfxlm.quant.weight import QuantizedWeight


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, scale: float | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        # Gemma multiplies by sqrt(hidden), rounded to the model dtype first as transformers does
        self.scale = scale
        # Set when the table is stored narrower than the activations (bf16 weights, float32 compute).
        self.compute_dtype: torch.dtype | None = None

    def quantizable_weights(self) -> list[QuantizableWeight]:
        return [QuantizableWeight("weight", TABLE, self.weight.shape[-1], lookup=True)]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if type(self.weight) is QuantizedWeight:  # a GGUF table kept quantized: only these rows widen
            x = self.weight.embedding(input_ids)
        else:
            x = F.embedding(input_ids, self.weight)
        if self.compute_dtype is not None:
            x = x.to(self.compute_dtype)
        if self.scale is not None:
            x = x * torch.tensor(self.scale, dtype=torch.float32).to(x.dtype)
        return x


class LearnedPositionalEmbedding(nn.Module):
    """Absolute positions looked up in a table; OPT's starts `offset` rows in (rows 0-1 unused)."""

    def __init__(self, max_positions: int, hidden_size: int, offset: int = 0) -> None:
        super().__init__()
        self.offset = offset
        self.weight = nn.Parameter(torch.empty(max_positions + offset, hidden_size), requires_grad=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return F.embedding(positions + self.offset, self.weight)


class LMHead(nn.Module):
    """Projects hidden states to vocabulary logits; shares the embedding's weight when tied. Its product
    runs by a linear method chosen at load, as a Linear's (a tied head's weight is the table's)."""

    # Only each sequence's last rows reach it in a step (prompt logprobs aside): the code layouts that only
    # a GEMV reads go here (perfxlm/quant/layout_choice.py).
    few_rows = True

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        tied_to: VocabEmbedding | None = None,
        logit_soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        self.vocab_size = self.out_features = vocab_size
        self.in_features = hidden_size
        self.method: LinearMethod = UnquantizedLinear()
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        self.logit_soft_cap = logit_soft_cap

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # Logits in float32 whatever the model dtype: sampling and logprobs want the precision.
        logits = self.method.apply(self, hidden, None).float()
        if self.logit_soft_cap is not None:
            logits = soft_cap(logits, self.logit_soft_cap)
        return logits

    def quantizable_weights(self) -> list[QuantizableWeight]:
        return [QuantizableWeight("weight", TABLE, self.in_features)]

    def bind_linear_method(self, plan: LinearPlan) -> None:
        self.method = method_for(self.weight, plan)
        self.method.process_after_loading(self, plan)


class VocabShard:
    """Rows [start, start + rows) of a vocabulary of `vocab_size` this rank holds (all of it with one rank)."""

    def __init__(self, vocab_size: int, tp: TPGroup) -> None:
        self.tp = tp
        self.vocab_size = vocab_size
        self.rows = math.ceil(vocab_size / tp.world_size)
        self.start = tp.rank * self.rows

    def cut(self, tensor: Any) -> Any:
        """This rank's rows of a [vocab, ...] checkpoint tensor, zero rows past the vocabulary's end."""
        if not self.tp.parallel:
            return tensor
        check_whole(tensor, ROWS, self.vocab_size)
        start = min(self.start, tensor.shape[0])
        return pad_rows(narrow(tensor, ROWS, start, min(self.rows, tensor.shape[0] - start)), self.rows)


class VocabParallelEmbedding(VocabEmbedding):
    """An embedding table split by vocabulary rows: ids outside this rank's rows read zeros, and one
    all-reduce gives every rank every token's row."""

    def __init__(self, vocab_size: int, hidden_size: int, scale: float | None = None) -> None:
        shard = VocabShard(vocab_size, tp_group())
        super().__init__(shard.rows, hidden_size, scale)
        self.shard = shard

    def rank_part(self, param_name: str, tensor: Any, shard: str | None, expert: int | None) -> Any:
        return self.shard.cut(tensor)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.shard.tp.parallel:
            return super().forward(input_ids)
        local = input_ids - self.shard.start
        outside = (local < 0) | (local >= self.shard.rows)
        x = super().forward(local.masked_fill(outside, 0))
        return self.shard.tp.all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0))


class ParallelLMHead(LMHead):
    """An LM head split by vocabulary rows (a tied one shares the embedding's shard): each rank's logits
    are all-gathered and the padding rows cut off."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        tied_to: VocabParallelEmbedding | None = None,
        logit_soft_cap: float | None = None,
    ) -> None:
        shard = VocabShard(vocab_size, tp_group())
        super().__init__(shard.rows, hidden_size, tied_to, logit_soft_cap)
        self.shard = shard
        self.padded = shard.rows * shard.tp.world_size != vocab_size

    def rank_part(self, param_name: str, tensor: Any, shard: str | None, expert: int | None) -> Any:
        return self.shard.cut(tensor)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().forward(hidden)
        if not self.shard.tp.parallel:
            return logits
        logits = self.shard.tp.all_gather(logits)
        return logits[..., : self.shard.vocab_size].contiguous() if self.padded else logits

"""Token sampling from float32 logits of the rows that sample.

0. Logprobs, when asked, come from the raw logits (the model's distribution before any of the
   transforms below, as vLLM returns by default).
1. Logits processors and penalties (logits_processors.py), the structured-output bitmask first.
2. Greedy rows take the argmax.
3. Random rows: logits / temperature -> min_p -> top_k -> top_p (vLLM's order), then one
   uniform draw per row through the cumulative distribution (one random number per row: the
   exponential race needs one per vocabulary entry, 150 ms for 64 rows on this CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from perfxlm.model.layers.logits_processors import (
    Penalties,
    SparseLogitEdits,
    apply_allowed,
    apply_grammar_bitmask,
    apply_penalties,
    apply_sparse_edits,
)


@dataclass(slots=True)
class SamplingMetadata:
    temperature: torch.Tensor  # [num_rows] float32; 0 for greedy rows
    all_greedy: bool
    top_p: torch.Tensor | None  # [num_rows] or None when no row filters
    top_k: torch.Tensor | None  # [num_rows] int64, vocab size where off
    min_p: torch.Tensor | None
    generators: dict[int, torch.Generator]  # row -> generator, for rows with a seed
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids) for allowed_token_ids
    edits: SparseLogitEdits | None = None  # bans and logit_bias
    penalties: Penalties | None = None
    max_num_logprobs: int | None = None  # None: no row wants logprobs; 0: only the sampled token's
    grammar: tuple[list[int], torch.Tensor] | None = None  # (guided rows, bitmask [num_rows, words])

    def to(self, device: torch.device) -> "SamplingMetadata":
        """The same metadata with its tensors where the logits are (built on the CPU, as Python lists
        become tensors; one copy each per step). Seeded generators stay CPU generators: each draws its
        row's one uniform there, so a seed gives the same tokens on every device."""
        if device.type == "cpu":
            return self

        def move(t):
            return None if t is None else t.to(device, non_blocking=True)

        return SamplingMetadata(
            move(self.temperature), self.all_greedy, move(self.top_p), move(self.top_k), move(self.min_p),
            self.generators,
            allowed=None if self.allowed is None else (move(self.allowed[0]), move(self.allowed[1])),
            edits=None if self.edits is None else SparseLogitEdits(*map(move, (self.edits.rows, self.edits.cols,
                                                                               self.edits.values))),
            penalties=None if self.penalties is None else Penalties(*map(move, (
                self.penalties.repetition, self.penalties.frequency, self.penalties.presence,
                self.penalties.prompt_ids, self.penalties.output_ids))),
            max_num_logprobs=self.max_num_logprobs,
            grammar=None if self.grammar is None else (self.grammar[0], move(self.grammar[1])),
        )  # fmt: skip


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [num_rows] int64
    # With logprobs: column 0 is the sampled token, then the top max_num_logprobs tokens.
    logprob_token_ids: torch.Tensor | None = None  # [num_rows, 1 + k] int64
    logprobs: torch.Tensor | None = None  # [num_rows, 1 + k] float32
    sampled_ranks: torch.Tensor | None = None  # [num_rows] int64, 1 = most likely


def compute_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logprobs [rows, vocab] and the chosen token per row -> (ids [rows, 1+k], logprobs, ranks)."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    if k > 0:
        top_vals, top_ids = logprobs.topk(k, dim=-1)
        return torch.cat([token_ids.unsqueeze(1), top_ids], 1), torch.cat([chosen, top_vals], 1), ranks
    return token_ids.unsqueeze(1), chosen, ranks


# Top-p looks at this many best tokens first; only rows whose mass there stays below p need a full sort.
_TOP_P_CANDIDATES = 1024


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """Mask (to -inf) what top-k and then top-p drop. Sorting the whole vocabulary is slow on CPU,
    so both work on a top-k slice and fall back to a full sort only where the slice is not enough.
    Rows with the filter off (k >= vocab, p >= 1) neither widen the slice nor force the sort."""
    if k is None and p is None:
        return logits
    vocab = logits.shape[-1]
    if k is not None:
        k = k.clamp(1, vocab)
        active = k < vocab
        if bool(active.any()):
            width = int(k[active].max())
            top = logits.topk(width, dim=-1).values  # [rows, width], descending
            kth = top.gather(1, (k.clamp(max=width) - 1).unsqueeze(1))
            kth = torch.where(active.unsqueeze(1), kth, torch.full_like(kth, float("-inf")))
            logits = logits.masked_fill(logits < kth, float("-inf"))
    if p is not None:
        p_active = p < 1.0
        if not bool(p_active.any()):
            return logits
        n = min(vocab, _TOP_P_CANDIDATES)
        probs = logits.softmax(dim=-1)
        cand = probs.topk(n, dim=-1).values  # descending
        mass_before = cand.cumsum(dim=-1) - cand
        complete = (mass_before[:, -1] + cand[:, -1] >= p) | (n == vocab) | ~p_active
        if not bool(complete.all()):
            cand = probs.sort(dim=-1, descending=True).values
            mass_before = cand.cumsum(dim=-1) - cand
        # Keep a token while the mass ranked above it is still below p (the best token always stays).
        num_keep = (mass_before < p.unsqueeze(1)).sum(dim=-1).clamp(min=1, max=cand.shape[1])
        threshold = cand.gather(1, (num_keep - 1).unsqueeze(1))
        threshold = torch.where(p_active.unsqueeze(1), threshold, torch.zeros_like(threshold))
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


class Sampler:
    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        raw_logprobs = logits.log_softmax(dim=-1) if meta.max_num_logprobs is not None else None
        logits = self.apply_processors(logits, meta)
        token_ids = self.sample(logits, meta)
        if raw_logprobs is None:
            return SamplerOutput(token_ids)
        ids, lps, ranks = compute_logprobs(raw_logprobs, token_ids, meta.max_num_logprobs or 0)
        return SamplerOutput(token_ids, ids, lps, ranks)

    @staticmethod
    def apply_processors(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Stage 1: the grammar mask, allowed tokens, bans and biases, penalties."""
        if meta.grammar is not None:
            logits = apply_grammar_bitmask(logits, *meta.grammar)
        if meta.allowed is not None:
            logits = apply_allowed(logits, *meta.allowed)
        if meta.edits is not None:
            logits = apply_sparse_edits(logits, meta.edits)
        if meta.penalties is not None:
            logits = apply_penalties(logits, meta.penalties)
        return logits

    def sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:  # [num_rows] int64
        if meta.all_greedy:
            return logits.argmax(dim=-1)
        is_greedy = meta.temperature == 0
        any_greedy = bool(is_greedy.any())
        greedy = logits.argmax(dim=-1) if any_greedy else None
        sampled = sample_from_probs(self.probabilities(logits, meta), meta.generators)
        return torch.where(is_greedy, greedy, sampled) if any_greedy else sampled

    @staticmethod
    def probabilities(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Stage 3's distribution of every row (greedy rows as if at temperature 1): what random rows
        draw from, and what speculative decoding's rejection sampler accepts drafts against."""
        is_greedy = meta.temperature == 0
        temp = torch.where(is_greedy, torch.ones_like(meta.temperature), meta.temperature)
        logits = logits / temp.unsqueeze(1)
        if meta.min_p is not None:
            logits = apply_min_p(logits, meta.min_p)
        logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
        return logits.softmax(dim=-1)


def sample_from_probs(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One uniform draw per row through the cumulative distribution: a row with a seed draws from its
    own generator, so its tokens do not depend on what else is in the batch."""
    u = torch.rand(probs.shape[0], 1)
    for row, gen in generators.items():
        u[row] = torch.rand(1, generator=gen)
    return sample_with_uniforms(probs, u.to(probs.device))


def sample_with_uniforms(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs [rows, vocab] (need not sum to 1), u [rows, 1] uniform in [0, 1) -> [rows] token ids."""
    cdf = probs.cumsum(dim=-1)
    # Scale by the row total so rounding in the cumulative sum never leaves u past the end.
    idx = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)
    return idx.squeeze(1).clamp_(max=probs.shape[-1] - 1)

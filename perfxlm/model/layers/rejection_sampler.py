"""Speculative decoding's verification: which draft tokens the target model accepts.

A request verified this step has k draft tokens d_1..d_k and k + 1 rows of target logits: row j scores
the token after d_j (row 0 the token after the request's last known token). Every proposer here is
deterministic (its draft is one token, probability 1), so vLLM's rejection rule min(1, p/q) reduces to:

- greedy rows: accept d_j while it is the target's argmax; at the first mismatch emit the argmax. The
  emitted tokens are the ones decoding without speculation would produce, bit for bit.
- random rows: accept d_j with probability p_j(d_j) (one uniform draw u_j < p_j(d_j)); at the first
  rejection sample from p_j with d_j removed and renormalised (the residual max(p - q, 0)); when every
  draft is accepted, sample the bonus token from p_k. Each emitted token then has exactly the target's
  distribution given the tokens before it (Leviathan et al. 2023; Chen et al. 2023).

p_j is the sampler's own distribution (`Sampler.probabilities`: temperature, min_p, top-k, top-p after
the logits processors), so every sampling parameter means what it means without speculation. A row with
a seed draws its k + 1 uniforms from the request's generator, in order: seeded outputs are reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from perfxlm.model.layers.sampler import Sampler, SamplingMetadata, compute_logprobs, sample_with_uniforms


@dataclass(slots=True)
class VerifiedTokens:
    token_ids: list[list[int]]  # per request: the accepted drafts, then one token from the target
    # per request, when the metadata asks for logprobs: (ids [n, 1 + k], logprobs [n, 1 + k], ranks [n]) of
    # the emitted tokens, from the raw logits as the plain sampler reports them
    logprobs: list[tuple[list[list[int]], list[list[float]], list[int]]] | None = None


class RejectionSampler:
    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata, drafts: list[list[int]]) -> VerifiedTokens:
        """logits [sum(len(d) + 1), vocab] float32, each request's rows together in `drafts` order; `meta`
        describes those rows (a request's rows share its parameters and generator)."""
        raw_logprobs = logits.log_softmax(dim=-1) if meta.max_num_logprobs is not None else None
        logits = self.sampler.apply_processors(logits, meta)
        greedy = (meta.temperature == 0).tolist()
        best = logits.argmax(dim=-1).tolist() if any(greedy) else None
        probs = None if meta.all_greedy else self.sampler.probabilities(logits, meta)
        emitted: list[list[int]] = []
        row = 0
        for d in drafts:
            k = len(d)
            if greedy[row]:
                tokens = _greedy(best[row : row + k + 1], d)  # type: ignore[index]
            else:
                tokens = _random(probs[row : row + k + 1], d, meta.generators.get(row))  # type: ignore[index]
            emitted.append(tokens)
            row += k + 1
        if raw_logprobs is None:
            return VerifiedTokens(emitted)
        rows, ids = [], []
        row = 0
        for d, tokens in zip(drafts, emitted):
            rows.extend(range(row, row + len(tokens)))
            ids.extend(tokens)
            row += len(d) + 1
        lp_ids, lps, ranks = compute_logprobs(raw_logprobs[torch.tensor(rows)], torch.tensor(ids),
                                              meta.max_num_logprobs or 0)  # fmt: skip
        lp_ids_l, lps_l, ranks_l = lp_ids.tolist(), lps.tolist(), ranks.tolist()
        per_request, start = [], 0
        for tokens in emitted:
            end = start + len(tokens)
            per_request.append((lp_ids_l[start:end], lps_l[start:end], ranks_l[start:end]))
            start = end
        return VerifiedTokens(emitted, per_request)


def _greedy(best: list[int], drafts: list[int]) -> list[int]:
    tokens = []
    for j, d in enumerate(drafts):
        tokens.append(best[j])
        if best[j] != d:
            return tokens
    tokens.append(best[len(drafts)])
    return tokens


def _random(probs: torch.Tensor, drafts: list[int], gen: torch.Generator | None) -> list[int]:
    """probs [k + 1, vocab]: the target's distributions at the request's rows."""
    k = len(drafts)
    u = torch.rand(k + 1, generator=gen) if gen is not None else torch.rand(k + 1)
    p_draft = probs[torch.arange(k), torch.tensor(drafts, dtype=torch.int64)].tolist() if k else []
    u_list = u.tolist()
    tokens = []
    for j, d in enumerate(drafts):
        if u_list[j] < p_draft[j]:
            tokens.append(d)
            continue
        residual = probs[j].clone()
        residual[d] = 0.0  # max(p - q, 0) for a draft of probability 1
        if not bool(residual.sum() > 0):  # p(d) rounded below 1 with nothing else left: d is all there is
            residual = probs[j]
        tokens.append(int(sample_with_uniforms(residual.unsqueeze(0), u[k:].unsqueeze(0))[0]))
        return tokens
    tokens.append(int(sample_with_uniforms(probs[k:], u[k:].unsqueeze(0))[0]))
    return tokens

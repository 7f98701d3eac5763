"""Per-step sampling tensors, built once from the rows that sample (no per-token Python)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from perfxlm.model.layers.logits_processors import Penalties, SparseLogitEdits
from perfxlm.model.layers.sampler import SamplingMetadata
from perfxlm.sampling_params import SamplingParams, SamplingType


@dataclass(slots=True)
class SampleRow:
    request_id: str  # whose token this row samples (a forked child has its own id)
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]


def _pad(rows: list[list[int]], pad: int) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    out = torch.full((len(rows), width), pad, dtype=torch.int64)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
    return out


def _banned_by_bad_words(bad_words: list[list[int]], output: list[int]) -> list[int]:
    """vLLM's rule: a bad word's last token is banned when the output already ends with the rest of it."""
    banned = []
    for word in bad_words:
        prefix = word[:-1]
        if not prefix or output[-len(prefix):] == prefix:
            banned.append(word[-1])
    return banned


def build_sampling_metadata(
    rows: list[SampleRow], generators: dict[str, torch.Generator], vocab_size: int
) -> SamplingMetadata:
    params = [r.params for r in rows]
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32)
    all_greedy = all(p.sampling_type == SamplingType.GREEDY for p in params)
    top_p = top_k = min_p = None
    if not all_greedy:
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
        if any(p.top_k > 0 for p in params):
            top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab_size for p in params], dtype=torch.int64)
        if any(p.min_p > 0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32)

    seeded: dict[int, torch.Generator] = {}
    for i, r in enumerate(rows):
        if r.params.sampling_type == SamplingType.RANDOM_SEED:
            gen = generators.get(r.request_id)
            if gen is None:
                gen = generators[r.request_id] = torch.Generator().manual_seed(r.params.seed)
            seeded[i] = gen

    allowed = None
    allowed_rows = [(i, p.allowed_token_ids) for i, p in enumerate(params) if p.allowed_token_ids]
    if allowed_rows:
        rr = [i for i, ids in allowed_rows for _ in ids]
        cc = [t for _, ids in allowed_rows for t in ids]
        allowed = (torch.tensor(rr, dtype=torch.int64), torch.tensor(cc, dtype=torch.int64))

    e_rows: list[int] = []
    e_cols: list[int] = []
    e_vals: list[float] = []
    for i, r in enumerate(rows):
        p = r.params
        bans: list[int] = []
        if len(r.output_token_ids) < p.min_tokens:
            bans.extend(p.all_stop_token_ids)
        if p._bad_words_token_ids:
            bans.extend(_banned_by_bad_words(p._bad_words_token_ids, r.output_token_ids))
        for t in set(bans):
            e_rows.append(i), e_cols.append(t), e_vals.append(float("-inf"))
        for t, bias in (p.logit_bias or {}).items():
            e_rows.append(i), e_cols.append(int(t)), e_vals.append(float(bias))
    edits = None
    if e_rows:
        edits = SparseLogitEdits(
            torch.tensor(e_rows, dtype=torch.int64),
            torch.tensor(e_cols, dtype=torch.int64),
            torch.tensor(e_vals, dtype=torch.float32),
        )

    penalties = None
    if any(p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty for p in params):
        penalties = Penalties(
            repetition=torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32),
            frequency=torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32),
            presence=torch.tensor([p.presence_penalty for p in params], dtype=torch.float32),
            prompt_ids=_pad([r.prompt_token_ids for r in rows], vocab_size),
            output_ids=_pad([r.output_token_ids for r in rows], vocab_size),
        )

    wants = [p.logprobs for p in params if p.logprobs is not None or p.needs_sampled_logprob]
    max_num_logprobs = max((w or 0 for w in wants), default=None) if wants else None
    return SamplingMetadata(
        temperature, all_greedy, top_p, top_k, min_p, seeded,
        allowed=allowed, edits=edits, penalties=penalties, max_num_logprobs=max_num_logprobs,
    )

"""The checkpoint's own multi-token-prediction layer (DeepSeek-V3's `num_nextn_predict_layers`) as the
proposer: from the target's hidden state at position t and token t+1 it predicts token t+2, so after each
step it guesses the token after the request's newest one, then repeats on its own output for the rest.

The layer keeps a paged KV cache of its own (model/models/deepseek_mtp.py: one MLA decoder layer). Its
entry at position t needs the target's hidden state at t, which exists only in the step that computed
t: so every step, the rows the runner hands over (`HiddenRows`: prefill chunks, decodes, the accepted
part of verifications) are run through the layer at once (`observe`), for every request of the step,
speculating or not. What it computed for its own guesses is rolled back before that (the target's states
replace its own even where a guess was accepted).

A request's MTP sequence starts where its first rows do: after a prefix-cache hit or a fork (n > 1) the
positions before were computed by another request, and the layer attends only to what it saw (its own
positions count from 0 there: rotary angles are relative, so the attention is that of the same rows at
their true positions). Preemption restarts it with the recomputed prompt. Guesses only cost or save
time: the target's verification keeps outputs exact whatever the layer attends to.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from perfxlm.engine.kv_cache_manager import KVCacheManager
from perfxlm.engine.messages import HiddenRows, ScheduledRequest
from perfxlm.engine.request import Request
from perfxlm.model.forward_context import set_forward_context
from perfxlm.sampling_params import SamplingParams
from perfxlm.spec_decode.proposer import DraftRequest, Proposer
from perfxlm.worker.model_runner import ModelRunner

_GREEDY = SamplingParams(temperature=0, max_tokens=1)


@dataclass
class _MTPSeq:
    slots: Request  # the request as the layer's KV manager sees it (num_computed_tokens: local positions)
    base: int  # the target position of the layer's local position 0
    computed: int = 0  # local positions whose K/V came from the target's hidden states
    state: torch.Tensor | None = None  # the layer's output at the last of them (continued by the guesses)
    guess: int | None = None  # the token it predicts there: the first guess


class MTPProposer(Proposer):
    name = "mtp"
    needs_hidden_states = True

    def __init__(self, target_config: Any, target_model: torch.nn.Module, num_kv_blocks: int) -> None:
        from perfxlm.spec_decode.mtp_loading import load_mtp

        t = target_config
        self.mtp, self.embed, self.head = load_mtp(t, target_model)
        self.block_size = t.block_size
        # as many blocks as the target's pool: the layer follows the same tokens, in one layer's bytes
        self.kv = KVCacheManager(num_kv_blocks, t.block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(self.mtp, num_kv_blocks, t.block_size, t.kv_cache_spec)
        self.seqs: dict[str, _MTPSeq] = {}

    def drop(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            seq = self.seqs.pop(rid, None)
            if seq is not None:
                self.kv.free(seq.slots)

    @torch.inference_mode()
    def observe(self, hidden_states: dict[str, HiddenRows]) -> None:
        """Run the layer over the step's new rows of every request; the last row's output is where the
        request's next guesses start."""
        rows: list[tuple[_MTPSeq, HiddenRows]] = []
        for rid, h in hidden_states.items():
            seq = self._place(rid, h)
            if seq is not None:
                rows.append((seq, h))
        if not rows:
            return
        rows.sort(key=lambda r: len(r[1].next_token_ids) > 1)  # single rows first: the batch's decodes
        order = [self._scheduled(seq, h.next_token_ids) for seq, h in rows]
        previous = torch.cat([h.states for _, h in rows])
        out, starts = self._forward(order, previous)
        last = torch.tensor([s + len(h.next_token_ids) - 1 for s, (_, h) in zip(starts, rows)])
        states = out[last]
        guesses = self.mtp.compute_logits(states, self.head).argmax(dim=-1).tolist()
        for i, ((seq, h), g) in enumerate(zip(rows, guesses)):
            seq.computed += len(h.next_token_ids)
            seq.slots.num_computed_tokens = seq.computed
            seq.state, seq.guess = states[i : i + 1], g

    @torch.inference_mode()
    def propose(self, batch: list[DraftRequest]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in batch]
        going: list[tuple[int, _MTPSeq]] = []
        for i, r in enumerate(batch):
            seq = self.seqs.get(r.request_id)
            # caught up: the layer has seen every position whose next token is known
            if seq is None or seq.guess is None or seq.base + seq.computed != len(r.token_ids) - 1:
                continue
            drafts[i].append(seq.guess)
            if r.max_drafts > 1 and self.kv.allocate_slots(seq.slots, r.max_drafts - 1):
                going.append((i, seq))
        # the rest: the layer on its own output, one row per request and guess
        states = torch.cat([seq.state for _, seq in going]) if going else None
        step = 0
        while going:
            order = [ScheduledRequest(seq.slots.request_id, [drafts[i][-1]], seq.computed + step,
                                      self.kv.block_table(seq.slots.request_id), True, _GREEDY, [], [])
                     for i, seq in going]  # fmt: skip
            out, _ = self._forward(order, states)
            guesses = self.mtp.compute_logits(out, self.head).argmax(dim=-1).tolist()
            step += 1
            keep = []
            for j, ((i, seq), g) in enumerate(zip(going, guesses)):
                drafts[i].append(g)
                if len(drafts[i]) < batch[i].max_drafts:
                    keep.append(j)
            going = [going[j] for j in keep]
            states = out[torch.tensor(keep, dtype=torch.int64)] if keep else None
        return drafts

    def _place(self, rid: str, h: HiddenRows) -> _MTPSeq | None:
        """The request's sequence ready to take rows from `h.first_position` on, slots allocated: rolled
        back past its own guesses (or a preemption's recompute), restarted where the rows do not follow
        what it holds; None when the pool cannot take them (the request is not guessed for, for now)."""
        seq = self.seqs.get(rid)
        local = None if seq is None else h.first_position - seq.base
        if seq is None or local < 0 or local > seq.computed:
            self.drop([rid])
            seq = self.seqs[rid] = _MTPSeq(Request(rid, [], _GREEDY, 1, set()), h.first_position)
            local = 0
        seq.computed = local
        seq.slots.num_computed_tokens = local
        seq.state = seq.guess = None
        self.kv.trim(seq.slots, local)
        if not self.kv.allocate_slots(seq.slots, len(h.next_token_ids)):
            self.drop([rid])
            return None
        return seq

    def _scheduled(self, seq: _MTPSeq, token_ids: list[int]) -> ScheduledRequest:
        rid = seq.slots.request_id
        return ScheduledRequest(rid, token_ids, seq.computed, self.kv.block_table(rid), True, _GREEDY, [], [])

    def _forward(
        self, order: list[ScheduledRequest], previous: torch.Tensor
    ) -> tuple[torch.Tensor, list[int]]:
        """The layer's outputs for `order`'s rows (single-token sequences first), each continuing its row of
        `previous`; and each sequence's first row."""
        input_ids, positions, meta, starts = self.runner.prepare_inputs(order)
        with set_forward_context(meta):
            return self.mtp(input_ids, positions, previous, self.embed), starts

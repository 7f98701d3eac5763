"""A draft model: a smaller model of the target's vocabulary (or the target's own quantized file) runs in
the engine's process with its own paged KV cache, and guesses k tokens greedily, one batched forward
pass per token for every speculating request.

Its cache follows each request's tokens: what it computed for drafts the target accepted stays (those
drafts are now the request's tokens); what it computed past the first rejected draft is rolled back
(its blocks given back), and the next pass computes the tokens it has not seen (the target's own token,
or several after a preemption) as one chunk before the first guess. A request that stops speculating
(finished, preempted, not caught up) loses its draft cache and catches up in one chunk when it returns.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from perfxlm.engine.kv_cache_manager import KVCacheManager
from perfxlm.engine.messages import ScheduledRequest, SchedulerOutput
from perfxlm.engine.request import Request
from perfxlm.model.loader import load_model
from perfxlm.sampling_params import SamplingParams
from perfxlm.spec_decode.proposer import DraftRequest, Proposer
from perfxlm.worker.model_runner import ModelRunner

_GREEDY = SamplingParams(temperature=0, max_tokens=1)
# New tokens of a catch-up pass up to which they run as decode rows of the draft's step (draft_model's
# _catch_up): as many as a verification step of 16 guesses has rows; longer chunks (a new prompt, a
# request back from preemption) prefill.
CATCH_UP_ROWS = 17


@dataclass
class _DraftSeq:
    slots: Request  # the request as the draft's KV manager sees it (id, computed tokens)
    computed: list[int] = field(default_factory=list)  # the tokens whose K/V the draft's cache holds
    known: int = 0  # leading entries of `computed` known to be the request's own tokens


class DraftModelProposer(Proposer):
    name = "draft_model"
    weighs_its_cost = True

    def __init__(self, spec: Any, target_config: Any, num_kv_blocks: int) -> None:
        from perfxlm.config import EngineConfig

        t = target_config
        config = EngineConfig(model=spec.model, dtype=t.dtype, quantization=spec.quantization, seed=t.seed,
                              block_size=t.block_size, enable_prefix_caching=False).resolve()  # fmt: skip
        self.config = config
        self.model = load_model(config)
        # as many blocks as the target's pool: the draft follows the same tokens, in fewer bytes each
        self.kv = KVCacheManager(num_kv_blocks, t.block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(self.model, num_kv_blocks, t.block_size, config.kv_cache_spec)
        self.max_len = config.max_model_len
        self.seqs: dict[str, _DraftSeq] = {}

    def drop(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            seq = self.seqs.pop(rid, None)
            if seq is not None:
                self.kv.free(seq.slots)

    def propose(self, batch: list[DraftRequest]) -> list[list[int]]:
        live = {r.request_id for r in batch}
        self.drop([rid for rid in self.seqs if rid not in live])
        drafts: list[list[int]] = [[] for _ in batch]
        first: list[ScheduledRequest] = []
        going: list[int] = []  # indices into batch still drafting
        for i, r in enumerate(batch):
            sr = self._catch_up(r)
            if sr is not None:
                first.append(sr)
                going.append(i)
        scheduled = first
        while scheduled:
            sampled = self.runner.execute(SchedulerOutput(scheduled, sum(len(s.token_ids) for s in scheduled)))
            nxt, still = [], []
            for i, sr in zip(going, scheduled):
                r, seq = batch[i], self.seqs[batch[i].request_id]
                seq.computed.extend(sr.token_ids)
                seq.slots.num_computed_tokens = len(seq.computed)
                token = sampled.sampled_token_ids[r.request_id]
                drafts[i].append(token)
                if len(drafts[i]) < r.max_drafts:
                    nxt.append(self._scheduled(r.request_id, [token], seq))
                    still.append(i)
            scheduled, going = nxt, still
        return drafts

    def _catch_up(self, r: DraftRequest) -> ScheduledRequest | None:
        """The request's first draft pass: the tokens the draft's cache lacks (at least the last one), with
        slots allocated for every pass of this step; None when the draft cannot take it this step."""
        tokens = r.token_ids
        total = len(tokens)
        if total + r.max_drafts > self.max_len:
            self.drop([r.request_id])
            return None
        seq = self.seqs.get(r.request_id)
        if seq is None:
            seq = self.seqs[r.request_id] = _DraftSeq(Request(r.request_id, [], _GREEDY, 1, set()))
        # the cache's own guesses stay where the request accepted them
        valid = seq.known
        while valid < len(seq.computed) and valid < total - 1 and seq.computed[valid] == tokens[valid]:
            valid += 1
        if valid < len(seq.computed):
            del seq.computed[valid:]
            seq.slots.num_computed_tokens = valid
            self.kv.trim(seq.slots, valid)
        seq.known = valid
        if not self.kv.allocate_slots(seq.slots, total - valid + r.max_drafts - 1):
            self.drop([r.request_id])  # the draft's pool is full: this request decodes plainly for now
            return None
        seq.known = total  # after this pass the cache holds all of the request's tokens
        chunk = list(tokens[valid:total])
        # After all of the last guesses were accepted the cache lacks the last guess and the target's token:
        # a few tokens after the whole context run as decode rows (a 2-token prefill chunk packed the
        # context's keys again: ~3.5x a one-row pass on the default model at ~500 tokens).
        rows = 1 < len(chunk) <= CATCH_UP_ROWS and valid > 0
        return self._scheduled(r.request_id, chunk, seq, decode_rows=rows)

    def _scheduled(self, rid: str, token_ids: list[int], seq: _DraftSeq, decode_rows: bool = False) -> ScheduledRequest:
        return ScheduledRequest(rid, token_ids, len(seq.computed), self.kv.block_table(rid), True, _GREEDY, [], [],
                                decode_rows=decode_rows)  # fmt: skip

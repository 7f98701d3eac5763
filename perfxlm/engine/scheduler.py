"""The scheduler: decides, each step, which tokens of which requests go into the one flattened batch.

Each step hands out a token budget (max_num_batched_tokens):

1. Running requests first, oldest first. Each gets the tokens it still has to compute: one for
   a decode, the rest of its prompt for a chunked prefill, capped by the budget. When the KV
   pool cannot hold them, the newest running request is preempted: its blocks are freed and it
   goes back to the front of the waiting queue, to be recomputed later (its prefix may still be
   cached).
2. Then, if nobody was preempted, waiting requests, oldest first, while budget, seats
   (max_num_seqs) and blocks last: prefix-cache hits are skipped, the rest is scheduled,
   chunked when it exceeds the budget.
3. update_from_output() appends sampled tokens, applies EOS / stop ids / max_tokens, and frees
   the blocks of finished requests. A request with n > 1 / best_of forks its siblings at its first
   sample: they share its prompt blocks (the last partial block is copied), so the prompt is
   prefilled once.

4. Speculative decoding: a decoding request may carry draft tokens (set by set_draft_tokens after the
   previous step) behind its input token, within the budget and never past max_tokens; when their
   slots do not fit it decodes plainly. update_from_output counts only the accepted tokens as computed,
   trims the blocks past them, and appends the accepted tokens through the stop checks one by one.

The scheduler assigns tokens per request, never phases: prefill chunks, prefix hits and decodes
share one path. It is the only code that changes a request's status or num_computed_tokens.
"""

from __future__ import annotations

import time
from collections import deque

from perfxlm.engine.kv_cache_manager import KVCacheManager
from perfxlm.engine.messages import EngineCoreOutput, ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from perfxlm.engine.request import Request, RequestStatus
from perfxlm.sampling_params import SamplingParams
from perfxlm.spec_decode.proposer import DraftRequest
from perfxlm.spec_decode.stats import SpecDecodeStats


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        max_loras: int | None = None,
    ) -> None:
        self.kv = kv_cache_manager
        self.max_loras = max_loras  # distinct LoRA adapters one step may hold (the runner's slots)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished_request_ids: set[str] = set()
        self.blocks_to_copy: list[tuple[int, int]] = []
        self.num_preemptions_total = 0
        self.num_prompt_tokens_computed = 0  # prefill work done, in tokens (recomputation included)
        self.spec_stats = SpecDecodeStats()

    # ---- queue management ----------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use.")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def finish_requests(self, request_ids: list[str], status: RequestStatus, stop_reason: str | None = None) -> None:
        """Finish requests from outside the step (abort, stop string). Unknown ids are ignored."""
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.status.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.stop_reason = stop_reason
            request.fork_children = []  # unborn siblings die with it
            self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.free(request)
        self.finished_request_ids.add(request.request_id)
        del self.requests[request.request_id]

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        num_preemptions = 0
        now = time.time()

        loras: set[str] = set()  # adapters (cache keys) in this step
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if not self._lora_fits(request, loras):  # waits for a step its adapter has a slot in
                i += 1
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            drafts = self._drafts(request, num_new, budget)
            if drafts and not self.kv.allocate_slots(request, num_new + len(drafts)):
                drafts = []  # no room for the guesses: a plain decode (allocation is all or nothing)
            while not drafts and not self.kv.allocate_slots(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                num_preemptions += 1
                if victim is request:
                    break
            else:
                scheduled.append(self._scheduled(request, num_new, drafts))
                budget -= num_new + len(drafts)
                i += 1
                continue
            break  # the request preempted itself: nothing after it can run either

        skipped: list[Request] = []  # waiting requests whose adapter has no slot this step, kept in order
        while self.waiting and not num_preemptions and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if not self._lora_fits(request, loras):
                skipped.append(self.waiting.popleft())
                continue
            hits, num_hit_tokens = self.kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - request.num_computed_tokens - num_hit_tokens, budget)
            if not self.kv.allocate_slots(request, num_new, hits):
                break
            self.waiting.popleft()
            request.num_computed_tokens += num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))

        self.num_preemptions_total += num_preemptions
        finished, self.finished_request_ids = self.finished_request_ids, set()
        copies, self.blocks_to_copy = self.blocks_to_copy, []
        return SchedulerOutput(
            scheduled=scheduled,
            num_batched_tokens=self.max_num_batched_tokens - budget,
            finished_request_ids=finished,
            num_preemptions=num_preemptions,
            blocks_to_copy=copies,
        )

    def _lora_fits(self, request: Request, loras: set[str]) -> bool:
        """Whether the request's adapter can join the step (and, if so, count it): at most max_loras
        distinct adapters per step, as the runner has that many slots."""
        if request.lora is None:
            return True
        key = request.lora.cache_key
        if key not in loras:
            if self.max_loras is not None and len(loras) >= self.max_loras:
                return False
            loras.add(key)
        return True

    def _drafts(self, request: Request, num_new: int, budget: int) -> list[int]:
        """The request's draft tokens this step may verify: only on a decode, within the budget, and never
        more than could become output before max_tokens or max_model_len (each step also gains one token
        of the target's own)."""
        drafts, request.draft_token_ids = request.draft_token_ids, []  # guesses are good for one step
        if not drafts or num_new != 1:
            return []
        room = min(budget - 1, request.max_tokens - request.num_output_tokens - 1,
                   self.max_model_len - request.num_tokens - 1)  # fmt: skip
        return drafts[: max(room, 0)]

    def _scheduled(self, request: Request, num_new: int, drafts: list[int] | None = None) -> ScheduledRequest:
        start = request.num_computed_tokens
        do_sample = start + num_new == request.num_tokens
        self.num_prompt_tokens_computed += max(0, min(start + num_new, request.num_prompt_tokens) - start)
        tokens = request.all_token_ids[start : start + num_new]
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=tokens + drafts if drafts else tokens,
            num_computed_tokens=start,
            block_ids=self.kv.block_table(request.request_id),
            do_sample=do_sample,
            sampling_params=request.sampling_params,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            fork_children=request.fork_children if do_sample else [],
            lora=request.lora,
            draft_token_ids=drafts or [],
        )

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.draft_token_ids = []
        self.waiting.appendleft(request)

    # ---- after the forward pass ----------------------------------------------------------
    def update_from_output(self, so: SchedulerOutput, mro: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        for sr in so.scheduled:
            request = self.requests.get(sr.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # finished or preempted meanwhile
            if mro.failed and self._failed_in_step(request, sr, mro.failed, outputs):
                continue
            verified = mro.verified_token_ids[sr.request_id] if sr.draft_token_ids else None
            if verified is None:
                request.num_computed_tokens += len(sr.token_ids)
            else:
                # K/V stays valid for the input token and the accepted drafts; the slots of rejected
                # drafts are given back (their blocks freed, nothing of them ever hashed).
                request.num_computed_tokens += len(verified)
                self.kv.trim(request, request.num_computed_tokens)
                self._observe_drafts(request, len(sr.draft_token_ids), len(verified) - 1)
            # Only now is this step's K/V written: its full blocks may serve prefix matches.
            self.kv.cache_blocks(request, request.num_computed_tokens)
            prompt_lps = mro.prompt_logprobs.get(sr.request_id)
            if not sr.do_sample:
                if prompt_lps is not None:
                    outputs.append(self._output(request, [], None, mro, prompt_lps))
                continue
            children = self._fork(request, sr.fork_children) if sr.fork_children else []
            for req in [request, *children]:
                tokens = verified if verified is not None else [mro.sampled_token_ids[req.request_id]]
                status = None
                for n, token in enumerate(tokens, 1):
                    req.append_output_token(token)
                    status = self._check_stop(req, token)
                    if status is not None:
                        tokens = tokens[:n]  # what the target accepted past a stop is not output
                        break
                if status is not None:
                    self._remove(req)
                    self._finish(req, status)
                outputs.append(self._output(req, tokens, status, mro, prompt_lps if req is request else None))
        return outputs

    def _observe_drafts(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        request.num_draft_tokens += num_drafts
        request.num_accepted_tokens += num_accepted
        self.spec_stats.observe(num_drafts, num_accepted)
        request.draft_budget.observe(num_drafts, num_accepted)

    # ---- speculative decoding ------------------------------------------------------------
    def draft_requests(self, max_drafts: int, budget: bool = True) -> list[DraftRequest]:
        """Running requests that decode next step and may carry draft tokens: caught up with their tokens,
        below max_tokens and max_model_len by at least two tokens, not sitting out after guesses that
        missed (with `budget`: each request's DraftBudget bounds its guesses; without, a proposer that
        bounds its own gets up to `max_drafts`). Guided requests speculate too: the runner masks each
        verification row by the grammar."""
        batch = []
        for r in self.running:
            if r.num_tokens - r.num_computed_tokens != 1:
                continue
            allowed = r.draft_budget.take(max_drafts) if budget else max_drafts
            if not allowed:  # sitting out after guesses that missed
                r.draft_token_ids = []
                continue
            room = min(allowed, r.max_tokens - r.num_output_tokens - 1, self.max_model_len - r.num_tokens - 1)
            if room >= 1:
                batch.append(DraftRequest(r.request_id, r.all_token_ids, room))
        return batch

    def set_draft_tokens(self, drafts: dict[str, list[int]]) -> None:
        """The next step's draft tokens by request id (each within its draft_requests max_drafts); every
        other running request has none."""
        for r in self.running:
            r.draft_token_ids = list(drafts.get(r.request_id, ()))

    def _failed_in_step(self, request: Request, sr: ScheduledRequest, failed: dict[str, str],
                        outputs: list[EngineCoreOutput]) -> bool:
        """End a request whose own state failed in the runner (it, or one of its unborn siblings): it and
        its unborn siblings finish as aborted, with the reason; the rest of the batch is untouched."""
        ids = [request.request_id, *(cid for cid, _ in sr.fork_children)] if sr.do_sample else [request.request_id]
        error = next((failed[i] for i in ids if i in failed), None)
        if error is None:
            return False
        request.fork_children = []
        self._remove(request)
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        for rid in ids:
            outputs.append(EngineCoreOutput(rid, [], finish_reason="abort", error=error))
        return True

    def _remove(self, request: Request) -> None:
        self.running.remove(request) if request.status == RequestStatus.RUNNING else self.waiting.remove(request)

    def _output(self, request: Request, tokens: list[int], status: RequestStatus | None, mro: ModelRunnerOutput,
                prompt_lps) -> EngineCoreOutput:
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=tokens,
            finish_reason=status.finish_reason if status is not None else None,
            stop_reason=request.stop_reason,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            first_scheduled_time=request.first_scheduled_time,
            new_logprobs=self._logprobs(request.request_id, tokens, mro),
            new_prompt_logprobs=prompt_lps,
            num_draft_tokens=request.num_draft_tokens,
            num_accepted_tokens=request.num_accepted_tokens,
        )

    @staticmethod
    def _logprobs(request_id: str, tokens: list[int], mro: ModelRunnerOutput) -> list | None:
        if not tokens:
            return None
        verified = mro.verified_logprobs.get(request_id)
        if verified is not None:
            return verified[: len(tokens)]
        lp = mro.logprobs.get(request_id)
        return [lp] if lp is not None else None

    def _fork(self, parent: Request, children: list[tuple[str, SamplingParams]]) -> list[Request]:
        """Siblings of an n > 1 request start where the parent is now: prompt computed, one token to come."""
        parent.fork_children = []
        forked = []
        for child_id, params in children:
            child = Request(child_id, parent.prompt_token_ids, params, parent.max_tokens, parent.eos_token_ids,
                            parent.arrival_time)
            child.num_computed_tokens = parent.num_computed_tokens
            child.cache_salt = parent.cache_salt  # a sibling that recomputes must hash as its tenant
            child.lora = parent.lora
            child.num_cached_tokens = parent.num_cached_tokens
            child.first_scheduled_time = parent.first_scheduled_time
            self.requests[child_id] = child
            # A sibling takes a seat like any request: with every seat taken it waits (and recomputes its
            # prompt, mostly from the prefix cache) instead of exceeding max_num_seqs.
            seated = len(self.running) < self.max_num_seqs
            copy = self.kv.fork(parent, child) if seated else False
            if copy is False:  # no seat, or no block for the copy: recompute later
                child.num_computed_tokens = 0
                child.status = RequestStatus.PREEMPTED
                self.waiting.appendleft(child)
            else:
                if copy is not None:
                    self.blocks_to_copy.append(copy)
                child.status = RequestStatus.RUNNING
                self.running.append(child)
            forked.append(child)
        return forked

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        min_ok = request.num_output_tokens >= request.sampling_params.min_tokens
        if min_ok and token in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if min_ok and token in request.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

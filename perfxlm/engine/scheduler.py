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
   the blocks of finished requests.

The scheduler assigns tokens per request, never phases: prefill chunks, prefix hits and decodes
share one path. It is the only code that changes a request's status or num_computed_tokens.
"""

from __future__ import annotations

import time
from collections import deque

from perfxlm.engine.kv_cache_manager import KVCacheManager
from perfxlm.engine.messages import EngineCoreOutput, ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from perfxlm.engine.request import Request, RequestStatus


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
    ) -> None:
        self.kv = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished_request_ids: set[str] = set()
        self.num_preemptions_total = 0

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

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv.allocate_slots(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                num_preemptions += 1
                if victim is request:
                    break
            else:
                scheduled.append(self._scheduled(request, num_new))
                budget -= num_new
                i += 1
                continue
            break  # the request preempted itself: nothing after it can run either

        while self.waiting and not num_preemptions and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
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

        self.num_preemptions_total += num_preemptions
        finished, self.finished_request_ids = self.finished_request_ids, set()
        return SchedulerOutput(
            scheduled=scheduled,
            num_batched_tokens=self.max_num_batched_tokens - budget,
            finished_request_ids=finished,
            num_preemptions=num_preemptions,
        )

    def _scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start : start + num_new],
            num_computed_tokens=start,
            block_ids=self.kv.block_ids(request.request_id),
            do_sample=start + num_new == request.num_tokens,
            sampling_params=request.sampling_params,
            num_output_tokens=request.num_output_tokens,
        )

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    # ---- after the forward pass ----------------------------------------------------------
    def update_from_output(self, so: SchedulerOutput, mro: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        for sr in so.scheduled:
            request = self.requests.get(sr.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # finished or preempted meanwhile
            request.num_computed_tokens += len(sr.token_ids)
            if not sr.do_sample:
                continue
            token = mro.sampled_token_ids[sr.request_id]
            request.append_output_token(token)
            status = self._check_stop(request, token)
            if status is not None:
                self.running.remove(request)
                self._finish(request, status)
            outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[token],
                    finish_reason=status.finish_reason if status is not None else None,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    first_scheduled_time=request.first_scheduled_time,
                )
            )
        return outputs

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

"""A request as the engine core sees it: token ids, progress through them, and status."""

from __future__ import annotations

import enum
import time
from typing import Any

from perfxlm.sampling_params import SamplingParams
from perfxlm.spec_decode.draft_budget import DraftBudget


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything after this is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH_CAPPED: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
        }.get(self)


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        max_tokens: int,
        eos_token_ids: set[int],
        arrival_time: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens
        self.eos_token_ids = set() if sampling_params.ignore_eos else eos_token_ids
        self.stop_token_ids = set(sampling_params.stop_token_ids or ())
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 until then
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.first_scheduled_time: float | None = None
        # n > 1 / best_of: (request_id, params) of the siblings to fork off at the first sample.
        self.fork_children: list[tuple[str, SamplingParams]] = []
        # vLLM's cache_salt: prefix-cache blocks are shared only between requests with the same salt
        self.cache_salt: str | None = None
        # the adapter it runs with (perfxlm.lora.adapter.LoRAAdapter); its blocks hash apart from others'
        self.lora: Any = None
        # Speculative decoding: the proposer's guesses of the next tokens, consumed by the next schedule,
        # and this request's verified draft tokens so far (RequestOutput.metrics)
        self.draft_token_ids: list[int] = []
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # how many guesses it may carry next step, from how its last ones fared
        self.draft_budget = DraftBudget()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )

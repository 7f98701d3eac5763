"""Every message that crosses a boundary inside the engine. Read this file to learn the engine.

    Scheduler.schedule()            -> SchedulerOutput      (what to compute this step)
    ModelRunner.execute(...)        -> ModelRunnerOutput    (what was sampled)
    Scheduler.update_from_output()  -> list[EngineCoreOutput] (per-request news)
    OutputProcessor.process(...)    -> list[RequestOutput]  (user-facing)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from perfxlm.sampling_params import SamplingParams


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of the flattened token batch."""

    request_id: str
    token_ids: list[int]  # the tokens to compute this step (a prompt chunk, or the last sampled token)
    num_computed_tokens: int  # tokens already in the KV cache; the first new token's position
    block_ids: list[int]  # the request's whole block table after allocation
    do_sample: bool  # True when this step reaches the end of the known tokens
    sampling_params: SamplingParams
    num_output_tokens: int  # tokens generated so far (for min_tokens and penalties)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    # Requests that finished since the last step: the runner drops their per-request state.
    finished_request_ids: set[str] = field(default_factory=set)
    num_preemptions: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class ModelRunnerOutput:
    # request_id -> sampled token id, for every scheduled request with do_sample
    sampled_token_ids: dict[str, int]


@dataclass(slots=True)
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None

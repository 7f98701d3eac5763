"""Every message that crosses a boundary inside the engine. Read this file to learn the engine.

    Scheduler.schedule()            -> SchedulerOutput      (what to compute this step)
    ModelRunner.execute(...)        -> ModelRunnerOutput    (what was sampled)
    Scheduler.update_from_output()  -> list[EngineCoreOutput] (per-request news)
    OutputProcessor.process(...)    -> list[RequestOutput]  (user-facing)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from perfxlm.sampling_params import SamplingParams


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of the flattened token batch."""

    request_id: str
    token_ids: list[int]  # the tokens to compute this step (a prompt chunk, or the last sampled token)
    num_computed_tokens: int  # tokens already in the KV cache; the first new token's position
    block_ids: Sequence[int]  # the request's whole block table after allocation (an int64 array view)
    do_sample: bool  # True when this step reaches the end of the known tokens
    sampling_params: SamplingParams
    prompt_token_ids: list[int]  # read-only views of the request's tokens (penalties, bad words,
    output_token_ids: list[int]  # min_tokens, prompt logprobs)
    # n > 1 / best_of: at the first sample, these children are sampled from the same logits and then
    # forked off this request, sharing its prompt blocks (the prompt is prefilled once).
    fork_children: list[tuple[str, SamplingParams]] = field(default_factory=list)
    # Speculative decoding: guesses of the tokens after token_ids[0], which follow it in token_ids. Each
    # is one more decode row; the runner verifies them and returns the accepted prefix plus one token.
    draft_token_ids: list[int] = field(default_factory=list)
    # Several new tokens computed as decode rows (each seeing the tokens up to itself, as draft tokens are)
    # instead of as a prefill chunk: a few tokens after a long context (a draft model's catch-up), where
    # the prefill kernel would pack the whole context's keys for them. The last row samples as usual.
    decode_rows: bool = False
    lora: Any = None  # the request's adapter (perfxlm.lora.adapter.LoRAAdapter), None for the base model

    @property
    def runs_as_decode_rows(self) -> bool:
        """Whether its tokens run as decode rows (a decode, a verification, a catch-up), not a prefill chunk."""
        return len(self.token_ids) == 1 or bool(self.draft_token_ids) or self.decode_rows


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    # Requests that finished since the last step: the runner drops their per-request state.
    finished_request_ids: set[str] = field(default_factory=set)
    num_preemptions: int = 0
    # (src, dst) KV blocks to copy before the forward pass: the partial last block of a forked prompt.
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


# One position's logprobs: (token ids, logprobs, rank of the first id). The first id is the
# sampled (or, for prompts, the actual) token; the rest are the top-k.
LogprobEntry = tuple[list[int], list[float], int]


@dataclass(slots=True)
class HiddenRows:
    """One request's rows of a step, as its target model left them before the final norm, for the
    positions whose next token is known once the step is done (a prefill chunk's every row; a decode's
    one; a verification's rows up to the last accepted draft). What speculative decoding's `mtp`
    proposer reads; the runner hands them over only when `ModelRunner.keep_hidden_states` is set."""

    first_position: int  # the position of the first row's token
    states: Any  # torch.Tensor [rows, hidden]
    next_token_ids: list[int]  # the token after each row's position (len == rows)


@dataclass(slots=True)
class ModelRunnerOutput:
    # request_id -> sampled token id, for every scheduled request with do_sample (and forked children)
    sampled_token_ids: dict[str, int]
    logprobs: dict[str, LogprobEntry] = field(default_factory=dict)
    # request_id -> (position of the first entry, entries) for prompt tokens covered this step
    prompt_logprobs: dict[str, tuple[int, list[LogprobEntry]]] = field(default_factory=dict)
    # request_id -> why: requests whose own state failed this step (their seed, filters, logprobs); the
    # scheduler ends them as aborted while the rest of the batch goes on.
    failed: dict[str, str] = field(default_factory=dict)
    # Requests scheduled with draft tokens: request_id -> the tokens they gain (the drafts the target
    # accepted, then one token it sampled), and those tokens' logprob entries when asked.
    verified_token_ids: dict[str, list[int]] = field(default_factory=dict)
    verified_logprobs: dict[str, list[LogprobEntry]] = field(default_factory=dict)
    # request_id -> its hidden rows (ModelRunner.keep_hidden_states only)
    hidden_states: dict[str, HiddenRows] = field(default_factory=dict)


@dataclass(slots=True)
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    new_logprobs: list[LogprobEntry] | None = None
    new_prompt_logprobs: tuple[int, list[LogprobEntry]] | None = None
    error: str | None = None  # set when the request failed on its own (finish_reason "abort")
    # speculative decoding: this sequence's draft tokens verified and accepted so far (totals)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

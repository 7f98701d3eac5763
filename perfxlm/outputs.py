"""What a user gets back: RequestOutput / CompletionOutput, with vLLM's fields and meanings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    """One token's log probability, its rank in the distribution (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.time()) of a request's life."""

    arrival_time: float
    last_token_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    time_in_queue: float | None = None
    finished_time: float | None = None
    # speculative decoding, over all of the request's sequences: draft tokens verified and accepted
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Accepted / verified draft tokens; None when no draft was verified."""
        n = self.spec_num_draft_tokens
        return self.spec_num_accepted_tokens / n if n else None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: Any | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id; None for EOS

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: Any | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int | None = None
    lora_request: Any | None = None
    encoder_prompt: str | None = None
    encoder_prompt_token_ids: list[int] | None = None
    kv_transfer_params: dict[str, Any] | None = field(default=None, repr=False)


# ---- the pooling runner's outputs (vLLM's shapes: `LLM.encode/embed/classify/score`) ----------------------


@dataclass
class PoolingOutput:
    """The pooled tensor of one request: [hidden] (or [dimensions]), [num_labels], or [num_tokens, hidden]
    for per-token pooling."""

    data: Any  # torch.Tensor


@dataclass
class PoolingRequestOutput:
    request_id: str
    outputs: Any  # PoolingOutput, or the task's view of it in the subclasses below
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput(PoolingRequestOutput):
    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> "EmbeddingRequestOutput":
        data = out.outputs.data
        return cls(out.request_id, EmbeddingOutput(data.tolist()), out.prompt_token_ids, out.finished)


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput(PoolingRequestOutput):
    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> "ClassificationRequestOutput":
        data = out.outputs.data
        return cls(out.request_id, ClassificationOutput(data.tolist()), out.prompt_token_ids, out.finished)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput(PoolingRequestOutput):
    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> "ScoringRequestOutput":
        data = out.outputs.data
        return cls(out.request_id, ScoringOutput(float(data.reshape(-1)[0])), out.prompt_token_ids, out.finished)

"""PoolingParams with vLLM's field names: what a pooling request (embed, classify, score, encode) asks for."""

from __future__ import annotations

import copy
from dataclasses import dataclass

# vLLM's pooling tasks: what the pooled states become
POOLING_TASKS = ("embed", "classify", "score", "encode", "token_embed", "reward")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class PoolingParams:
    """dimensions: keep the first N values of an embedding (Matryoshka models only), before normalizing.
    normalize: L2-normalize embeddings (None: the model's default, as its sentence-transformers modules
    say). use_activation (vLLM's older names `activation`, `softmax`): softmax (sigmoid for one label)
    over a classifier's logits; None means yes. truncate_prompt_tokens: keep the first N tokens (as the
    tokenizer truncates; -1: the model's window) instead of refusing a longer input. task: set by the
    LLM method that sends the request."""

    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    truncate_prompt_tokens: int | None = None
    task: str | None = None
    activation: bool | None = None  # older vLLM name of use_activation
    softmax: bool | None = None  # older vLLM name of use_activation

    def __post_init__(self) -> None:
        if self.dimensions is not None and (not _is_int(self.dimensions) or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}.")
        for name in ("normalize", "use_activation", "activation", "softmax"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be true, false or None, got {value!r}.")
        if self.use_activation is None:
            self.use_activation = self.activation if self.activation is not None else self.softmax
        t = self.truncate_prompt_tokens
        if t is not None and (not _is_int(t) or (t < 1 and t != -1)):
            raise ValueError(f"truncate_prompt_tokens must be -1 (the model's window) or >= 1, got {t!r}.")
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}.")

    def clone(self) -> "PoolingParams":
        return copy.copy(self)

"""vLLM's prompt and engine-argument shapes, so scripts written for vLLM import and run unchanged."""

from __future__ import annotations

from typing import Any, TypedDict

try:
    from typing import NotRequired
except ImportError:  # Python 3.10
    from typing_extensions import NotRequired


class TextPrompt(TypedDict):
    prompt: str
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    cache_salt: NotRequired[str]


class EngineArgs:
    """vLLM's EngineArgs: the keyword arguments of LLM(...) held as attributes
    (`LLM.from_engine_args(EngineArgs(model=..., max_model_len=...))`)."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.model = model
        for key, value in kwargs.items():
            setattr(self, key, value)

    def as_kwargs(self) -> dict[str, Any]:
        return dict(vars(self))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"


class AsyncEngineArgs(EngineArgs):
    """vLLM's AsyncEngineArgs (`AsyncLLM.from_engine_args(AsyncEngineArgs(model=...))`)."""

"""User input at the edge of the engine: prompts become token ids, and everything is validated
once, here, with errors that say what to fix."""

from __future__ import annotations

from typing import Any, Mapping

from perfxlm.config import EngineConfig
from perfxlm.engine.request import Request
from perfxlm.sampling_params import SamplingParams

PromptType = str | Mapping[str, Any]


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer: Any, num_kv_blocks: int) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = int(config.hf_config.vocab_size)
        self.max_model_len = int(config.max_model_len)
        self.max_pool_tokens = num_kv_blocks * config.block_size

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            text, token_ids = prompt, None
        elif isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
            text, token_ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
        elif isinstance(prompt, Mapping) and "prompt" in prompt:
            text, token_ids = prompt["prompt"], None
        else:
            raise ValueError(
                f"A prompt must be a string, {{'prompt': str}} or {{'prompt_token_ids': [...]}}; got {type(prompt).__name__}."
            )
        if token_ids is None:
            if not isinstance(text, str):
                raise ValueError(f"prompt must be a string, got {type(text).__name__}.")
            if self.tokenizer is None:
                raise ValueError("The tokenizer was not initialised (skip_tokenizer_init=True): pass prompt_token_ids.")
            token_ids = self.tokenizer.encode(text)
        return text, token_ids

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams, arrival_time: float | None = None):
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}.")
        text, token_ids = self.tokenize_prompt(prompt)
        n = len(token_ids)
        if n == 0:
            raise ValueError("The prompt is empty: give at least one token.")
        for t in token_ids:
            if not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt_token_ids holds {t!r}, outside the vocabulary [0, {self.vocab_size}).")
        for t in params.stop_token_ids or ():
            if t >= self.vocab_size:
                raise ValueError(f"stop_token_ids holds {t}, outside the vocabulary [0, {self.vocab_size}).")
        if n >= self.max_model_len:
            raise ValueError(
                f"The prompt has {n} tokens, but max_model_len is {self.max_model_len}: "
                "shorten the prompt or raise max_model_len."
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n
        if n + max_tokens > self.max_model_len:
            raise ValueError(
                f"The prompt ({n} tokens) plus max_tokens ({max_tokens}) is {n + max_tokens} tokens, more than "
                f"max_model_len ({self.max_model_len}): lower max_tokens or shorten the prompt."
            )
        if n + max_tokens > self.max_pool_tokens:
            raise ValueError(
                f"The prompt ({n} tokens) plus max_tokens ({max_tokens}) needs {n + max_tokens} tokens of KV cache, "
                f"more than the whole pool ({self.max_pool_tokens} tokens): lower max_tokens or enlarge the cache "
                "(kv_cache_gib / num_kv_blocks)."
            )
        eos = self.config.eos_token_ids
        if self.tokenizer is not None and getattr(self.tokenizer, "eos_token_id", None) is not None:
            eos = eos | {self.tokenizer.eos_token_id}
        request = Request(request_id, token_ids, params, max_tokens, eos, arrival_time)
        return request, text

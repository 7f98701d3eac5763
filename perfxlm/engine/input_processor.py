"""User input at the edge of the engine: prompts become token ids, and everything is validated
once, here, with errors that say what to fix."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Mapping

from perfxlm.beam_search import check_beam_search
from perfxlm.config import EngineConfig
from perfxlm.engine.request import Request
from perfxlm.resolved_config import ResolvedConfig
from perfxlm.sampling_params import SEED_MAX, SEED_MIN, SamplingParams, _Opaque

PromptType = str | Mapping[str, Any]

# Sibling sequences of an n > 1 / best_of request are named "<request id><SEP><index>" inside the
# engine. No caller id may hold SEP, so a sibling id never equals a caller's id or another's sibling.
SIBLING_SEP = "\x1e"


def sibling_id(request_id: str, index: int) -> str:
    return f"{request_id}{SIBLING_SEP}{index}"


def check_request_id(request_id: Any) -> None:
    if not isinstance(request_id, str):
        raise ValueError(f"request_id must be a string, got {type(request_id).__name__}.")
    if SIBLING_SEP in request_id:
        raise ValueError("request_id must not contain the character U+001E (reserved for sibling sequences).")


def _sibling_seed(seed: int, index: int) -> int:
    """seed + index, wrapped into the signed 64-bit range a generator takes."""
    span = SEED_MAX - SEED_MIN + 1
    return (seed + index - SEED_MIN) % span + SEED_MIN


class InputProcessor:
    def __init__(
        self, config: EngineConfig, resolved: ResolvedConfig, tokenizer: Any, num_kv_blocks: int, loras: Any = None
    ) -> None:
        """`resolved`: the engine core's ResolvedConfig (max_model_len fitted to its KV pool); `loras`: the
        engine's LoRARegistry (enable_lora), else None."""
        self.config = config
        self.loras = loras
        self.tokenizer = tokenizer
        self.vocab_size = int(config.hf_config.vocab_size)
        self.max_model_len = int(resolved.max_model_len)
        self.max_pool_tokens = num_kv_blocks * config.block_size
        self.max_num_seqs = int(config.max_num_seqs)
        self.max_logprobs = self.vocab_size if config.max_logprobs == -1 else int(config.max_logprobs)
        self._grammar_backend = None  # built at the first structured-output request
        self._grammar_lock = threading.Lock()

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

    def process(
        self, request_id: str, prompt: PromptType, params: SamplingParams, arrival_time: float | None = None,
        lora_request: Any = None,
    ) -> ProcessedRequest:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}.")
        check_request_id(request_id)
        self._check_engine_limits(params)
        adapter = self.lora_adapter(lora_request)
        text, token_ids = self.tokenize_prompt(prompt)
        cache_salt = prompt.get("cache_salt") if isinstance(prompt, Mapping) else None
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError("cache_salt must be a non-empty string.")
        if params.truncate_prompt_tokens is not None:
            token_ids = token_ids[-params.truncate_prompt_tokens :]
        n = len(token_ids)
        if n == 0:
            raise ValueError("The prompt is empty: give at least one token.")
        for t in token_ids:
            if not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt_token_ids holds {t!r}, outside the vocabulary [0, {self.vocab_size}).")
        for name in ("stop_token_ids", "allowed_token_ids", "logit_bias"):
            bad = [t for t in (getattr(params, name) or ()) if t >= self.vocab_size]
            if bad:
                raise ValueError(f"{name} holds token id {bad[0]}, outside the vocabulary [0, {self.vocab_size}).")
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
        num_seqs = params.best_of or params.n
        if n + max_tokens > self.max_pool_tokens:
            raise ValueError(
                f"The prompt ({n} tokens) plus max_tokens ({max_tokens}) needs {n + max_tokens} tokens of KV cache, "
                f"more than the whole pool ({self.max_pool_tokens} tokens): lower max_tokens or enlarge the cache "
                "(kv_cache_gib / num_kv_blocks)."
            )
        eos = self.eos_token_ids()
        params = params.clone()
        if params.top_k >= self.vocab_size:
            params.top_k = -1  # keeping the whole vocabulary is no filter; the sampler never sees a huge k
        params.all_stop_token_ids = set(params.stop_token_ids or ()) | (set() if params.ignore_eos else eos)
        if params.bad_words:
            params._bad_words_token_ids = self._tokenize_bad_words(params.bad_words)
        if params.structured_outputs is not None and params._grammar is None:
            params._grammar = self.compile_structured_outputs(params)

        if num_seqs == 1:
            child_ids, child_params = [request_id], [params]
        else:
            child_ids = [sibling_id(request_id, i) for i in range(num_seqs)]
            child_params = []
            for i in range(num_seqs):
                p = params.clone()
                if p.seed is not None:
                    p.seed = _sibling_seed(p.seed, i)  # siblings must differ, and stay reproducible
                child_params.append(p)
        request = Request(child_ids[0], token_ids, child_params[0], max_tokens, eos, arrival_time)
        request.fork_children = list(zip(child_ids[1:], child_params[1:]))
        request.cache_salt = cache_salt
        request.lora = adapter
        return ProcessedRequest(request, text, child_ids, child_params, params)

    def lora_adapter(self, lora_request: Any) -> Any:
        """The loaded adapter a request names (None: the base model), checked before anything else runs."""
        if lora_request is None:
            return None
        if self.loras is None:
            raise ValueError("lora_request: this engine was started without LoRA; pass enable_lora=True "
                             "(and max_loras / max_lora_rank to fit the adapters).")
        return self.loras.get(lora_request)
    def eos_token_ids(self) -> set[int]:
        """The ids that end a request: the model's EOS ids and the tokenizer's."""
        eos = set(self.config.eos_token_ids)
        if self.tokenizer is not None and getattr(self.tokenizer, "eos_token_id", None) is not None:
            eos.add(self.tokenizer.eos_token_id)
        return eos

    def check_beam_search(self, params: Any, prompts_token_ids: list[list[int]]) -> None:
        """BeamSearchParams against this engine's bounds, before any step runs."""
        outside = [t for ids in prompts_token_ids for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if outside:
            raise ValueError(f"prompt_token_ids holds {outside[0]!r}, outside the vocabulary [0, {self.vocab_size}).")
        check_beam_search(params, [len(p) for p in prompts_token_ids], self.max_model_len, self.max_logprobs,
                          self.vocab_size)

    def _check_engine_limits(self, params: SamplingParams) -> None:
        """Bounds that depend on the engine, checked before any per-sibling work (copies, forks)."""
        for name in ("n", "best_of"):
            value = getattr(params, name)
            if value is not None and value > self.max_num_seqs:
                raise ValueError(
                    f"{name} must be at most max_num_seqs ({self.max_num_seqs}), the sequences one step can run; "
                    f"got {value}."
                )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise ValueError(
                    f"{name} must be at most max_logprobs ({self.max_logprobs}), got {value}: "
                    "ask for fewer or raise the engine's max_logprobs."
                )

    def compile_structured_outputs(self, params: SamplingParams) -> _Opaque:
        """The compiled grammar of params.structured_outputs (ValueError naming what cannot compile). process()
        calls it; the server calls it first on a worker thread, so a long compile never holds its event loop."""
        if self.tokenizer is None:
            raise ValueError("structured_outputs need a tokenizer; this engine runs with skip_tokenizer_init=True.")
        with self._grammar_lock:
            if self._grammar_backend is None:
                from perfxlm.structured_output import GrammarBackend

                eos = set(self.config.eos_token_ids)
                if getattr(self.tokenizer, "eos_token_id", None) is not None:
                    eos.add(self.tokenizer.eos_token_id)
                self._grammar_backend = GrammarBackend(self.tokenizer, self.vocab_size, sorted(eos))
        backend = self._grammar_backend
        return _Opaque(backend.compile(params.structured_outputs), backend.reduce)

    def _compile_grammar(self, params: SamplingParams, eos: set[int] | None = None):
        return self.compile_structured_outputs(params).value

    def _tokenize_bad_words(self, words: list[str]) -> list[list[int]]:
        if self.tokenizer is None:
            raise ValueError("bad_words needs a tokenizer; this engine runs with skip_tokenizer_init=True.")
        out: list[list[int]] = []
        for word in words:
            # A word can start a text or follow a space: ban both spellings, as vLLM does.
            for variant in (word, " " + word.lstrip()):
                ids = self.tokenizer.encode(variant, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out


@dataclass(slots=True)
class ProcessedRequest:
    request: Request  # the first sequence; its fork_children carry the siblings
    prompt: str | None
    child_ids: list[str]
    child_params: list[SamplingParams]
    params: SamplingParams

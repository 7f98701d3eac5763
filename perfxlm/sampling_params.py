"""SamplingParams with vLLM's field names, defaults and validation."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, fields
from enum import IntEnum

_SAMPLING_EPS = 1e-5
# vLLM's API bounds a seed to a signed 64-bit integer (torch's generator seed); -1 means random.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class RequestOutputKind(IntEnum):
    CUMULATIVE = 0  # every output holds everything generated so far
    DELTA = 1  # every output holds only what is new since the last one
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass
class StructuredOutputsParams:
    """vLLM's structured outputs: exactly one of json (a JSON schema, as a dict or a string), regex,
    choice, grammar (EBNF / GBNF) or json_object (any JSON object) constrains what the request
    generates. The token mask comes from the grammar engine (`perfxlm/structured_output`)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False  # one grammar engine, nothing to fall back to: accepted
    disable_any_whitespace: bool = False  # JSON without whitespace between tokens
    disable_additional_properties: bool = False  # objects without additionalProperties are closed
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        kinds = [k for k in ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
                 if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, json_object "
                f"or structural_tag; got {', '.join(kinds) if kinds else 'none'}."
            )
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (dict or string), got {self.json!r}.")
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError(f"structured_outputs.regex must be a string, got {self.regex!r}.")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise ValueError(f"structured_outputs.grammar must be a string, got {self.grammar!r}.")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or any(not isinstance(c, str) for c in self.choice)):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}.")
            self.choice = list(self.choice)
        if self.whitespace_pattern is not None:
            raise ValueError("structured_outputs.whitespace_pattern is not supported by this engine's grammar "
                             "backend; use disable_any_whitespace=True for compact JSON.")
        if self.structural_tag is not None:
            raise ValueError("structured_outputs.structural_tag is not supported; use json, regex or grammar.")

    @property
    def kind(self) -> str:
        # The test __post_init__ counts with: an empty regex or schema ({}) is a constraint too, and a
        # truthiness test would find no kind (StopIteration, which hangs a caller awaiting a thread).
        return next(k for k in ("json", "regex", "choice", "grammar", "json_object")
                    if getattr(self, k) not in (None, False))


# vLLM's earlier name for the same parameters.
GuidedDecodingParams = StructuredOutputsParams


class _Opaque:
    """Holds an engine object (a compiled grammar) that params clones share instead of copying; it
    pickles (to tensor-parallel workers) through `reducer`, which returns (function, args) to rebuild it."""

    __slots__ = ("value", "reducer")

    def __init__(self, value: object, reducer=None) -> None:
        self.value = value
        self.reducer = reducer

    def __deepcopy__(self, memo: dict) -> "_Opaque":
        return self

    def __reduce__(self):
        if self.reducer is None:
            raise TypeError(f"{type(self.value).__name__} cannot be pickled")
        return _restore_opaque, self.reducer(self.value)


def _restore_opaque(fn, args) -> _Opaque:
    return _Opaque(fn(*args))


class SamplingType(IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass
class SamplingParams:
    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None  # vLLM's earlier name for structured_outputs
    extra_args: dict | None = None
    # Filled in by the engine (EOS of the model plus stop_token_ids), as vLLM does.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)
    # bad_words tokenized by the engine (each word with and without a leading space).
    _bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)
    # The compiled grammar of structured_outputs, set by the engine (shared by clones and siblings).
    _grammar: _Opaque | None = field(default=None, repr=False)
    # A reasoning model's end-of-thinking token: the grammar constrains only what follows it (the server
    # sets it under --reasoning-parser, as vLLM lets such models think before the structured answer).
    _grammar_start_token: int | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}.")
        if not isinstance(self.stop_token_ids, (list, tuple, set, type(None))):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}.")
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.all_stop_token_ids = set(self.stop_token_ids)
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise ValueError("Give structured_outputs or guided_decoding (its earlier name), not both.")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(
                f"structured_outputs must be a StructuredOutputsParams, got {type(self.structured_outputs).__name__}."
            )
        if self.seed == -1 and _is_int(self.seed):
            self.seed = None  # vLLM and llama.cpp: -1 asks for a random seed
        for name in ("n", "top_k", "min_tokens"):
            if not _is_int(getattr(self, name)):
                raise ValueError(f"{name} must be an integer, got {getattr(self, name)!r}.")
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "min_p"):
            if not _is_number(getattr(self, name)):
                raise ValueError(f"{name} must be a number, got {getattr(self, name)!r}.")
        if 0 < self.temperature < _SAMPLING_EPS:
            # Tiny temperatures overflow the softmax; treat them as greedy like vLLM.
            self.temperature = 0.0
        if self.top_k == 0:
            self.top_k = -1
        self._verify()
        if self.temperature < _SAMPLING_EPS:
            # Greedy: the filters do nothing, so normalise them (as vLLM does).
            self.top_p, self.top_k, self.min_p = 1.0, -1, 0.0

    def _verify(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}, got {getattr(self, name)!r}.")

        if self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if self.best_of is not None and (not _is_int(self.best_of) or self.best_of < self.n):
            raise bad("best_of", f"must be an integer >= n ({self.n})")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty < math.inf:
            raise bad("repetition_penalty", "must be a finite number > 0")
        if not 0.0 <= self.temperature < math.inf:
            raise bad("temperature", "must be a finite number >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k < -1:
            raise bad("top_k", "must be -1 or 0 (disable) or at least 1")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.seed is not None and (not _is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise bad("seed", f"must be None, -1 (random) or an integer in [{SEED_MIN}, {SEED_MAX}]")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1")
        if self.min_tokens < 0:
            raise bad("min_tokens", "must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must hold non-empty strings")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must hold non-negative integers")
        # The upper bound is the engine's max_logprobs, checked where the request enters the engine.
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise bad("logprobs", "must be an integer >= 0")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs) or self.prompt_logprobs < 0):
            raise bad("prompt_logprobs", "must be an integer >= 0")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", "must be a dict {token_id: bias}")
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise bad("logit_bias", "must map integer token ids to numbers") from None
            if any(not -100.0 <= v <= 100.0 for v in self.logit_bias.values()):  # NaN fails too
                raise bad("logit_bias", "values must be in [-100, 100]")
            if any(k < 0 for k in self.logit_bias):
                raise bad("logit_bias", "keys must be non-negative token ids")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids or any(not _is_int(t) or t < 0 for t in self.allowed_token_ids):
                raise bad("allowed_token_ids", "must be a non-empty list of non-negative token ids")
        if self.bad_words is not None and any(not isinstance(w, str) or not w for w in self.bad_words):
            raise bad("bad_words", "must hold non-empty strings")
        if self.truncate_prompt_tokens is not None and (
            not _is_int(self.truncate_prompt_tokens) or self.truncate_prompt_tokens < 1
        ):
            raise bad("truncate_prompt_tokens", "must be an integer >= 1")
        if not isinstance(self.output_kind, RequestOutputKind):
            try:
                self.output_kind = RequestOutputKind(self.output_kind)
            except ValueError:
                raise bad("output_kind", "must be a RequestOutputKind") from None

    @property
    def needs_sampled_logprob(self) -> bool:
        """best_of ranks completions by cumulative logprob, so it needs them even unasked."""
        return self.logprobs is not None or (self.best_of or self.n) > self.n

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        return SamplingType.RANDOM_SEED if self.seed is not None else SamplingType.RANDOM

    def clone(self) -> "SamplingParams":
        return copy.deepcopy(self)

    def __repr__(self) -> str:
        shown = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.repr)
        return f"SamplingParams({shown})"


@dataclass
class BeamSearchParams:
    """vLLM's beam search parameters (`LLM.beam_search`, `use_beam_search` over the server): keep the
    beam_width most likely continuations, ranked by cumulative logprob / (total length ** length_penalty),
    for up to max_tokens steps (perfxlm/beam_search.py)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if not _is_int(self.beam_width) or self.beam_width < 1:
            raise ValueError(f"beam_width must be an integer >= 1, got {self.beam_width!r}.")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}.")
        if not _is_number(self.temperature) or not 0.0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}.")
        if not _is_number(self.length_penalty) or not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}.")

"""Request schemas of the OpenAI API (plus vLLM's extra sampling fields).

Unknown top-level fields of a request follow vLLM: accepted, logged once per field name, ignored, so
clients that send `store`, `metadata`, `reasoning_effort` or llama.cpp's `cache_prompt` keep working.
Fields that would change the result and are not supported (REFUSED_FIELDS) are a 400 naming them and
what to use instead; nested objects stay strict."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


def _check_utf8(value: Any) -> None:
    """JSON may carry lone surrogates ("\\ud800") that no tokenizer can encode: refuse them as bad input."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"text is not valid Unicode (a lone surrogate at position {exc.start})") from None
    elif isinstance(value, dict):
        for v in value.values():
            _check_utf8(v)
    elif isinstance(value, list):
        for v in value:
            _check_utf8(v)


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        _check_utf8(data)
        return data


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


# fields that change what is generated, which perfxlm does not support: refused instead of ignored
REFUSED_FIELDS = {
    "logits_processors": "custom logits processors are not supported; use logit_bias, allowed_token_ids, "
                         "bad_words or structured outputs",
    "functions": "the legacy functions field is not supported; use tools",
    "function_call": "the legacy function_call field is not supported; use tool_choice",
    "prompt_embeds": "prompt embeddings are not supported; send text or token ids",
    "mm_processor_kwargs": "multimodal input is not supported",
    "documents": "documents are not passed to chat templates; put them in the messages",
    "return_tokens_as_token_ids": "return_tokens_as_token_ids is not supported",
    "n_predict": "use max_tokens",
    "typical_p": "typical sampling is not supported; use top_p, top_k or min_p",
    "tfs_z": "tail-free sampling is not supported; use top_p, top_k or min_p",
    "mirostat": "mirostat sampling is not supported; use top_p, top_k or min_p",
    "dynatemp_range": "dynamic temperature is not supported; use temperature",
    "xtc_probability": "XTC sampling is not supported",
    "dry_multiplier": "DRY sampling is not supported; use repetition_penalty or frequency_penalty",
}


class RequestModel(StrictModel):
    """A top-level request body: unknown fields are kept aside (model_extra) for the server to log."""

    model_config = ConfigDict(extra="allow")


class SamplingFields(RequestModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    user: str | None = None  # an end-user identifier; recorded nowhere
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    best_of: int | None = None
    use_beam_search: bool = False  # n beams (BeamSearchParams.beam_width), ranked with length_penalty
    length_penalty: float = 1.0
    cache_salt: str | None = None  # prefix-cache blocks are shared only among requests with the same salt
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs (and its earlier guided_*
    # fields), llama-server's json_schema and grammar
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    json_schema: dict[str, Any] | None = None
    grammar: str | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    prompt_logprobs: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ... are passed to the template
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM extensions
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class ResponsesRequest(SamplingFields):
    """POST /v1/responses: OpenAI's fields; vLLM's extra sampling fields as on chat completions."""

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    store: bool = True
    reasoning: dict[str, Any] | None = None  # {"effort", "summary"}: the parser decides what is thinking
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    metadata: dict[str, str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    background: bool = False
    # vLLM extensions, as on chat completions
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(RequestModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]

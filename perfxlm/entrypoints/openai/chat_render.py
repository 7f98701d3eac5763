"""Chat templates and tokenization for the server, off the HTTP event loop.

Rendering a template and tokenizing a long prompt are CPU work of unbounded length as far as the
event loop is concerned: they run in a small thread pool, so streams and /health keep answering.

A template sent with a request is refused unless the operator started the server with
`--trust-request-chat-template` (vLLM's flag); a trusted one still renders in a bounded sandbox
(`template_sandbox.py`). The model's own template renders through transformers, and its output is
held to the same length limit.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from perfxlm.entrypoints.openai.errors import APIError
from perfxlm.entrypoints.openai.off_loop import run_off_loop
from perfxlm.entrypoints.openai.template_sandbox import render_bounded

DEFAULT_MAX_RENDERED_CHARS = 4 << 20  # the default request body limit: a prompt need not be longer
DEFAULT_TEMPLATE_TIMEOUT_S = 2.0

# apply_chat_template's own parameters: chat_template_kwargs may only add template variables
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "chat_template", "conversation", "messages", "tools", "documents", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs",
})


class ChatRenderer:
    def __init__(
        self,
        tokenizer: Any,
        trust_request_chat_template: bool = False,
        max_rendered_chars: int = DEFAULT_MAX_RENDERED_CHARS,
        template_timeout_s: float = DEFAULT_TEMPLATE_TIMEOUT_S,
        max_workers: int = 2,
    ) -> None:
        self.tokenizer = tokenizer
        self.trust_request_chat_template = trust_request_chat_template
        self.max_rendered_chars = max_rendered_chars
        self.template_timeout_s = template_timeout_s
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="perfxlm-render")
        # request templates get a thread of their own: slow ones (up to the time limit each) then only
        # queue behind each other, never in front of the model's template or tokenization
        self._request_template_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="perfxlm-template")

    async def off_loop(self, fn, *args, pool: ThreadPoolExecutor | None = None, **kwargs):
        """fn(*args, **kwargs) on the render threads (or `pool`), awaited."""
        return await run_off_loop(fn, *args, executor=pool or self._pool, **kwargs)

    async def render(
        self, messages: list[dict], add_generation_prompt: bool = True, chat_template: str | None = None,
        continue_final_message: bool = False, template_kwargs: dict | None = None, tools: list[dict] | None = None,
    ) -> dict:
        """{"prompt": text, "prompt_token_ids": ids} for a conversation; APIError(400) for bad input."""
        self._check(chat_template, template_kwargs)
        pool = self._request_template_pool if chat_template is not None else self._pool
        return await self.off_loop(self.render_sync, messages, add_generation_prompt, chat_template,
                                    continue_final_message, template_kwargs, tools, pool=pool)

    async def dumps(self, obj: Any) -> str:
        """JSON text of a response, serialized in the render threads: a long prompt's id list takes
        FastAPI's encoder about a second on a small machine, time the event loop would not answer in."""
        return await self.off_loop(json.dumps, obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise APIError(400, "This server has no tokenizer.")
        return await self.off_loop(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)

    async def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            raise APIError(400, "This server has no tokenizer.")
        return await self.off_loop(self.tokenizer.decode, token_ids)

    def _check(self, chat_template: str | None, template_kwargs: dict | None) -> None:
        if self.tokenizer is None:
            raise APIError(400, "This server has no tokenizer, so it cannot apply a chat template.",
                           "messages")
        if chat_template is not None and not self.trust_request_chat_template:
            raise APIError(400, "A chat template was sent with the request, but this server does not run "
                                "request templates (start it with --trust-request-chat-template to allow them).",
                           "chat_template")
        reserved = sorted(_RESERVED_TEMPLATE_KWARGS & set(template_kwargs or ()))
        if reserved:
            raise APIError(400, f"chat_template_kwargs may not set {', '.join(reserved)}.",
                           "chat_template_kwargs")

    def render_sync(
        self, messages: list[dict], add_generation_prompt: bool = True, chat_template: str | None = None,
        continue_final_message: bool = False, template_kwargs: dict | None = None, tools: list[dict] | None = None,
    ) -> dict:
        self._check(chat_template, template_kwargs)
        tok = self.tokenizer
        generation_prompt = add_generation_prompt and not continue_final_message
        try:
            if chat_template is None:
                text = tok.apply_chat_template(
                    messages, tools=tools or None, tokenize=False, add_generation_prompt=generation_prompt,
                    continue_final_message=continue_final_message, **(template_kwargs or {}))
            else:
                text = render_bounded(
                    chat_template, messages, add_generation_prompt=generation_prompt,
                    continue_final_message=continue_final_message, special_tokens=_special_tokens(tok),
                    template_kwargs={**(template_kwargs or {}), **({"tools": tools} if tools else {})},
                    max_chars=self.max_rendered_chars,
                    timeout_s=self.template_timeout_s)
        except APIError:
            raise
        except Exception as exc:  # noqa: BLE001 - template errors are the caller's input (raise_exception())
            raise APIError(400, f"Could not apply the chat template: {exc}", "messages") from None
        if not isinstance(text, str):
            raise APIError(400, "The chat template did not render to text.", "messages")
        if len(text) > self.max_rendered_chars:
            raise APIError(400, f"The rendered prompt has {len(text)} characters, more than the limit of "
                                f"{self.max_rendered_chars}.", "messages")
        return {"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)}

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._request_template_pool.shutdown(wait=False, cancel_futures=True)


def _special_tokens(tok: Any) -> dict[str, Any]:
    """The special tokens transformers passes to every template (bos_token, eos_token, ...)."""
    return {k: v for k, v in getattr(tok, "special_tokens_map", {}).items() if isinstance(v, str)}

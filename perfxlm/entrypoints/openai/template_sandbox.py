"""Rendering a chat template that came with a request, with a bound on the work it can do.

Only used when the operator passed `--trust-request-chat-template`; even then a template is code
from the network, so it runs in a Jinja sandbox (as transformers renders templates) with limits:

- time: a trace function on the rendering thread stops the render past `timeout_s` (catches loops
  that print nothing, which an output limit would not);
- size: `*`, `**` and `+` refuse results past `max_chars`, calls and filters refuse integer arguments
  past `MAX_INT_ARG` (`"a".ljust(10**9)`, `range(10**9)`), every local of the template is checked
  at each line (growth by `~` is at most a doubling per line), and the output stops at `max_chars`.

The variables are the ones transformers passes (messages, add_generation_prompt, the special tokens,
tools/documents as None, chat_template_kwargs), so a template renders as `apply_chat_template` would.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_INT_ARG = 1 << 16
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class TemplateLimitError(TemplateError):
    """The template exceeded its time or size budget."""


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict)) else 0


def _check_ints(args: tuple, kwargs: dict, what: str) -> None:
    for v in (*args, *kwargs.values()):
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_INT_ARG:
            raise TemplateLimitError(f"{what}: integer argument {v} is larger than {MAX_INT_ARG}")


class _GenerationTag(jinja2.ext.Extension):
    """transformers' `{% generation %}` marks assistant text for training masks: rendered as its body."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(["*", "**", "+"])

    def __init__(self, max_chars: int) -> None:
        super().__init__(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag]
        )
        self.max_chars = max_chars
        self.deadline = float("inf")
        self.filters["tojson"] = _tojson
        for name, f in list(self.filters.items()):
            self.filters[name] = self._bounded_filter(name, f)
        self.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)

    def _bounded_filter(self, name: str, f):
        def bounded(*args, **kwargs):
            _check_ints(args[1:], kwargs, f"filter {name}")
            return self._check_result(f(*args, **kwargs), f"filter {name}")

        # keep jinja's pass_context / pass_environment markers
        for attr in ("jinja_pass_arg",):
            if hasattr(f, attr):
                setattr(bounded, attr, getattr(f, attr))
        return bounded

    def _check_result(self, value: Any, what: str) -> Any:
        if _size(value) > self.max_chars:
            raise TemplateLimitError(
                f"{what}: a value of {_size(value)} items exceeds the limit of {self.max_chars}"
            )
        return value

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateLimitError("the chat template took too long to render")

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        self.check_time()
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                if _size(seq) and isinstance(count, int) and _size(seq) * max(count, 0) > self.max_chars:
                    raise TemplateLimitError(
                        f"repeating a value {count} times exceeds the limit of {self.max_chars}"
                    )
        if operator == "**" and isinstance(right, int) and abs(right) > 64 and not isinstance(left, float):
            raise TemplateLimitError(f"the exponent {right} is too large")
        if operator == "+" and _size(left) + _size(right) > self.max_chars:
            raise TemplateLimitError(f"a concatenation exceeds the limit of {self.max_chars}")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's signature
        __self.check_time()
        _check_ints(args, kwargs, "call")
        return __self._check_result(super().call(__context, __obj, *args, **kwargs), "call")

    def getattr(self, obj, attribute):
        self.check_time()
        return super().getattr(obj, attribute)


def _raise_exception(message: str):
    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tracer(env: BoundedEnvironment):
    """Per line of template code: the deadline, and the size of every local (catches `~` doubling)."""

    def local(frame, event, arg):
        if event == "line":
            env.check_time()
            for value in frame.f_locals.values():
                if _size(value) > 2 * env.max_chars:
                    raise TemplateLimitError(f"a template variable exceeds the limit of {env.max_chars}")
        return local

    def global_(frame, event, arg):
        if frame.f_code.co_filename == "<template>":
            return local
        env.check_time()
        return None

    return global_


def render_bounded(
    template: str,
    messages: list[dict],
    *,
    add_generation_prompt: bool,
    continue_final_message: bool,
    special_tokens: dict[str, Any],
    template_kwargs: dict[str, Any] | None,
    max_chars: int,
    timeout_s: float,
) -> str:
    """Render `template` as transformers' apply_chat_template would, within the limits. Raises
    TemplateError (TemplateLimitError past a limit, jinja's SecurityError for sandbox violations)."""
    env = BoundedEnvironment(max_chars)
    env.deadline = time.monotonic() + timeout_s
    messages = [dict(m) for m in messages]
    if continue_final_message:
        if not messages or not isinstance(messages[-1].get("content"), str):
            raise TemplateError("continue_final_message needs a final message with text content")
        final = messages[-1]["content"]
        messages[-1]["content"] = final + _CONTINUE_TAG
    variables = {**special_tokens, **(template_kwargs or {})}
    variables.update(
        messages=messages, tools=None, documents=None, add_generation_prompt=add_generation_prompt
    )
    previous = sys.gettrace()
    sys.settrace(_tracer(env))
    try:
        compiled = env.from_string(template)
        parts: list[str] = []
        total = 0
        for chunk in compiled.generate(**variables):
            total += len(chunk)
            if total > max_chars:
                raise TemplateLimitError(f"the rendered prompt exceeds {max_chars} characters")
            parts.append(chunk)
    except RecursionError:
        raise TemplateLimitError("the chat template recursed too deeply") from None
    finally:
        sys.settrace(previous)
    text = "".join(parts)
    if continue_final_message:
        # as transformers: cut the text after the final message, so the model continues it
        cut = text.rfind(_CONTINUE_TAG.strip())
        if cut < 0:
            raise TemplateError(
                "continue_final_message is set but the final message does not appear in the render"
            )
        text = text[:cut]
    return text


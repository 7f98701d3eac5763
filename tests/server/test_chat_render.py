"""Chat templates and tokenization off the event loop; request templates refused unless trusted, and
bounded when trusted."""

from __future__ import annotations

import asyncio
import time

import pytest

from perfxlm.entrypoints.openai.chat_render import ChatRenderer
from perfxlm.entrypoints.openai.errors import APIError
from tests.conftest import default_model_or_skip

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello"}]

HOSTILE = [
    '{{ "a" * 10**9 }}',
    '{{ "a".ljust(10**9) }}',
    '{{ "a"|center(1000000000) }}',
    '{{ 2 ** 100000000 }}',
    '{{ [1] * 10000000 }}',
    '{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}',
    '{% set x = range(60000)|list %}{% for a in x %}{% for b in x %}{% endfor %}{% endfor %}',
    '{% set a = "a" * 100000 %}{% set b = a ~ a %}{% set c = b ~ b %}{% set d = c ~ c %}{% set e = d ~ d %}'
    '{% set f = e ~ e %}{% set g = f ~ f %}{% set h = g ~ g %}{% set i = h ~ h %}{% set j = i ~ i %}{{ j|length }}',
    '{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}',
    '{% for i in range(50000) %}{{ "x" * 1000 }}{% endfor %}',
    '{{ raise_exception("refused by the template") }}',
    '{{ messages.__class__.__mro__ }}{{ cycler.__init__.__globals__ }}',
    '{% for %}',
]


@pytest.fixture(scope="module")
def tokenizer():
    from perfxlm.tokenizer import get_tokenizer

    return get_tokenizer(default_model_or_skip(), None)


def test_request_template_refused_unless_trusted(tokenizer):
    renderer = ChatRenderer(tokenizer)
    with pytest.raises(APIError, match="trust-request-chat-template") as info:
        renderer.render_sync(MESSAGES, chat_template="{{ messages[0].content }}")
    assert info.value.status == 400 and info.value.param == "chat_template"
    # the model's own template is always fine
    assert renderer.render_sync(MESSAGES)["prompt"] == tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("gen,cont", [(True, False), (False, True), (False, False)])
def test_trusted_request_template_renders_as_transformers(tokenizer, gen, cont):
    renderer = ChatRenderer(tokenizer, trust_request_chat_template=True)
    out = renderer.render_sync(MESSAGES, gen, tokenizer.chat_template, cont)
    ref = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen and not cont,
                                        continue_final_message=cont)
    assert out["prompt"] == ref
    assert out["prompt_token_ids"] == tokenizer.encode(ref, add_special_tokens=False)


@pytest.mark.parametrize("template", HOSTILE)
def test_hostile_templates_fail_fast_with_400(tokenizer, template):
    renderer = ChatRenderer(tokenizer, trust_request_chat_template=True, max_rendered_chars=1 << 20,
                            template_timeout_s=1.0)
    start = time.monotonic()
    with pytest.raises(APIError) as info:
        renderer.render_sync(MESSAGES, chat_template=template)
    assert info.value.status == 400
    assert time.monotonic() - start < 5


def test_template_kwargs_cannot_replace_the_template(tokenizer):
    renderer = ChatRenderer(tokenizer)
    with pytest.raises(APIError, match="chat_template_kwargs"):
        renderer.render_sync(MESSAGES, template_kwargs={"chat_template": "{{ 1 }}"})


def test_event_loop_keeps_running_while_a_template_renders(tokenizer):
    renderer = ChatRenderer(tokenizer, trust_request_chat_template=True, template_timeout_s=1.5)
    slow = '{% for i in range(60000) %}{% for j in range(60000) %}{% endfor %}{% endfor %}'

    async def main() -> float:
        gaps, last = [], time.monotonic()

        async def ticker():
            nonlocal last
            while True:
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        task = asyncio.create_task(ticker())
        with pytest.raises(APIError):
            await renderer.render(MESSAGES, chat_template=slow)
        ids = await renderer.encode("hello " * 20000)
        task.cancel()
        assert len(ids) >= 20000
        return max(gaps)

    # the render holds the GIL in short slices only: the loop keeps ticking
    assert asyncio.run(main()) < 0.5

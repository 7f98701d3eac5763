"""Reasoning models write their thinking between <think> and </think> (vLLM's --reasoning-parser):

- qwen3: the thinking is what lies between <think> and </think> in the output; output without
  </think> is all content (thinking switched off, e.g. chat_template_kwargs enable_thinking=false);
- deepseek_r1: the template opens <think> in the prompt, so the output starts inside the thinking;
  output without </think> is all reasoning (it was cut short).
split() works on the text so far, so streaming sends each new piece to reasoning_content or content.
"""

from __future__ import annotations

START, END = "<think>", "</think>"


class ReasoningParser:
    open_in_prompt = False

    def split(self, text: str, final: bool = True, opened: bool | None = None) -> tuple[str | None, str]:
        """(reasoning, content) of the output so far. While streaming (final=False), a tail that may be
        the start of a tag is held back from both. opened: the prompt ends inside an open <think> (the
        template opened it), which overrides the parser's default."""
        stripped = text.lstrip()
        if not final and stripped and START.startswith(stripped) and stripped != START:
            return None, ""  # maybe the opening tag
        if stripped.startswith(START):
            body, inside = stripped[len(START):], True
        else:
            body, inside = text, self.open_in_prompt if opened is None else opened
        if END in body:
            reasoning, _, content = body.partition(END)
            return reasoning, content.lstrip("\n")
        if not final:
            for k in range(min(len(END) - 1, len(body)), 0, -1):
                if body.endswith(END[:k]):
                    body = body[:-k]
                    break
        return (body, "") if inside else (None, body)


class Qwen3ReasoningParser(ReasoningParser):
    open_in_prompt = False


class DeepSeekR1ReasoningParser(ReasoningParser):
    open_in_prompt = True


REASONING_PARSERS = {"qwen3": Qwen3ReasoningParser, "deepseek_r1": DeepSeekR1ReasoningParser}


def get_reasoning_parser(name: str) -> ReasoningParser:
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        raise ValueError(f"Unknown reasoning parser {name!r}; choose one of {', '.join(REASONING_PARSERS)}.") from None

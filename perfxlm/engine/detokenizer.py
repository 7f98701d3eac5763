"""Incremental detokenization: text grows as tokens arrive, without re-decoding the whole output.

A window of a few earlier tokens is decoded with the new ones so that byte-level pieces and
leading spaces come out right; text ending in U+FFFD (an unfinished UTF-8 sequence) is held
until the next token completes it.
"""

from __future__ import annotations

from typing import Any

_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.special_ids = set(tokenizer.all_special_ids) if skip_special_tokens else set()
        # Start with a little prompt context; its text is never part of the output.
        self.tokens = [t for t in prompt_token_ids[-_CONTEXT_TOKENS:] if t not in self.special_ids]
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_tokens(self, token_ids: list[int]) -> str:
        """Append tokens; return the text they complete (may be empty)."""
        self.tokens.extend(t for t in token_ids if t not in self.special_ids)
        prefix_text = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.tokens[self.prefix_offset :])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.tokens)
            return full_text[len(prefix_text) :]
        return ""

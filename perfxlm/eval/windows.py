"""The text cut into windows the way llama.cpp's `llama-perplexity` cuts it.

The whole text is tokenized once (with the BOS token in front when the model's tokenizer adds one),
then split into consecutive, non-overlapping windows of n_ctx tokens; a tail shorter than a window is
dropped. When the model adds a BOS token, each window's first token is replaced by BOS. Each window is
scored on its second half only: the logits at positions n_ctx/2 .. n_ctx-2 predict the tokens at
n_ctx/2+1 .. n_ctx-1 (llama.cpp's `first = n_ctx/2`, n_ctx - first - 1 tokens per window), so every
scored token has at least n_ctx/2 tokens of context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

MIN_CTX = 3  # a window of n_ctx tokens scores n_ctx - n_ctx // 2 - 1 of them: none below 3


@dataclass(frozen=True)
class Windows:
    tokens: list[int]  # the whole tokenized text
    n_ctx: int
    n_windows: int
    bos_token_id: int | None  # replaces each window's first token; None: windows are left as cut

    @property
    def first(self) -> int:
        """Position of the first logit that is scored (it predicts the token at first + 1)."""
        return self.n_ctx // 2

    @property
    def scored_per_window(self) -> int:
        return self.n_ctx - self.first - 1

    def window(self, i: int) -> list[int]:
        ids = self.tokens[i * self.n_ctx : (i + 1) * self.n_ctx]
        if self.bos_token_id is not None:
            ids[0] = self.bos_token_id
        return ids

    def targets(self, i: int) -> list[int]:
        """The scored tokens of window i, in order: positions first + 1 .. n_ctx - 1."""
        return self.window(i)[self.first + 1 :]


def tokenizer_adds_bos(tokenizer: Any) -> bool:
    """Whether the tokenizer puts BOS in front of a text (llama.cpp's add_bos flag)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    ids = tokenizer.encode("a", add_special_tokens=True)
    return bool(ids) and ids[0] == bos


def tokenize_text(text: str, tokenizer: Any, add_bos: bool) -> list[int]:
    """The text tokenized once, with BOS in front when add_bos (and no other special token)."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("the text is empty: perplexity needs a text to score.")
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if add_bos:
        ids.insert(0, int(tokenizer.bos_token_id))
    return ids


def check_ctx_size(n_ctx: int) -> None:
    if isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or n_ctx < MIN_CTX:
        raise ValueError(
            f"ctx_size must be an integer >= {MIN_CTX} (each window is scored on the tokens after its "
            f"first half), got {n_ctx!r}."
        )


def make_windows(
    tokens: Sequence[int], n_ctx: int, n_chunks: int | None, bos_token_id: int | None
) -> Windows:
    check_ctx_size(n_ctx)
    tokens = [int(t) for t in tokens]
    if not tokens:
        raise ValueError("the text is empty: perplexity needs a text to score.")
    available = len(tokens) // n_ctx
    if available < 1:
        raise ValueError(
            f"the text is too short: it tokenizes to {len(tokens)} tokens, and ctx_size {n_ctx} needs at "
            f"least {n_ctx} (one window). Use a longer text or a smaller ctx_size."
        )
    if n_chunks is not None:
        if isinstance(n_chunks, bool) or not isinstance(n_chunks, int) or n_chunks < 1:
            raise ValueError(f"chunks must be an integer >= 1 (or None for all), got {n_chunks!r}.")
        available = min(available, n_chunks)
    return Windows(tokens=tokens, n_ctx=n_ctx, n_windows=available, bos_token_id=bos_token_id)

"""A causal LM's checkpoint loaded as a sequence classifier whose score head is made of rows of its LM head
(vLLM's online conversion, set through `hf_overrides`):

- `classifier_from_token: ["no", "yes"]` with `method: "from_2_way_softmax"` (what
  `is_original_qwen3_reranker: true` stands for): one label, the "yes" row minus the "no" row, so the
  sigmoid of the score is the softmax of the two tokens' logits at the last position, Qwen3-Reranker's
  relevance, without computing the other 150k logits;
- `method: "no_post_processing"`: one label per token, that token's row (its logit).

The token strings become ids through the tokenizer before the model is built (`resolve`); the model
reads the result from its config and rewrites the weight stream (`score_stream`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch

METHODS = ("from_2_way_softmax", "no_post_processing")
# the config attribute the resolved conversion travels on to the model's constructor
CONFIG_KEY = "perfxlm_classifier_from_tokens"
LM_HEAD = "lm_head.weight"
EMBEDDINGS = "model.embed_tokens.weight"


@dataclass(frozen=True)
class ClassifierFromTokens:
    method: str
    tokens: tuple[str, ...]
    token_ids: tuple[int, ...]

    @property
    def num_labels(self) -> int:
        return 1 if self.method == "from_2_way_softmax" else len(self.token_ids)

    def score_weight(self, lm_head: torch.Tensor) -> torch.Tensor:
        """[num_labels, hidden] from the LM head's [vocab, hidden], in float32 (the difference of two rows
        is taken before any rounding to the model's dtype)."""
        rows = lm_head.to(torch.float32)[list(self.token_ids)]
        if self.method == "from_2_way_softmax":
            return rows[1:2] - rows[0:1]  # tokens[0] is the "false" token, tokens[1] the "true" one
        return rows

    def score_stream(self, weights: Iterable[tuple[str, Any]], tied: bool) -> Iterator[tuple[str, Any]]:
        """The checkpoint's tensors with its LM head replaced by `score.weight` (with tied embeddings the
        head is the embedding table, which still loads)."""
        head = None
        for name, tensor in weights:
            if name == LM_HEAD:
                head = tensor
                continue
            if tied and name == EMBEDDINGS:
                head = tensor
            yield name, tensor
        if head is None:
            where = "its embeddings (tie_word_embeddings)" if tied else LM_HEAD
            raise ValueError(f"classifier_from_token: the checkpoint has no {where} to take the score rows from.")
        if not isinstance(head, torch.Tensor):  # a quantized tensor (a GGUF block format)
            head = head.dense()
        yield "score.weight", self.score_weight(head)


def requested(hf_config: Any) -> bool:
    """Whether the config (after hf_overrides) asks for the conversion."""
    return any(getattr(hf_config, k, None) for k in ("classifier_from_token", "method", "is_original_qwen3_reranker"))


def resolve(hf_config: Any, tokenizer: Any) -> ClassifierFromTokens | None:
    """The conversion the config asks for, its tokens as ids, set on the config (its num_labels too) for
    the model to build; None where it asks for none. ValueError naming what to fix."""
    if not requested(hf_config):
        return None
    tokens = getattr(hf_config, "classifier_from_token", None)
    method = getattr(hf_config, "method", None)
    if getattr(hf_config, "is_original_qwen3_reranker", False):
        if not isinstance(tokens, (list, tuple)) or len(tokens) != 2:
            raise ValueError(
                'is_original_qwen3_reranker needs classifier_from_token: ["no", "yes"] (the false and the true '
                f"token), got {tokens!r}."
            )
        method = "from_2_way_softmax"
    if not isinstance(tokens, (list, tuple)) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"classifier_from_token must be a list of token strings, e.g. [\"no\", \"yes\"]; got {tokens!r}.")
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)} with classifier_from_token, got {method!r}.")
    if method == "from_2_way_softmax" and len(tokens) != 2:
        raise ValueError(f"method from_2_way_softmax takes two tokens (false, true), got {len(tokens)}.")
    if tokenizer is None:
        raise ValueError("classifier_from_token names tokens, which needs the tokenizer: drop skip_tokenizer_init.")
    vocab = tokenizer.get_vocab()
    missing = [t for t in tokens if t not in vocab]
    if missing:
        raise ValueError(f"classifier_from_token: {missing[0]!r} is not a token of this model's vocabulary.")
    conversion = ClassifierFromTokens(method, tuple(tokens), tuple(int(vocab[t]) for t in tokens))
    hf_config.num_labels = conversion.num_labels
    setattr(hf_config, CONFIG_KEY, conversion)
    return conversion

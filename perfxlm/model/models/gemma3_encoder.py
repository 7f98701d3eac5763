"""`Gemma3TextModel` (EmbeddingGemma): Gemma 3's text stack with no LM head, used as an encoder. With
`use_bidirectional_attention` (EmbeddingGemma's config) every token sees the whole sequence on global
layers and the keys within `sliding_window - 1` on either side on local ones (transformers' config
already holds the window halved, as its mask reads it); without it the stack stays causal (a base
model embedding by its last token). Its checkpoint names have no "model." prefix (a base model's
save_pretrained). Mean pooling and the Dense projections come from the sentence-transformers files."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from perfxlm.model.models.base import EncoderModel
from perfxlm.model.models.gemma3 import gemma3_stack
from perfxlm.model.models.llama import LLAMA_STACKED_PARAMS


class Gemma3TextModel(EncoderModel):
    renames: ClassVar[list[tuple[str, str]]] = [(r"^(?!model\.)", "model.")]
    stacked_params = LLAMA_STACKED_PARAMS

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.bidirectional = bool(getattr(config, "use_bidirectional_attention", False))
        self.model = gemma3_stack(config, causal=not self.bidirectional)
        # no modules.json: an encoder's tokens averaged (EmbeddingGemma's pooling), a causal stack's last
        self.default_pooling_type = "MEAN" if self.bidirectional else "LAST"

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.model(input_ids, positions)

    def max_positions(self) -> int:
        return int(self.config.max_position_embeddings)

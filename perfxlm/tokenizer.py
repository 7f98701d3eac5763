"""Tokenizer loading: from a Hugging Face folder, or converted from a GGUF file's metadata."""

from __future__ import annotations

from typing import Any


def get_tokenizer(model: str, tokenizer: str | None = None) -> Any:
    if tokenizer is None and model.endswith(".gguf"):
        from perfxlm.model.loader.gguf_tokenizer import load_gguf_tokenizer

        return load_gguf_tokenizer(model)
    from transformers import AutoTokenizer

    source = tokenizer or model
    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"Could not load a tokenizer from {source!r} ({exc}). Pass tokenizer=PATH, or "
            "skip_tokenizer_init=True to work with token ids only."
        ) from exc

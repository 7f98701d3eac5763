"""What every `perfxlm eval` command reads the same way: the text file, and whether to show progress."""

from __future__ import annotations

import os


def read_text(path: str) -> str:
    if not os.path.isfile(path):
        raise ValueError(f"--file {path!r} does not exist or is not a file.")
    with open(path, encoding="utf-8", errors="replace") as fh:
        text = fh.read()
    if not text.strip():
        raise ValueError(f"--file {path!r} is empty: perplexity needs a text to score.")
    return text



def tqdm_disabled() -> bool:
    return os.environ.get("TQDM_DISABLE", "").strip().lower() not in ("", "0", "false")

"""The base model's log-probabilities saved once, so that every model compared with it runs alone
(llama.cpp's `--kl-divergence-base` file, in this project's own layout).

Layout: 8 magic bytes `PXLMKLD1`, a little-endian uint64 header length, a UTF-8 JSON header (the text's
tokens, window size and count, vocabulary size, BOS handling, what produced it), padded with spaces, then
one record per scored position, windows in order: float32 `lo`, float32 `step`, uint16 codes [vocab].
A log-probability is `lo + step * code`: each position's range from its largest log-probability down to
at most `RANGE` below it, in 65535 even steps (an error of at most 2.5e-4 at the default range; values below
it are raised to it). 49152-token vocabularies take 96 KiB per scored token, as llama.cpp's file does.
The header says `complete` only once every position was written, so a file cut short is refused.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from perfxlm.eval.windows import Windows

MAGIC = b"PXLMKLD1"
FORMAT = 1
# nats below each position's most likely token that are kept: what lies lower is stored as that floor,
# e^-32 ~ 1e-14 a token, too little to move a KLD even over a 150k vocabulary
RANGE = 32.0
_STEPS = 65535
_HEADER_SLACK = 64  # spare header bytes, so rewriting `complete` never moves the data


def _record_dtype(vocab: int) -> np.dtype:
    return np.dtype([("lo", "<f4"), ("step", "<f4"), ("codes", "<u2", (vocab,))])


def encode(logprobs: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """log-probabilities [T, V] -> (lo [T], step [T], codes [T, V] uint16)."""
    lp = logprobs.float()
    top = lp.amax(dim=-1)
    lo = torch.maximum(lp.amin(dim=-1), top - RANGE)
    step = ((top - lo) / _STEPS).clamp_min(1e-12)
    codes = ((lp - lo.unsqueeze(1)) / step.unsqueeze(1)).round_().clamp_(0, _STEPS).to(torch.int32)
    return lo.numpy(), step.numpy(), codes.numpy().astype(np.uint16)


def decode(lo: np.ndarray, step: np.ndarray, codes: np.ndarray) -> torch.Tensor:
    """The stored rows back as normalized log-probabilities [T, V] float32."""
    lo_t = torch.from_numpy(np.array(lo, np.float32)).unsqueeze(1)  # copies: the records are read-only
    step_t = torch.from_numpy(np.array(step, np.float32)).unsqueeze(1)
    lp = lo_t + step_t * torch.from_numpy(codes.astype(np.float32))
    return lp - lp.logsumexp(dim=-1, keepdim=True)


@dataclass
class BaseLogprobs:
    """An open base file: its header and the records as a memory map [n_windows, scored_per_window]."""

    path: str
    header: dict[str, Any]
    records: np.memmap

    @property
    def vocab_size(self) -> int:
        return int(self.header["vocab_size"])

    @property
    def windows(self) -> Windows:
        h = self.header
        return Windows(tokens=list(h["tokens"]), n_ctx=int(h["n_ctx"]), n_windows=int(h["n_windows"]),
                       bos_token_id=h["bos_token_id"])  # fmt: skip

    def rows(self, window: int) -> torch.Tensor:
        """Window `window`'s scored positions as log-probabilities [scored_per_window, V]."""
        rec = self.records[window]
        return decode(rec["lo"], rec["step"], rec["codes"])

    def write(self, window: int, row: int, logprobs: torch.Tensor) -> None:
        """Rows [row, row + len) of window `window`."""
        lo, step, codes = encode(logprobs)
        end = row + codes.shape[0]
        rec = self.records[window, row:end]
        rec["lo"], rec["step"], rec["codes"] = lo, step, codes

    def finish(self) -> None:
        """Flush the records and mark the file complete."""
        self.records.flush()
        self.header["complete"] = True
        _write_header(self.path, self.header, rewrite=True)


def _header_bytes(header: dict[str, Any], size: int | None = None) -> bytes:
    raw = json.dumps(header, separators=(",", ":")).encode()
    size = size if size is not None else len(raw) + _HEADER_SLACK
    if len(raw) > size:
        raise ValueError("header grew past its reserved space")
    return raw + b" " * (size - len(raw))


def _write_header(path: str, header: dict[str, Any], rewrite: bool = False) -> int:
    """Writes magic + length + header; returns the offset of the first record."""
    mode = "r+b" if rewrite else "wb"
    with open(path, mode) as fh:
        if rewrite:
            fh.seek(len(MAGIC))
            size = int(np.frombuffer(fh.read(8), "<u8")[0])
            fh.seek(len(MAGIC) + 8)
            fh.write(_header_bytes(header, size))
            return len(MAGIC) + 8 + size
        body = _header_bytes(header)
        fh.write(MAGIC + np.uint64(len(body)).tobytes() + body)
        return len(MAGIC) + 8 + len(body)


def create(path: str, windows: Windows, vocab_size: int, produced_by: dict[str, Any]) -> BaseLogprobs:
    """A new base file sized for `windows` (its records written later, window by window)."""
    header = {
        "format": FORMAT, "complete": False, "vocab_size": int(vocab_size), "n_ctx": windows.n_ctx,
        "n_windows": windows.n_windows, "first": windows.first, "scored_per_window": windows.scored_per_window,
        "bos_token_id": windows.bos_token_id, "range": RANGE, "produced_by": produced_by,
        "tokens": windows.tokens[: windows.n_windows * windows.n_ctx],
    }  # fmt: skip
    offset = _write_header(path, header)
    shape = (windows.n_windows, windows.scored_per_window)
    records = np.memmap(path, dtype=_record_dtype(vocab_size), mode="r+", offset=offset, shape=shape)
    return BaseLogprobs(path, header, records)


def open_base(path: str) -> BaseLogprobs:
    """A complete base file, checked; ValueError saying what is wrong otherwise."""
    if not os.path.isfile(path):
        raise ValueError(f"--base-logits {path!r} does not exist: make it with --base MODEL first.")
    with open(path, "rb") as fh:
        magic = fh.read(len(MAGIC))
        if magic != MAGIC:
            raise ValueError(f"{path!r} is not a base log-probability file of this project (magic {magic!r}).")
        size = int(np.frombuffer(fh.read(8), "<u8")[0])
        try:
            header = json.loads(fh.read(size).decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path!r}: its header is unreadable ({e}).") from None
    if header.get("format") != FORMAT:
        raise ValueError(f"{path!r} has format {header.get('format')!r}; this version reads format {FORMAT}.")
    if not header.get("complete"):
        raise ValueError(f"{path!r} is incomplete (its base run did not finish): make it again.")
    shape = (int(header["n_windows"]), int(header["scored_per_window"]))
    offset = len(MAGIC) + 8 + size
    dtype = _record_dtype(int(header["vocab_size"]))
    expected = offset + math.prod(shape) * dtype.itemsize
    if os.path.getsize(path) != expected:
        raise ValueError(f"{path!r} holds {os.path.getsize(path)} bytes where its header says {expected}: "
                         "the file is truncated or from another tool.")
    records = np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape)
    return BaseLogprobs(path, header, records)

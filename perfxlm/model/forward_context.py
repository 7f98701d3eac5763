"""Per-step attention metadata, set by the model runner and read by attention layers.

A model file never sees the cache layout or the batch composition: attention layers call
`get_forward_context()` and find everything they need there.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Iterator

import torch


@dataclass(slots=True)
class PrefillSeq:
    """One sequence with more than one new token this step (a prompt or a prompt chunk)."""

    start: int  # first row of this sequence in the flattened batch
    end: int
    num_context_tokens: int  # tokens already in the cache before this step
    block_table: torch.Tensor  # [num_blocks] int64, blocks covering context + new tokens


@dataclass(slots=True)
class AttentionMetadata:
    # [num_tokens] int64: where each new token's K/V goes in the flattened cache
    slot_mapping: torch.Tensor
    # Rows [0, num_decode_tokens) are single-token sequences (decodes), batched in one kernel call.
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] int64
    decode_seq_lens: torch.Tensor | None  # [num_decodes] int64, context + 1
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size] bool, built once per step
    # Rows after the decodes: multi-token sequences, one attention call each.
    prefills: list[PrefillSeq]
    # The step's adapters (perfxlm.lora.slots.LoRABatch) when a row has one, read by the LoRA wrappers of
    # the projections; None otherwise (and always without enable_lora).
    lora: Any = None
    # The attention backend's own device-side form of this step, made before the forward pass (a CUDA
    # graph's static decode inputs, `AttentionBackend.decode_buffers`); None: the backend builds it from
    # the fields above.
    prepared: Any = None

    def prefill_part(self) -> AttentionMetadata:
        """The step without its decode rows: the prefill sequences renumbered from row 0. A layer whose
        decode rows took a kernel of their own (MLA's latent decode) attends the rest of the step with it."""
        nd = self.num_decode_tokens
        prefills = [PrefillSeq(p.start - nd, p.end - nd, p.num_context_tokens, p.block_table)
                    for p in self.prefills]
        return AttentionMetadata(self.slot_mapping[nd:], 0, None, None, None, prefills, self.lora)


@dataclass(slots=True)
class CachelessBatch:
    """A forward pass with no KV cache (the pooling runner): whole sequences, each attending to itself only.

    Linears run on the flattened, unpadded tokens; attention takes each run of consecutive sequences of
    one length as a [sequences, length] view of those rows (the runner sorts a batch by length, so long
    texts cut to the window make long runs): nothing is gathered, padded or masked."""

    seq_lens: list[int]
    # (first row, number of sequences, length) of each run of consecutive sequences of one length
    runs: tuple[tuple[int, int, int], ...]
    # read by the fused decode check, which never applies here
    num_decode_tokens: int = 0
    prefills: tuple = ()

    @classmethod
    def of(cls, seq_lens: list[int]) -> "CachelessBatch":
        runs: list[tuple[int, int, int]] = []
        row = 0
        for n in seq_lens:
            if runs and runs[-1][2] == n:
                start, count, _ = runs[-1]
                runs[-1] = (start, count + 1, n)
            else:
                runs.append((row, 1, n))
            row += n
        return cls(list(seq_lens), tuple(runs))


# One context per thread, set around one forward pass: each engine runs its forward passes in its own
# thread (an offline engine in the caller's), so two engines in one process never see each other's batch.
_local = threading.local()


@contextlib.contextmanager
def set_forward_context(metadata: AttentionMetadata | CachelessBatch) -> Iterator[None]:
    assert getattr(_local, "current", None) is None, "forward contexts do not nest"
    _local.current = metadata
    try:
        yield
    finally:
        _local.current = None


def get_forward_context() -> AttentionMetadata | CachelessBatch:
    current = getattr(_local, "current", None)
    assert current is not None, "attention called outside set_forward_context()"
    return current

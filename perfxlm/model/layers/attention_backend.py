"""Attention backends: how an attention layer writes this step's K/V and attends over the paged cache.

The layer owns its options and its cache; the backend owns the kernels. `cpu` is the engine's own path
(the native decode kernel, tiled prefill over cached context, SDPA; `ops/attention.py`); `triton` runs the
Triton kernels of `ops/gpu/` for every row of the step in one launch, the path of a CUDA device, which
Triton's interpreter also runs on CPU tensors so the suite checks it end to end without a GPU.

Chosen by the device of the step's tensors, or forced with `PERFXLM_ATTENTION_BACKEND=cpu|triton`
(read once, at the first forward pass).
"""

from __future__ import annotations

import functools
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from perfxlm.model.forward_context import AttentionMetadata
from perfxlm.ops.attention import (
    paged_decode_attention, prefill_attention, write_kv_cache, write_kv_cache_torch,
)  # fmt: skip
from perfxlm.ops.kv_quant import KVCache
from perfxlm.ops.mla import mla_decode_attention
from perfxlm.ops.varlen_attention import varlen_attention

BACKENDS = ("auto", "cpu", "triton")


@dataclass(frozen=True, slots=True)
class AttentionOptions:
    """What one attention layer asks of every backend."""

    scale: float
    sliding_window: int | None = None  # a query at position p sees keys in (p - window, p]
    soft_cap: float | None = None  # scores -> cap * tanh(scores / cap) before the softmax
    causal: bool = True  # False: an encoder's bidirectional attention (only the cacheless backend has it)
    sinks: torch.Tensor | None = None  # [num_heads] sink logits (gpt-oss), a Parameter loaded in place


class AttentionBackend(ABC):
    name: str
    # whether the CPU's fused decode layer (one native call per layer, its own attention) may replace the
    # module path on all-decode steps: only where this backend's kernels are the ones it would replace
    fuses_decode: bool = False
    # whether the layer must have its KV cache bound first (the cacheless backend attends within the step)
    uses_cache: bool = True

    def decode_buffers(self, max_rows: int, max_blocks: int, device: torch.device) -> "DecodeBuffers":
        """Static device-side inputs for decode steps of up to `max_rows` rows, read by the kernels in
        place, so a CUDA graph captured over them replays any later step's values (worker/cuda_graphs.py).
        Only a backend whose kernels take their step from device tensors has them."""
        raise NotImplementedError(f"the {self.name} attention backend cannot run captured decode steps")

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        cache: KVCache,
        meta: AttentionMetadata,
        options: AttentionOptions,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Write k/v at meta.slot_mapping, then attend: decode rows first, then each prefill sequence."""

    def latent_decode(
        self,
        q_nope: torch.Tensor,  # [num_tokens, num_heads, nope]
        q_pe: torch.Tensor,  # [num_tokens, num_heads, rope], rotated
        latent: torch.Tensor,  # [num_tokens, 1, kv_lora_rank + rope]: the rows to cache
        cache: KVCache,
        meta: AttentionMetadata,
        options: AttentionOptions,
        w_uk: torch.Tensor,  # [num_heads, nope, kv_lora_rank]
        w_uv_t: torch.Tensor,  # [num_heads, kv_lora_rank, v_head_dim]
    ) -> torch.Tensor | None:  # [num_decode_tokens, num_heads, v_head_dim]
        """Multi-head latent attention's decode rows (the step's first num_decode_tokens) in one kernel
        (ops/mla.py): write their latent rows, then the absorbed query's attention and W_UV. None where
        this backend has no such kernel or the step has no decode rows. The layer composes the rest around
        `forward` (model/layers/mla.py): every row where this gave None, else the prefill rows alone, so a
        step mixing decodes and a prefill chunk still decodes through the kernel."""
        return None


class CpuAttentionBackend(AttentionBackend):
    name = "cpu"
    fuses_decode = True

    def forward(self, q, k, v, cache, meta, options):
        key_cache, value_cache = cache.key, cache.value
        write_kv_cache(k, v, key_cache, value_cache, meta.slot_mapping, cache.key_scale, cache.value_scale)
        out = torch.empty(q.shape, dtype=q.dtype)
        kwargs = {}
        if cache.key_scale is not None:
            kwargs["key_scale"], kwargs["value_scale"] = cache.key_scale, cache.value_scale
        if options.sinks is not None:
            kwargs["sinks"] = options.sinks
        if options.sliding_window is not None:
            kwargs["sliding_window"] = options.sliding_window
        if options.soft_cap is not None:
            kwargs["soft_cap"] = options.soft_cap
        nd = meta.num_decode_tokens
        if nd:
            out[:nd] = paged_decode_attention(
                q[:nd], key_cache, value_cache, meta.decode_block_tables, meta.decode_seq_lens, options.scale,
                meta.decode_mask, **kwargs,
            )  # fmt: skip
        for seq in meta.prefills:
            s, e = seq.start, seq.end
            out[s:e] = prefill_attention(
                q[s:e], k[s:e], v[s:e], key_cache, value_cache, seq.block_table, seq.num_context_tokens,
                options.scale, bf16_model=cache.bf16_model, **kwargs,
            )  # fmt: skip
        return out

    def latent_decode(self, q_nope, q_pe, latent, cache, meta, options, w_uk, w_uv_t):
        nd = meta.num_decode_tokens
        if not nd:
            return None
        rows = latent[:nd]
        write_kv_cache(rows, rows, cache.key, cache.value, meta.slot_mapping[:nd], cache.key_scale,
                       cache.value_scale)
        return mla_decode_attention(
            torch.cat((q_nope[:nd], q_pe[:nd]), dim=-1), cache.key, cache.key_scale, meta.decode_block_tables,
            meta.decode_seq_lens, w_uk, w_uv_t, options.scale,
        )  # fmt: skip


class CachelessAttentionBackend(AttentionBackend):
    """The pooling runner's: whole sequences in one step, no KV cache, causal (a decoder used as an
    embedder) or bidirectional (an encoder); `meta` is the step's `CachelessBatch`. Bound by the runner
    itself, never chosen by device."""

    name = "cacheless"
    uses_cache = False

    def forward(self, q, k, v, cache, meta, options):
        if options.soft_cap is not None:
            raise ValueError("logit soft-capping is not supported by the pooling runner's attention.")
        if options.sinks is not None:
            raise ValueError("attention sinks (gpt-oss) are not supported by the pooling runner's attention.")
        return varlen_attention(q, k, v, meta.runs, options.scale, options.causal, options.sliding_window)


@dataclass(frozen=True, slots=True)
class _TritonStep:
    """The step's batch as the Triton kernel reads it: one row per sequence, built once per step."""

    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    query_lens: list[int]
    seq_lens: list[int]
    # query heads per KV head -> the kernel's launch plan (paged_attention.AttentionLaunch), made by the
    # first layer of that shape and reused by the rest
    launches: dict[int, Any] = field(default_factory=dict)

    def launch(self, group: int, plan_launch: Any, device: torch.device) -> Any:
        got = self.launches.get(group)
        if got is None:
            got = self.launches[group] = plan_launch(self.query_lens, self.seq_lens, group, device)
        return got


class DecodeBuffers:
    """A decode step's inputs to the Triton kernel in static device memory: block tables and sequence
    lengths for up to `max_rows` rows, filled from the CPU by one copy per step (`fill`), and the steps
    of each padded row count over views of them (`step`), whose launch plans read the same memory.
    Rows past a step's own keep what they held: whatever they read, their output is never used."""

    def __init__(self, max_rows: int, max_blocks: int, device: torch.device) -> None:
        self.max_rows, self.max_blocks = max_rows, max_blocks
        # [seq_lens | first positions | block tables] as one int32 block: one host-to-device copy per step
        size = max_rows * (2 + max_blocks)
        # page-locked on a GPU's host, so the per-step copy runs asynchronously
        self.host = torch.zeros(size, dtype=torch.int32, pin_memory=torch.device(device).type == "cuda")
        self.device = torch.zeros(size, dtype=torch.int32, device=device)
        self.seq_lens = self.device[:max_rows]
        self.pos0 = self.device[max_rows : 2 * max_rows]
        self.tables = self.device[2 * max_rows :].view(max_rows, max_blocks)
        self._host_lens = self.host[:max_rows]
        self._host_pos0 = self.host[max_rows : 2 * max_rows]
        self._host_tables = self.host[2 * max_rows :].view(max_rows, max_blocks)
        self.arange = torch.arange(max_rows + 1, dtype=torch.int32, device=device)  # query starts, tile rows
        self.zeros = torch.zeros(max_rows, dtype=torch.int32, device=device)
        self._steps: dict[int, _TritonStep] = {}

    def fits(self, rows: int, width: int) -> bool:
        return rows <= self.max_rows and width <= self.max_blocks

    def fill(self, block_tables: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """This step's decode rows (CPU tensors: [rows, blocks] and [rows], within `fits`) into the static
        memory; the rows' table entries past `blocks` keep old values the kernel never reaches."""
        rows, width = block_tables.shape
        self._host_lens[:rows].copy_(seq_lens)
        self._host_pos0[:rows].copy_(seq_lens - 1)
        self._host_tables[:rows, :width].copy_(block_tables)
        n, m = self.max_rows, self.max_blocks
        self.device[:rows].copy_(self.host[:rows], non_blocking=True)
        self.device[n : n + rows].copy_(self.host[n : n + rows], non_blocking=True)
        self.device[2 * n : 2 * n + rows * m].copy_(self.host[2 * n : 2 * n + rows * m], non_blocking=True)

    def step(self, rows: int) -> _TritonStep:
        """The kernel's view of a padded decode step of `rows` rows (one BLOCK_M tile per row)."""
        got = self._steps.get(rows)
        if got is None:
            got = self._steps[rows] = _StaticDecodeStep(self.tables[:rows], [], [], {}, self, rows)
        return got


@dataclass(frozen=True, slots=True)
class _StaticDecodeStep(_TritonStep):
    """A padded decode step over DecodeBuffers: its launch plans are views, never copies."""

    buffers: DecodeBuffers | None = None
    rows: int = 0

    def launch(self, group: int, plan_launch: Any, device: torch.device) -> Any:
        got = self.launches.get(group)
        if got is None:
            from perfxlm.ops.gpu.paged_attention import AttentionLaunch, decode_block_m

            b, n = self.buffers, self.rows
            got = self.launches[group] = AttentionLaunch(
                decode_block_m(group), n, n, b.arange[: n + 1], b.pos0[:n], b.seq_lens[:n], b.arange[:n], b.zeros[:n]
            )
        return got


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self) -> None:
        from perfxlm.ops.gpu.paged_attention import paged_attention, plan_launch  # imports triton: when chosen

        self._attend = paged_attention
        self._plan_launch = plan_launch
        self._steps: dict[int, tuple[AttentionMetadata, _TritonStep]] = {}

    def decode_buffers(self, max_rows: int, max_blocks: int, device: torch.device) -> DecodeBuffers:
        return DecodeBuffers(max_rows, max_blocks, device)

    def _step(self, meta: AttentionMetadata, device: torch.device) -> _TritonStep:
        if meta.prepared is not None:  # a captured decode step: its inputs already sit in static memory
            return meta.prepared
        # Every layer of a forward pass sees the same metadata object: the table is built by the first.
        cached = self._steps.get(id(meta))
        if cached is not None and cached[0] is meta:
            return cached[1]
        nd = meta.num_decode_tokens
        tables: list[torch.Tensor] = []
        query_lens: list[int] = [1] * nd
        seq_lens: list[int] = []
        if nd:
            tables.extend(meta.decode_block_tables)
            seq_lens.extend(meta.decode_seq_lens.tolist())
        for seq in meta.prefills:
            tables.append(seq.block_table)
            query_lens.append(seq.end - seq.start)
            seq_lens.append(seq.num_context_tokens + seq.end - seq.start)
        width = max(t.shape[0] for t in tables)
        padded = torch.zeros(len(tables), width, dtype=torch.int32)
        for i, t in enumerate(tables):
            padded[i, : t.shape[0]] = t
        step = _TritonStep(padded.to(device, non_blocking=True), query_lens, seq_lens)
        self._steps = {id(meta): (meta, step)}  # only the current step is kept
        return step

    def forward(self, q, k, v, cache, meta, options):
        write_kv_cache_torch(k, v, cache.key, cache.value, meta.slot_mapping.to(k.device), cache.key_scale,
                             cache.value_scale)  # fmt: skip
        if options.sinks is not None:
            raise ValueError("the triton attention backend has no attention sinks (gpt-oss) yet; use cpu.")
        if cache.key.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.int8):
            raise ValueError(f"the triton attention backend reads float and int8 KV caches, not {cache.key.dtype}.")
        step = self._step(meta, q.device)
        launch = step.launch(q.shape[1] // cache.key.shape[2], self._plan_launch, q.device)
        return self._attend(
            q, cache.key, cache.value, step.block_tables, step.query_lens, step.seq_lens, options.scale,
            options.sliding_window, options.soft_cap, cache.key_scale, cache.value_scale, launch=launch,
        )  # fmt: skip


@functools.lru_cache(maxsize=None)
def requested() -> str:
    name = os.environ.get("PERFXLM_ATTENTION_BACKEND", "auto").strip().lower() or "auto"
    if name not in BACKENDS:
        raise ValueError(f"PERFXLM_ATTENTION_BACKEND must be one of {', '.join(BACKENDS)}; got {name!r}.")
    return name


@functools.lru_cache(maxsize=None)
def _backend(name: str) -> AttentionBackend:
    return TritonAttentionBackend() if name == "triton" else CpuAttentionBackend()


def for_device(device: torch.device) -> AttentionBackend:
    """The backend for tensors on `device`: triton on CUDA, cpu on CPU, unless the environment forces one
    (read once per process; `requested.cache_clear()` re-reads it)."""
    name = requested()
    if name == "auto":
        name = "triton" if device.type == "cuda" else "cpu"
    elif name == "cpu" and device.type != "cpu":
        raise ValueError(f"PERFXLM_ATTENTION_BACKEND=cpu cannot attend over tensors on {device}.")
    elif name == "triton" and device.type == "cpu":
        from perfxlm.ops.gpu import triton_available

        if not triton_available():
            raise ValueError(
                "PERFXLM_ATTENTION_BACKEND=triton on CPU tensors needs triton installed and TRITON_INTERPRET=1 "
                "(Triton's interpreter)."
            )
    return _backend(name)

"""How big the KV block pool is, and how long one sequence may be because of it.

Decided once at start, after the model is built (the bytes per block depend on its layers):

- `num_kv_blocks` given: exactly that many blocks.
- `kv_cache_gib` given: that many GiB (vLLM's CPU KV-space setting).
- neither: min(DEFAULT_KV_CACHE_GIB, half the memory available now), and never more than
  `max_num_seqs x max_model_len` could fill.
- neither, on a GPU: what `gpu_memory_utilization` leaves once the weights and a step's activations
  are counted (`worker/gpu_memory.py`, vLLM's rule), with the same ceiling.

The pool tensors commit pages only as blocks are written (`worker/kv_memory.py`), so a large pool
costs address space, not resident memory, until requests use it.

Then `max_model_len` must fit one sequence into the pool. A default (the model's maximum, 128k for
Llama-3.x) is lowered to what the pool holds, with a log line saying so; a `max_model_len` the user
asked for that does not fit is an error at start naming both numbers.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("perfxlm")

GIB = 1 << 30
DEFAULT_KV_CACHE_GIB = 4.0
# Of the memory available at start, the share a default pool may take (weights are already loaded).
DEFAULT_AVAILABLE_FRACTION = 0.5


def available_memory_bytes() -> int | None:
    """Memory this process can still use: MemAvailable, lowered to the cgroup's remaining limit."""
    avail: int | None = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError):
        pass
    cgroup = _cgroup_headroom()
    if cgroup is not None:
        avail = cgroup if avail is None else min(avail, cgroup)
    return avail


def _cgroup_headroom() -> int | None:
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # cgroup v2
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            with open(limit_file) as f:
                raw = f.read().strip()
            if raw == "max":
                return None
            limit = int(raw)
            if limit >= 1 << 60:  # v1 reports "no limit" as a huge number
                return None
            with open(usage_file) as f:
                return max(0, limit - int(f.read().strip()))
        except (OSError, ValueError):
            continue
    return None


def plan_num_blocks(
    bytes_per_block: int,
    block_size: int,
    max_num_seqs: int,
    max_model_len: int,
    num_kv_blocks: int | None = None,
    kv_cache_gib: float | None = None,
    device_budget: int | None = None,
    replicas: int = 1,
) -> int:
    """`device_budget`: bytes a GPU's pool may take (gpu_memory_utilization's share), or None on the CPU.
    `replicas`: data-parallel replicas sharing the machine's memory; a default pool takes its share."""
    if num_kv_blocks is not None:
        return num_kv_blocks
    if kv_cache_gib is not None:
        if kv_cache_gib <= 0:
            raise ValueError(f"kv_cache_gib must be > 0, got {kv_cache_gib}.")
        num = int(kv_cache_gib * GIB // bytes_per_block)
        if num < 1:
            raise ValueError(
                f"kv_cache_gib={kv_cache_gib} is too small for one block ({bytes_per_block} bytes)."
            )
        return num
    # Never more than every seat filled to max_model_len could use.
    ceiling = max_num_seqs * -(-max_model_len // block_size)
    if device_budget is not None:
        num = min(max(0, device_budget) // bytes_per_block, ceiling)
        if num < 1:
            raise ValueError(
                f"No GPU memory left for one KV block ({bytes_per_block} bytes) under gpu_memory_utilization: "
                f"raise gpu_memory_utilization, lower max_num_batched_tokens / max_num_seqs, or free the GPU."
            )
        return num
    budget = DEFAULT_KV_CACHE_GIB * GIB
    avail = available_memory_bytes()
    if avail is not None:
        budget = min(budget, avail * DEFAULT_AVAILABLE_FRACTION / replicas)
    num = min(int(budget // bytes_per_block), ceiling)
    if num < 1:
        raise ValueError(
            f"Not enough memory for one KV block ({bytes_per_block} bytes; about {avail} bytes available): "
            "free memory or pass kv_cache_gib / num_kv_blocks."
        )
    return num


def fit_max_model_len(
    max_model_len: int, explicit: bool, num_blocks: int, block_size: int, bytes_per_block: int
) -> int:
    """max_model_len lowered to what one sequence can hold in the pool (or an error if the user set it)."""
    pool_tokens = num_blocks * block_size
    if max_model_len <= pool_tokens:
        return max_model_len
    gib = num_blocks * bytes_per_block / GIB
    if explicit:
        raise ValueError(
            f"max_model_len={max_model_len} does not fit the KV cache: the pool ({num_blocks} blocks, "
            f"{gib:.2f} GiB) holds {pool_tokens} tokens. Lower max_model_len to at most {pool_tokens} or "
            "enlarge the cache (kv_cache_gib / num_kv_blocks)."
        )
    logger.warning(
        "max_model_len lowered from the model's %d to %d: that is what one sequence can hold in the KV pool "
        "(%d blocks, %.2f GiB). Pass kv_cache_gib (--kv-cache-gib) for a larger pool.",
        max_model_len, pool_tokens, num_blocks, gib,
    )
    return pool_tokens


"""Which cores each rank runs on: one NUMA node per rank, read from /sys, or an explicit binding.

PERFXLM_CPU_OMP_THREADS_BIND takes vLLM's VLLM_CPU_OMP_THREADS_BIND forms: "auto" (the default: NUMA
nodes from /sys, split among the ranks), "nobind" (leave every rank on every allowed core), or one core
list per rank separated by "|", e.g. "0-31|32-63" or "0,2,4|1,3,5".
"""

from __future__ import annotations

import os
from pathlib import Path

BIND_ENV = "PERFXLM_CPU_OMP_THREADS_BIND"


def parse_cpu_list(text: str) -> list[int]:
    """ "0-3,8,10-11" -> [0, 1, 2, 3, 8, 10, 11] (the kernel's cpulist format)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            if int(hi) < int(lo):
                raise ValueError(f"bad CPU range {part!r}")
            cpus.extend(range(int(lo), int(hi) + 1))
        else:
            cpus.append(int(part))
    return cpus


def numa_nodes(root: str = "/sys/devices/system/node") -> list[list[int]]:
    """The cores of each NUMA node that this process may run on; one node with every allowed core where
    /sys says nothing (containers, other systems)."""
    allowed = sorted(os.sched_getaffinity(0))
    nodes: list[list[int]] = []
    base = Path(root)
    if base.is_dir():
        for entry in sorted(base.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
            try:
                cpus = [c for c in parse_cpu_list((entry / "cpulist").read_text()) if c in set(allowed)]
            except (OSError, ValueError):
                continue
            if cpus:
                nodes.append(cpus)
    return nodes or [allowed]


def _split(cpus: list[int], parts: int) -> list[list[int]]:
    size, extra = divmod(len(cpus), parts)
    out, start = [], 0
    for i in range(parts):
        n = size + (1 if i < extra else 0)
        out.append(cpus[start : start + n])
        start += n
    return out


def plan_rank_cpus(world_size: int, bind: str | None = None, nodes: list[list[int]] | None = None) -> list[list[int] | None]:
    """The cores of each rank (None: not pinned).

    auto: with at least as many NUMA nodes as ranks, rank r takes node r (every rank's threads and the
    pages they touch first stay on one node); with fewer, each node's cores are split evenly among the
    ranks placed on it, so ranks never share a core."""
    bind = (bind if bind is not None else os.environ.get(BIND_ENV, "auto")).strip()
    if bind == "nobind":
        return [None] * world_size
    if bind and bind != "auto":
        lists = [parse_cpu_list(p) for p in bind.split("|")]
        if len(lists) != world_size or any(not c for c in lists):
            raise ValueError(
                f"{BIND_ENV}={bind!r} names {len(lists)} core lists; {world_size} ranks need one non-empty list each "
                "(separated by '|')"
            )
        return lists  # type: ignore[return-value]
    nodes = nodes if nodes is not None else numa_nodes()
    if len(nodes) >= world_size:
        return [list(nodes[r]) for r in range(world_size)]
    # Fewer nodes than ranks: spread ranks over nodes as evenly as possible, then split each node.
    per_node = _split(list(range(world_size)), len(nodes))
    plan: list[list[int] | None] = [None] * world_size
    for node, ranks in zip(nodes, per_node):
        if not ranks:
            continue
        if len(node) < len(ranks):  # more ranks than cores (tests, small machines): one core each, shared
            for i, rank in enumerate(ranks):
                plan[rank] = [node[i % len(node)]]
            continue
        for rank, cpus in zip(ranks, _split(node, len(ranks))):
            plan[rank] = cpus
    return plan


def bind_current_process(cpus: list[int] | None) -> int:
    """Pin this process to `cpus` and size torch's thread pool to them; returns the thread count."""
    import torch

    if cpus:
        os.sched_setaffinity(0, cpus)
        threads = len(cpus)
    else:
        threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    return threads

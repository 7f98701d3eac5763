"""Collectives between the tensor-parallel ranks: all-reduce (two per decoder layer) and all-gather (the
vocabulary-parallel logits).

Inside one machine they go through shared memory (`csrc/shm_allreduce.cpp`, built on first use as its
own extension): a copy into this rank's slot, one wait on the other ranks' sequence numbers, the sum
read from every slot. gloo's all-reduce goes through its TCP transport and costs far more per call on
the small tensors of a decode step (see `benchmarks/bench_allreduce.py`). Where the extension cannot be
built, or PERFXLM_ALLREDUCE=gloo, torch.distributed (gloo) does the same collectives. gloo also does
the set-up (rendezvous, the segment's name) either way.

A collective that waits longer than PERFXLM_COLLECTIVE_TIMEOUT seconds (default 10) for another rank
raises: ranks do the same work between collectives, so a long wait means a rank died or hangs.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger("perfxlm")

_SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "shm_allreduce.cpp"
_LINE = 64
DEFAULT_SLOT_BYTES = 4 << 20
_native_state: dict[str, Any] = {}
_native_lock = threading.Lock()


def collective_timeout() -> float:
    return float(os.environ.get("PERFXLM_COLLECTIVE_TIMEOUT", "10"))


def shm_native() -> Any | None:
    """The shared-memory collectives extension, or None where it cannot be built."""
    if "mod" in _native_state:
        return _native_state["mod"]
    with _native_lock:
        if "mod" not in _native_state:
            _native_state["mod"] = _build()
        return _native_state["mod"]


def _build() -> Any | None:
    if os.environ.get("PERFXLM_NATIVE", "1") in ("0", "false", "no"):
        return None
    try:
        from torch.utils.cpp_extension import load

        # the source's folder is part of the key, as for the layer kernels (ops/native.py): torch's builder
        # writes absolute source paths into build.ninja, so checkouts sharing a folder rebuild it in turn
        key = hashlib.sha256(
            _SOURCE.read_bytes() + str(_SOURCE.parent).encode() + torch.__version__.encode()
        ).hexdigest()[:16]
        root = Path(os.environ.get("PERFXLM_CACHE_DIR", Path.home() / ".cache" / "perfxlm"))
        build_dir = root / "kernels" / f"shm-{key}"
        build_dir.mkdir(parents=True, exist_ok=True)
        from perfxlm.ops.native import _build_guard

        # as the layer kernels' build: a `lock` left by a build that was killed is cleared, not waited on
        with _build_guard(build_dir):
            return load(
                name="perfxlm_shm_allreduce",
                sources=[str(_SOURCE)],
                extra_cflags=["-O3", "-march=native", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir),
                verbose=False,
            )
    except Exception as exc:
        logger.warning("perfxlm: shared-memory all-reduce unavailable (%s); using gloo.", exc)
        return None


class Communicator:
    """The collectives of one rank. `all_reduce` sums in place; `all_gather` concatenates along the last
    dimension (the vocabulary shards of the logits)."""

    rank: int
    world_size: int
    name = "none"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class GlooCommunicator(Communicator):
    name = "gloo"

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)

    def barrier(self) -> None:
        dist.barrier(group=self.group)


class ShmCommunicator(Communicator):
    """Collectives through one shared memory segment (a file under /dev/shm, removed as soon as every
    rank has mapped it)."""

    name = "shm"

    def __init__(self, native: Any, rank: int, world_size: int, segment: str, slot_bytes: int = DEFAULT_SLOT_BYTES,
                 timeout_s: float | None = None) -> None:
        self.native = native
        self.rank, self.world_size = rank, world_size
        self.slot_bytes = slot_bytes
        self.timeout = collective_timeout() if timeout_s is None else timeout_s
        # spin this long before sleeping on a futex (PERFXLM_SHM_SPIN_US, default 0: on shared or busy cores a
        # spinning rank costs its peer more than a wake-up; dedicated cores may gain a few us per call)
        self.spin = float(os.environ.get("PERFXLM_SHM_SPIN_US", "0")) * 1e-6
        size = world_size * _LINE + 2 * world_size * slot_bytes
        if rank == 0:
            fd = os.open(segment, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, size)
        else:
            fd = os.open(segment, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.shm = torch.frombuffer(self._map, dtype=torch.uint8)
        self.seq = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in (torch.float32, torch.bfloat16) or not x.is_contiguous():
            raise ValueError(f"shm all-reduce takes contiguous float32 / bfloat16 tensors, got {x.dtype}")
        self.seq = self.native.all_reduce(x, self.shm, self.rank, self.world_size, self.seq, self.slot_bytes,
                                          self.timeout, self.spin)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty((self.world_size, *x.shape), dtype=x.dtype)
        self.seq = self.native.all_gather(x, out, self.shm, self.rank, self.world_size, self.seq, self.slot_bytes,
                                          self.timeout, self.spin)
        return torch.cat(out.unbind(0), dim=-1)

    def barrier(self) -> None:
        self.seq = self.native.barrier(self.shm, self.rank, self.world_size, self.seq, self.timeout, self.spin)

    def close(self) -> None:
        self.shm = None  # type: ignore[assignment]
        try:
            self._map.close()
        except BufferError:  # a view still holds it: the mapping goes with the process
            pass


def init_process_group(rank: int, world_size: int, init_method: str) -> None:
    """gloo for set-up (and the fallback collectives); its timeout bounds a rendezvous that never completes."""
    if not dist.is_initialized():
        dist.init_process_group(
            "gloo", init_method=init_method, rank=rank, world_size=world_size,
            timeout=timedelta(seconds=max(30.0, collective_timeout())),
        )


def make_communicator(rank: int, world_size: int, kind: str | None = None, segment_dir: str = "/dev/shm") -> Communicator:
    """The fastest collectives the ranks can share: shared memory when the extension builds on every rank
    (they agree through gloo), else gloo. Needs the gloo process group up."""
    kind = kind or os.environ.get("PERFXLM_ALLREDUCE", "shm")
    if kind not in ("shm", "gloo"):
        raise ValueError(f"PERFXLM_ALLREDUCE must be shm or gloo, got {kind!r}")
    native = shm_native() if kind == "shm" and os.path.isdir(segment_dir) else None
    ok = torch.tensor([1 if native is not None else 0], dtype=torch.int64)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if not ok.item():
        return GlooCommunicator()
    names = [f"{segment_dir}/perfxlm-tp-{os.getpid()}-{os.urandom(6).hex()}" if rank == 0 else None]
    dist.broadcast_object_list(names, src=0)
    segment = names[0]
    try:
        comm: Communicator = ShmCommunicator(native, rank, world_size, segment) if rank == 0 else None  # type: ignore[assignment]
        dist.barrier()
        if rank != 0:
            comm = ShmCommunicator(native, rank, world_size, segment)
        dist.barrier()
    finally:
        if rank == 0:
            try:
                os.unlink(segment)
            except OSError:
                pass
    return comm

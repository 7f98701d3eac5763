"""The tensor-parallel group a model is built for: this rank, the number of ranks, and their collectives.

A model's parallel layers (`model/layers/parallel_linear.py`, the vocabulary-parallel embedding and LM
head) read the group once, when they are built, from `tp_group()`: the loader builds a rank's model inside
`building_for(group)`, and everything else (one process, tests, draft models) gets `SINGLE`, where every
layer is the plain one and no collective is called. A leaf module: it imports nothing of the package, so
the layers can depend on it without depending on how ranks are started or how they talk.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Any, Iterator

import torch


def split_sizes(total: int, parts: int) -> list[int]:
    """`total` split into `parts` contiguous pieces as evenly as they go, the larger ones first."""
    size, extra = divmod(total, parts)
    return [size + (1 if i < extra else 0) for i in range(parts)]


@dataclass(frozen=True)
class TPGroup:
    """One rank's view of the tensor-parallel group. `comm` sums (`all_reduce`, in rank order, so every rank
    gets the same bits) and concatenates along the last dimension (`all_gather`); None with one rank."""

    rank: int = 0
    world_size: int = 1
    comm: Any = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"tensor-parallel rank {self.rank} is outside a group of {self.world_size}.")
        if self.world_size > 1 and self.comm is None:
            raise ValueError("a tensor-parallel group of several ranks needs a communicator.")

    @property
    def parallel(self) -> bool:
        return self.world_size > 1

    def part(self, total: int) -> tuple[int, int]:
        """(start, size) of this rank's contiguous share of `total` rows or columns."""
        sizes = split_sizes(total, self.world_size)
        return sum(sizes[: self.rank]), sizes[self.rank]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(x.contiguous())

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_gather(x.contiguous())


SINGLE = TPGroup()

_current: contextvars.ContextVar[TPGroup] = contextvars.ContextVar("perfxlm_tp_group", default=SINGLE)


def tp_group() -> TPGroup:
    """The group the model being built is for (`SINGLE` outside `building_for`)."""
    return _current.get()


@contextlib.contextmanager
def building_for(group: TPGroup) -> Iterator[None]:
    """Build a model inside this to give its parallel layers this rank's shard and collectives."""
    token = _current.set(group)
    try:
        yield
    finally:
        _current.reset(token)

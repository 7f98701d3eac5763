"""What the data-parallel front end and a replica say to each other, besides the messages every child
speaks (`distributed/supervision.py`: Ready, Failed, Stop).

Front end -> replica: `AddRequest` (the request pickled on its own, so one a replica cannot rebuild fails
alone), `FinishRequests`, `CheckInvariants`. Replica -> front end: `Ready(info)` once its model is
loaded, `StepOutputs` after each step or command that ended requests, `InvariantCounts`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class AddRequest:
    blob: bytes  # the pickled Request
    generation: int  # the front end's count of adds: an id aborted and re-added is not freed twice
    request_id: str


@dataclass(frozen=True)
class FinishRequests:
    request_ids: list[str]
    status: Any  # engine.request.RequestStatus
    stop_reason: str | None


@dataclass(frozen=True)
class CheckInvariants:
    pass


@dataclass(frozen=True)
class InvariantCounts:
    counts: dict[str, int]


@dataclass(frozen=True)
class StepOutputs:
    outputs: list[Any]  # EngineCoreOutputs
    done: list[tuple[str, int]]  # (base request id, generation) of requests the replica no longer holds
    stats: dict[str, int]  # its scheduler and KV-cache counts

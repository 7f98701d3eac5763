"""The proposer seam: a request's tokens in, a guess of its next tokens out.

The engine core asks after each step, for the running requests that will decode next (caught up with
their tokens, below `max_tokens`); the scheduler puts the drafts behind the request's next input token,
and the runner verifies them in the same forward pass (a guided request's rows masked by its grammar as
it stands at each draft, so a draft the grammar forbids is rejected like any other wrong guess). A
proposer may return fewer drafts than asked, or none (the request then decodes plainly). It must be
deterministic in the sense the rejection sampler assumes: one draft token per position, no distribution.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class DraftRequest:
    request_id: str
    token_ids: list[int]  # prompt then output so far (read only: the request's own list)
    max_drafts: int  # at most this many draft tokens (>= 1)


class Proposer(ABC):
    name: str
    # whether it reads the target's hidden states (the runner then hands them over every step: `observe`)
    needs_hidden_states: bool = False
    # whether the scheduler bounds its guesses per request by the last verification (draft_budget.py);
    # a proposer that bounds them by its own confidence (prompt lookup's match length) says False
    follows_budget: bool = True
    # whether its guesses cost forward passes of their own that may outweigh what they win: the engine then
    # speculates only while it measures a gain (payoff.py); free guesses (prompt lookup) need not ask
    weighs_its_cost: bool = False

    @abstractmethod
    def propose(self, batch: list[DraftRequest]) -> list[list[int]]:
        """Draft tokens for each request of `batch`, in order (an empty list: no guess)."""

    def drop(self, request_ids: Iterable[str]) -> None:
        """Forget per-request state of requests that finished or stopped speculating."""

    def observe(self, hidden_states: dict[str, Any]) -> None:
        """The step's `HiddenRows` by request id (engine/messages.py), after every step, before `propose`:
        empty unless `needs_hidden_states`."""

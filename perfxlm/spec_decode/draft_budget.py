"""How many guesses a request may carry next step, from how its last verification went.

A guess costs a row of the verification step whether it is accepted or not, and on a CPU a row is not
free (the products' work grows with the rows even where reading the weights dominates), so guesses past
the point where the request's drafts usually break are paid for and thrown away. Prompt lookup's drafts
are right in runs (a copied span) and wrong once the output leaves it, so the last verification predicts
the next one well. The rule (Hugging Face's assisted generation "heuristic" schedule, with the cut made
at the accepted length): after every draft was accepted, two more guesses than last time; after a
partial acceptance, one more than the accepted ones; after none, none for a growing number of proposals
(1, 2, 4 ... 16, reset by any acceptance), then one guess to try again. The engine's own cap (the number
asked for, the step's row budget) still bounds it.
"""

from __future__ import annotations

# Most proposals a request sits out after its guesses keep missing (each miss doubles its pause).
MAX_BACKOFF = 16


class DraftBudget:
    """One request's allowance of guesses (kept on the request, updated by the scheduler)."""

    __slots__ = ("backoff", "length", "skip")

    def __init__(self) -> None:
        self.backoff = 0  # proposals to sit out after the next miss (doubling)
        self.skip = 0  # proposals still to sit out now
        self.length: int | None = None  # guesses allowed next time; None: as many as asked

    def take(self, most: int) -> int:
        """Guesses the request may carry at the next step, at most `most` (0: it sits this one out)."""
        if self.skip:
            self.skip -= 1
            return 0
        return most if self.length is None else min(most, self.length)

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        """A verification of `num_drafts` guesses accepted the first `num_accepted`."""
        if num_accepted == 0:
            self.backoff = min(max(1, 2 * self.backoff), MAX_BACKOFF)
            self.skip = self.backoff
            self.length = 1
            return
        self.backoff = 0
        self.length = num_drafts + 2 if num_accepted == num_drafts else num_accepted + 1

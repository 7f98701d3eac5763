"""Whether a costly proposer's guesses pay, from the engine's own step times.

A draft model's guesses cost forward passes of their own. Where a draft pass costs a large share of the
target's step (a quantized draft of the same model, a bf16 target on a CPU without fast bf16 products),
speculating decodes slower than not, even when most guesses are accepted: on the default model with its
Q4_0 file as draft for its bf16 weights (2-vCPU Zen 4), a speculative step of 3 guesses took ~28 ms,
14.5 of them the draft's three passes, against a plain step of ~8.5 ms, and ran 0.8-1.3x from run to
run. The engine therefore times what it gets: per decode step, seconds per emitted token with guesses
(the proposal's passes plus the verifying step) and without, over the last WINDOW steps of each kind
(medians: one slow step on a shared machine does not decide). It speculates from the start; after
MIN_SAMPLES such steps a couple of plain ones give the baseline, and the verdict follows. While
speculating loses, the engine decodes plainly for a pause that doubles with each loss (8 to 256 steps),
then tries again; while it wins, every PROBE_EVERY speculative steps a couple of plain ones keep the
comparison current. Only steps that decode and prefill nothing are counted.

Outputs do not depend on it (verification is exact either way), only the speed. PERFXLM_SPEC_PAYOFF=off
speculates on every step as asked; prompt lookup (free guesses, sized by their own match) never asks.
"""

from __future__ import annotations

import os
import statistics
from collections import deque

WINDOW = 8  # steps of each kind compared
MIN_SAMPLES = 4  # speculative steps measured before a verdict
PROBE_PLAIN = 2  # plain steps that re-measure the baseline...
PROBE_EVERY = 32  # ...every this many speculative steps while speculating wins
FIRST_PAUSE = 8
MAX_PAUSE = 256


def payoff_enabled() -> bool:
    """PERFXLM_SPEC_PAYOFF: "auto" (default: weigh a costly proposer's guesses) or "off"."""
    value = os.environ.get("PERFXLM_SPEC_PAYOFF", "auto").strip().lower() or "auto"
    if value not in ("auto", "off"):
        raise ValueError(f"PERFXLM_SPEC_PAYOFF={value!r}: expected auto or off.")
    return value == "auto"


class SpeculationPayoff:
    """Decides, step by step, whether the next step carries guesses (`speculate`), from `record`ed steps."""

    def __init__(self) -> None:
        self.spec: deque[float] = deque(maxlen=WINDOW)  # seconds per token of recent speculative steps
        self.plain: deque[float] = deque(maxlen=WINDOW)  # ...and of plain ones
        self.plain_left = 0  # plain steps still to run before the next speculative one
        self.backoff = 0  # the last pause's length (doubling while speculating keeps losing)
        self.since_probe = 0  # speculative steps since the baseline was last re-measured

    def record(self, speculative: bool, seconds: float, tokens: int) -> None:
        """A decode-only step took `seconds` (with the proposal that fed it) and emitted `tokens`."""
        if tokens > 0 and seconds > 0:
            (self.spec if speculative else self.plain).append(seconds / tokens)

    def speculate(self) -> bool:
        """Whether the next step may carry guesses (called once per step, before proposing)."""
        if self.plain_left > 0:
            self.plain_left -= 1
            return False
        if len(self.spec) >= MIN_SAMPLES:
            if len(self.plain) < PROBE_PLAIN:  # no baseline yet: a few plain steps measure it
                self.plain_left = PROBE_PLAIN - 1
                return False
            if statistics.median(self.spec) > statistics.median(self.plain):  # guesses cost more than they win
                self.backoff = min(max(FIRST_PAUSE, 2 * self.backoff), MAX_PAUSE)
                self.plain_left = self.backoff - 1
                self.spec.clear()  # the next try is judged on its own steps
                self.since_probe = 0
                return False
            self.backoff = 0
        self.since_probe += 1
        if self.since_probe >= PROBE_EVERY:  # winning: re-measure the baseline now and then
            self.since_probe = 0
            self.plain_left = PROBE_PLAIN
        return True

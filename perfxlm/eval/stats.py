"""Perplexity statistics as llama.cpp's `llama-perplexity` computes them.

Per scored token the negative log-likelihood v = -log p(token | context). Over all scored tokens:
PPL = exp(mean v); its standard error = PPL * sqrt((mean v^2 - (mean v)^2) / (count - 1)), i.e. the
standard error of the mean NLL carried through exp() to first order, as perplexity.cpp prints it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable


@dataclass
class NllAccumulator:
    """Running sums of v and v^2 over scored tokens, in double precision (as llama.cpp)."""

    nll: float = 0.0
    nll2: float = 0.0
    count: int = 0

    def add(self, nlls: Iterable[float]) -> None:
        for v in nlls:
            v = float(v)
            self.nll += v
            self.nll2 += v * v
            self.count += 1

    def ppl(self) -> float:
        """The running estimate llama.cpp prints after each chunk: exp(mean NLL so far)."""
        return math.exp(self.nll / self.count) if self.count else math.nan

    def final(self) -> tuple[float, float]:
        """(PPL, its standard error); the error is NaN where llama.cpp prints no estimate (fewer than two
        tokens, or a variance that is not positive)."""
        return final_estimate(self.nll, self.nll2, self.count)


def final_estimate(nll_sum: float, nll2_sum: float, count: int) -> tuple[float, float]:
    if count < 1:
        raise ValueError("no token was scored: perplexity is undefined.")
    mean = nll_sum / count
    ppl = math.exp(mean)
    var = nll2_sum / count - mean * mean
    if count < 2 or not var > 0:
        return ppl, math.nan
    return ppl, math.sqrt(var / (count - 1)) * ppl


def format_chunk_estimates(estimates: Iterable[float], start: int = 1) -> str:
    """llama.cpp's running line: `[1]12.3456,[2]11.9876,`."""
    return "".join(f"[{i}]{p:.4f}," for i, p in enumerate(estimates, start))


def format_final(ppl: float, stderr: float) -> str:
    """llama.cpp's last line, `Final estimate: PPL = %.4lf +/- %.5lf`."""
    if math.isnan(stderr):
        return "Unexpected negative standard deviation of log(prob)"
    return f"Final estimate: PPL = {ppl:.4f} +/- {stderr:.5f}"

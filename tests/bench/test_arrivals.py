"""Request arrival schedule: Poisson / gamma gaps, and the dispatcher keeping to the schedule."""

from __future__ import annotations

import asyncio
import math
import time

import numpy as np
import pytest

from perfxlm.bench.serve import arrival_intervals, arrival_offsets, dispatch


@pytest.mark.parametrize("rate, burstiness", [(4.0, 1.0), (10.0, 0.5), (2.0, 4.0)])
def test_gap_distribution(rate, burstiness):
    gaps = arrival_intervals(40_000, rate, burstiness, seed=1)
    assert gaps.min() >= 0
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    # gamma(k, theta): coefficient of variation 1/sqrt(k); 1 for Poisson arrivals (exponential gaps)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_poisson_counts():
    """Arrivals of a Poisson process: counts per unit window have mean = variance = rate."""
    rate = 5.0
    times = arrival_offsets(50_001, rate, 1.0, seed=3)
    counts = np.bincount(times.astype(int))[:-1]  # drop the last, partial window
    assert counts.mean() == pytest.approx(rate, rel=0.03)
    assert counts.var() == pytest.approx(rate, rel=0.08)


def test_schedule_shape_and_seed():
    offsets = arrival_offsets(5, 2.0, seed=7)
    assert offsets[0] == 0.0 and len(offsets) == 5 and np.all(np.diff(offsets) >= 0)
    assert np.array_equal(offsets, arrival_offsets(5, 2.0, seed=7))
    assert not np.array_equal(offsets, arrival_offsets(5, 2.0, seed=8))
    assert np.array_equal(arrival_offsets(4, math.inf), np.zeros(4))
    assert len(arrival_offsets(1, 3.0)) == 1 and len(arrival_offsets(0, 3.0)) == 0
    for rate, b in ((0.0, 1.0), (-1.0, 1.0), (1.0, 0.0)):
        with pytest.raises(ValueError):
            arrival_intervals(3, rate, b)


def test_dispatch_keeps_to_the_schedule():
    """40 launches at 100 req/s (about 0.4 s): each starts within a few ms of its offset, no drift."""
    offsets = arrival_offsets(40, 100.0, 1.0, seed=0)
    launched: list[float] = []

    async def launch(i):
        launched.append(time.perf_counter())
        await asyncio.sleep(0.01)  # requests overlap, as real ones do
        return i

    async def main():
        start = time.perf_counter()
        out = await dispatch(range(40), offsets, launch)
        return start, out

    start, out = asyncio.run(main())
    assert out == list(range(40))
    errors = np.asarray(launched) - start - offsets
    assert errors.min() > -0.002  # never early
    assert np.median(errors) < 0.01 and errors.max() < 0.05  # late only by scheduling noise
    assert abs(errors[-1]) < 0.05  # absolute times: the error does not accumulate

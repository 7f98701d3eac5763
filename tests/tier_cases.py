"""The lower tiers' kernel runs (tests/unit/test_portable_kernels.py) on fewer repeated cases.

The CPU's own tier runs every kernel test's full parametrization. Each lower tier then runs the same
test files again in a pytest of its own (three on an AVX-512 CPU: scalar, AVX2, AVX512-VNNI), and most of
that time went to cross products: a test parametrized over formats x row counts x bias runs every
combination, although a kernel's code paths are chosen by one or two of those values at a time (the
format's loop, the row count's GEMV / slab path, the bias add after either). Under TIER_RUN_ENV (set by
that runner alone) two reductions apply, and nothing else changes:

- a test with three or more parametrize axes keeps a pairwise-covering subset of its cases: every value
  of every axis, and every pair of values of any two axes, still runs at least once (so each format
  still meets each row path, each row path each bias, ...). Only combinations of three or more that a
  pair already covers are left to the CPU's own tier. Tests with one or two axes keep every case;
- a case marked `tier_independent` (a plain-torch variant of a native-against-reference test, whose
  kernel calls, if any, its native twin in the same run makes too) is left to the CPU's own tier.

The dropped cases are deselected, not skipped, and the runner still refuses any skip. Measured on an
AVX-512 CPU: 1,092 of the 2,614 kernel cases left out of each lower tier's run (test_bf16_rows_every_path
450 of 500, test_weight_only_matches_reference 136 of 272, ...); those cases took 73 s of CPU time at the
CPU's own -O3 tier (loaded machine), more in each -O1 tier build's run (the AVX2 tier's kernel tests ran
1.75x slower at -O1), so about 100+ s less per tier, three tiers a session there."""

from __future__ import annotations

import itertools
import os

TIER_RUN_ENV = "PERFXLM_TEST_TIER_RUN"
MARKER = ("tier_independent: a plain-torch variant whose kernel calls, if any, its native twin makes too; "
          "the lower tiers' runs leave it out")


def active() -> bool:
    return os.environ.get(TIER_RUN_ENV, "") == "1"


def check_build(ops) -> None:
    """A lower tier's run must test the kernels built for the tier it forces (PERFXLM_ISA), under a CPU
    plan that knows it: checked once at that run's session start (conftest), where it was a process of
    its own before the run (an import of torch and the engine, ~3 s of CPU per tier)."""
    from perfxlm.ops import cpu_plan

    tier = os.environ.get("PERFXLM_ISA")
    built = ops.compiled_isa() if ops is not None else None
    assert [built, cpu_plan.plan().isa] == [tier, tier], (
        f"the {tier} tier's run got kernels built for {built} under a plan for {cpu_plan.plan().isa}")


def _axes(item) -> list[tuple[str, ...]]:
    """The item's parametrize axes, each the argument names one decorator (or one fixture) sets."""
    axes: list[tuple[str, ...]] = []
    for mark in item.iter_markers("parametrize"):
        names = mark.args[0]
        names = tuple(n.strip() for n in names.split(",")) if isinstance(names, str) else tuple(names)
        axes.append(names)
    named = {n for axis in axes for n in axis}
    axes += [(n,) for n in item.callspec.params if n not in named]  # parametrized fixtures
    return axes


def _pairs(point: tuple) -> set[tuple]:
    return {(a, point[a], b, point[b]) for a, b in itertools.combinations(range(len(point)), 2)}


def pairwise_cover(points: list[tuple]) -> list[int]:
    """Indices of a subset of `points` (each a value per axis, hashable) in which every pair of values of two
    axes that some point has appears at least once: greedy, the point covering most uncovered pairs
    first, ties to the earlier point, so the choice is the same in every run."""
    pairs = [_pairs(p) for p in points]
    uncovered = set().union(*pairs) if pairs else set()
    chosen: list[int] = []
    while uncovered:
        best = max(range(len(points)), key=lambda i: (len(pairs[i] & uncovered), -i))
        chosen.append(best)
        uncovered -= pairs[best]
    return sorted(chosen)


def select(items) -> tuple[list, list]:
    """(kept, deselected) for a lower tier's run, in the items' order."""
    groups: dict[tuple, list] = {}
    drop: set[int] = set()
    for i, item in enumerate(items):
        if item.get_closest_marker("tier_independent") is not None:
            drop.add(i)
            continue
        callspec = getattr(item, "callspec", None)
        if callspec is None:
            continue
        axes = _axes(item)
        if len(axes) < 3:
            continue
        key = (item.path, item.cls, item.originalname, tuple(axes))
        # an axis's value by its arguments' values (callspec.indices is not a per-decorator index)
        point = tuple(repr(tuple(callspec.params[n] for n in axis)) for axis in axes)
        groups.setdefault(key, []).append((i, point))
    for members in groups.values():
        keep = {members[j][0] for j in pairwise_cover([point for _, point in members])}
        drop |= {i for i, _ in members if i not in keep}
    kept = [it for i, it in enumerate(items) if i not in drop]
    return kept, [it for i, it in enumerate(items) if i in drop]

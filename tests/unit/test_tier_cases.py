"""The lower tiers' trimmed kernel runs (tests/tier_cases.py): every value and every pair of values of two
axes kept, on the cross products and on a real run's collection."""

import itertools
import os
import subprocess
import sys

from tests import tier_cases


def _all_pairs(points):
    return set().union(*(tier_cases._pairs(p) for p in points))


def test_a_pairwise_cover_keeps_every_pair_and_is_smaller():
    for sizes in [(2, 17, 8), (3, 3, 3, 3), (7, 3, 2), (2, 2, 2), (5, 2, 4)]:
        points = list(itertools.product(*(range(s) for s in sizes)))
        chosen = tier_cases.pairwise_cover(points)
        assert _all_pairs([points[i] for i in chosen]) == _all_pairs(points)
        assert len(chosen) < len(points)
        assert chosen == tier_cases.pairwise_cover(points)  # the same in every run
    # a collection that is not a full product (some cases left out by hand) keeps the pairs it has
    points = [p for p in itertools.product(range(4), range(3), range(2)) if p[0] != p[1]]
    chosen = tier_cases.pairwise_cover(points)
    assert _all_pairs([points[i] for i in chosen]) == _all_pairs(points)


def test_a_lower_tier_run_keeps_every_pair_of_a_three_axis_test_and_drops_torch_variants():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    files = ["tests/unit/test_quant_linear_ops.py::test_weight_only_matches_reference",
             "tests/unit/test_quant_linear_ops.py::test_centred_codes_match_reference_and_their_stored_mins",
             "tests/quant/test_quant_search.py::test_search_never_worse_than_the_plain_rule"]

    def collect(tier_run: bool) -> list[str]:
        env = dict(os.environ)
        env.pop(tier_cases.TIER_RUN_ENV, None)
        if tier_run:
            env[tier_cases.TIER_RUN_ENV] = "1"
        command = [sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", *files]
        out = subprocess.run(command, env=env, cwd=root, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout[-2000:]
        return [line for line in out.stdout.splitlines() if "::" in line]

    full, trimmed = collect(False), collect(True)
    assert set(trimmed) < set(full)

    def cases(ids, name):
        # test_weight_only's ids: bias-bits-n-k-group-half-lut-rows-max_rows-bf16 (one decorator each)
        return [line.split("[", 1)[1].rstrip("]") for line in ids if f"::{name}[" in line]

    name = "test_weight_only_matches_reference"
    weight_full, weight_kept = cases(full, name), cases(trimmed, name)
    assert len(weight_kept) < len(weight_full)
    split = lambda c: c.split("-")  # noqa: E731
    axes = [(0, 1), (1, 7), (7, 10)]  # bias | the format's six values | rows, max_rows, bf16

    def points(ids):
        return {tuple(tuple(split(c)[a:b]) for a, b in axes) for c in ids}

    def pairs(ps):
        return {(a, p[a], b, p[b]) for p in ps for a, b in itertools.combinations(range(3), 2)}

    assert pairs(points(weight_kept)) == pairs(points(weight_full))
    # a two-axis test keeps every case; the torch variants of a native-against-torch test go
    assert cases(trimmed, "test_centred_codes_match_reference_and_their_stored_mins") == cases(
        full, "test_centred_codes_match_reference_and_their_stored_mins")
    search = cases(trimmed, "test_search_never_worse_than_the_plain_rule")
    assert search and all("torch" not in c for c in search)
    assert len(search) * 2 == len(cases(full, "test_search_never_worse_than_the_plain_rule"))

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


_SESSION_MARK = "=== collection ===\n"
# Collects the files twice, without and then with a lower tier's trimming; each session's exit status 0.
_COLLECT_TWICE = f"""
import os, sys, pytest
for flag in ("", "1"):
    os.environ["{tier_cases.TIER_RUN_ENV}"] = flag
    print({_SESSION_MARK!r}, end="", flush=True)
    args = ["-q", "--collect-only", "-p", "no:cacheprovider", "-p", "pytest_timeout", *sys.argv[1:]]
    code = pytest.main(args)
    sys.stdout.flush()
    if code != 0:
        sys.exit(int(code))
"""


def test_a_lower_tier_run_keeps_every_pair_of_a_three_axis_test_and_drops_torch_variants():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    files = ["tests/unit/test_quant_linear_ops.py::test_weight_only_matches_reference",
             "tests/unit/test_quant_linear_ops.py::test_centred_codes_match_reference_and_their_stored_mins",
             "tests/quant/test_quant_search.py::test_search_never_worse_than_the_plain_rule"]

    # Both collections in one process, as two pytest sessions one after the other (the trimming is read from
    # the environment at each session's collection), and without the installed plugins, as the tier runs
    # themselves (tests/unit/test_portable_kernels.py): a process each with every plugin cost ~9 s of CPU
    # more (loaded) and collected the same node ids.
    env = {k: v for k, v in os.environ.items() if k != tier_cases.TIER_RUN_ENV}
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    out = subprocess.run([sys.executable, "-c", _COLLECT_TWICE, *files], env=env, cwd=root,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    _, full, trimmed = out.stdout.split(_SESSION_MARK)
    full, trimmed = ([line for line in part.splitlines() if "::" in line] for part in (full, trimmed))
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

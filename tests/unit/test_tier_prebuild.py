"""The background builder's kernel runs (tests/tier_prebuild.py): a run's result reaches its test whole,
and a run is made once, by whichever of the background and the test claims it first."""

import os
import sys
import time
from pathlib import Path

from tests import tier_prebuild

# the background process runs `python -m tests.tier_prebuild` from the repository's root (as the suite
# starts it): from a test's tmp_path the module would not be found
ROOT = str(Path(tier_prebuild.__file__).resolve().parents[1])


def _runs(*tiers: str) -> list[tuple[str, list[str], dict]]:
    # a stand-in for a tier's pytest: prints, writes to stderr, exits with a status of its own
    code = ("import sys; print('7 passed', sys.argv[1]); print('warn', file=sys.stderr); "
            "sys.exit(len(sys.argv[1]) % 2)")
    return [(t, [sys.executable, "-c", code, t], dict(os.environ)) for t in tiers]


def test_a_run_made_in_the_background_reaches_its_test(tmp_path):
    status = tmp_path / "status"
    background = tier_prebuild.start(False, [], None, ROOT, status, _runs("ab", "abc"))
    try:
        # the tests come when the background has claimed their runs (a test that comes first runs its own)
        deadline = time.monotonic() + 120
        while not tier_prebuild._run_paths(status, "abc")[1].exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        first, second = background.run_result("ab"), background.run_result("abc")
    finally:
        background.stop()
    assert first == {"returncode": 0, "stdout": "7 passed ab\n", "stderr": "warn\n"}
    assert second["returncode"] == 1 and second["stdout"] == "7 passed abc\n"


def test_a_run_its_test_claimed_first_is_left_to_the_test(tmp_path):
    status = tmp_path / "status"
    result, claim = tier_prebuild._run_paths(status, "ab")
    assert tier_prebuild._claim(claim)  # the test got there first
    background = tier_prebuild.start(False, [], None, ROOT, status, _runs("ab", "abc"))
    try:
        assert background.run_result("ab") is None  # the caller runs it itself
        assert background.run_result("abc")["returncode"] == 1  # the next one was still made
    finally:
        background.stop()
    assert not result.exists()

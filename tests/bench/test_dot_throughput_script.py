"""benchmarks/dot_throughput.py: the generated C compiles for this CPU and times every instruction the CPU
has (a few iterations: the table's shape, not its figures)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "dot_throughput.py"


@pytest.mark.skipif(not (shutil.which("gcc") or shutil.which("cc")), reason="no C compiler on this machine")
def test_the_table_lists_what_this_cpu_has():
    out = subprocess.run([sys.executable, str(SCRIPT), "--iters", "2000"], check=True, capture_output=True,
                         text=True).stdout
    rows = [line for line in out.splitlines() if line.startswith("| v")]
    assert rows, out
    assert any("vfmadd231ps ymm" in r for r in rows) or any("zmm" in r for r in rows), out  # every tier has one
    for row in rows:
        ns = float(row.split("|")[2])
        assert ns > 0, row

"""The kernels' other ISA paths, built and tested on this machine whatever its CPU: AVX2 + FMA (x86-64-v3,
what a CPU without AVX-512 runs: the GEMV kernels' 16-lane vectors as two ymm registers) and the portable
scalar loops (x86-64-v2)."""

import os
import subprocess
import sys

import pytest

from perfxlm.ops import native

KERNEL_TESTS = ["tests/unit/test_linear_ops.py", "tests/unit/test_attention_ops.py", "tests/unit/test_fused_ops.py",
                "tests/unit/test_kv_quant.py", "tests/unit/test_quant_linear_ops.py"]


@pytest.mark.slow
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64-v2"])
def test_kernels_built_without_avx512_match_references(tmp_path, march):
    if native.kernels() is None:
        pytest.skip("no compiler for the native kernels on this machine")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PERFXLM_NATIVE_MARCH=march, PERFXLM_CACHE_DIR=str(tmp_path))
    check = subprocess.run(
        [sys.executable, "-c", "from perfxlm.ops import native; assert native.kernels() is not None"],
        env=env, cwd=root, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert check.returncode == 0, check.stderr[-2000:]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_TESTS],
        env=env, cwd=root, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1]


def test_a_build_lock_left_by_a_killed_build_does_not_hang_the_next_start(tmp_path, monkeypatch):
    # torch's builder waits forever for its `lock` file to vanish; one left by a build that was killed
    # (Ctrl-C during the first start) must be cleared by the next process, not waited on.
    (tmp_path / "lock").touch()
    seen = []
    with native._build_guard(tmp_path):
        seen.append((tmp_path / "lock").exists())
    assert seen == [False]

"""The native builds a session's later tests need, started in the background when the session begins:
the shared-memory collectives (perfxlm.distributed.comm, built on the first tensor-parallel test's
ranks) and the lower tiers' builds of the kernels.

Each forced tier that the suite tests (tests/unit/test_portable_kernels.py, the export run under a lower
tier) needs its own build of the kernels: minutes of compiling, which the test that first needs it used
to spend with the rest of the suite waiting. Most of the suite leaves one of two cores idle (one Python
thread, servers waiting on sockets), so one process, at the lowest CPU priority, builds those tiers one
after the other from the session's start, into the folder the tests build into (conftest's
tier_build_env): it only takes CPU time nothing else wants, and a test that needs a tier finds it built,
or waits on the build's lock (perfxlm.ops.native._build_guard) while it finishes, or builds it itself
where the background has not reached it yet. What each tier test runs and checks is unchanged: the same
builds, with the same flags, in the same folder.

The shared-memory extension is built as the ranks build it (same key, same folder), so the first test
that starts ranks finds it built, or waits on torch's own build lock for it.

PERFXLM_TEST_TIER_PREBUILD=0 turns it off (each build is then made by the first test that needs it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

ENV = "PERFXLM_TEST_TIER_PREBUILD"
_BUILD = "from perfxlm.ops import native; import sys; sys.exit(native.kernels() is None)"
_BUILD_SHM = "from perfxlm.distributed import comm; import sys; sys.exit(comm.shm_native() is None)"


def enabled() -> bool:
    return os.environ.get(ENV, "1") not in ("0", "false", "no")


def start(shm: bool, tiers: list[str], env_of, root: str) -> subprocess.Popen | None:
    """Builds the shared-memory extension (with `shm`), then `tiers` in that order, in one background
    process at nice 19 (its own process group, so stop() ends its compilers too). `env_of(tier)` is the
    tier's build environment."""
    if not (shm or tiers) or not enabled():
        return None
    builds = ([(_BUILD_SHM, {})] if shm else []) + [(_BUILD, env_of(t)) for t in tiers]
    # each build starts at nice 19 again: hurry() raises only the one a test is waiting for
    script = "; ".join(
        f"os.setpriority(os.PRIO_PROCESS, 0, 19); subprocess.run([sys.executable, '-c', {code!r}], "
        f"env=dict(os.environ, **{env!r}), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)"
        for code, env in builds
    )
    env = dict(os.environ, **{ENV: "0"})  # a pytest started under it (none is) must not start another
    env.pop("PERFXLM_NATIVE_MARCH", None)  # as the tier tests: the tier's flags, not a raw -march
    return subprocess.Popen(
        [sys.executable, "-c", f"import os, subprocess, sys; {script}"],
        env=env, cwd=root, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip


def hurry(proc: subprocess.Popen | None) -> None:
    """A test is about to need a build: the build in progress runs at normal priority from now on (on a
    machine busy with other work a nice-19 build the test waits on would crawl). Lowering a nice value
    needs the privilege to; without it the build goes on as it was."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.setpriority(os.PRIO_PGRP, proc.pid, 0)
    except OSError:
        pass


def stop(proc: subprocess.Popen | None) -> None:
    """Ends a build still running when the session ends (a session that stopped before its tier tests);
    the builds' lock files are cleared by the next build of that folder."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

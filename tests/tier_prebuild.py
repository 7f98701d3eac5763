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
that starts ranks finds it built, or waits on its build lock.

PERFXLM_TEST_TIER_PREBUILD=0 turns it off (each build is then made by the first test that needs it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

ENV = "PERFXLM_TEST_TIER_PREBUILD"
SHM = "shm"
_BUILD = {
    "kernels": "from perfxlm.ops import native; import sys; sys.exit(native.kernels() is None)",
    SHM: "from perfxlm.distributed import comm; import sys; sys.exit(comm.shm_native() is None)",
}


def enabled() -> bool:
    return os.environ.get(ENV, "1") not in ("0", "false", "no")


class Prebuild:
    """The background process (its own process group, so stop() ends its compilers too) and the file it
    names its current build in."""

    def __init__(self, proc: subprocess.Popen, status: Path) -> None:
        self.proc, self.status = proc, status

    def hurry(self, name: str) -> None:
        """A test is about to need build `name` (SHM or a tier): if it is the one in progress, it runs at
        normal priority from now on (on a machine busy with other work, a nice-19 build that a test waits
        on would crawl). Lowering a nice value needs the privilege to; without it the build goes on as
        it was. Each next build starts at nice 19 again."""
        if self.proc.poll() is not None:
            return
        try:
            if self.status.read_text() != name:
                return
            os.setpriority(os.PRIO_PGRP, self.proc.pid, 0)
        except OSError:
            pass

    def stop(self) -> None:
        """Ends a build still running when the session ends (a session that stopped before the tests that
        needed it); the build's lock is cleared by the next build of that folder."""
        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()


def start(shm: bool, tiers: list[str], env_of, root: str, status: Path) -> Prebuild | None:
    """Builds the shared-memory extension (with `shm`), then `tiers` in that order; `env_of(tier)` is the
    tier's build environment."""
    if not (shm or tiers) or not enabled():
        return None
    builds = ([(SHM, "shm", {})] if shm else []) + [(t, "kernels", env_of(t)) for t in tiers]
    env = dict(os.environ, **{ENV: "0"})  # a pytest started under it (none is) must not start another
    env.pop("PERFXLM_NATIVE_MARCH", None)  # as the tier tests: the tier's flags, not a raw -march
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.tier_prebuild", str(status), json.dumps(builds)],
        env=env, cwd=root, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    return Prebuild(proc, status)


def _main(status: str, builds: str) -> None:
    for name, kind, env in json.loads(builds):
        os.setpriority(os.PRIO_PROCESS, 0, 19)  # back to the lowest after a hurried build
        Path(status).write_text(name)
        subprocess.run([sys.executable, "-c", _BUILD[kind]], env=dict(os.environ, **env),
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    Path(status).write_text("")


if __name__ == "__main__":
    _main(*sys.argv[1:3])

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

Once every tier is built, the same process runs each tier's kernel tests (the inner pytest of
tests/unit/test_portable_kernels.py, its command and environment from tests/tier_cases.py), still at the
lowest priority, and keeps each run's exit status and output for the test, which then only checks them:
in a quiet 2-core CI run those three runs (31-41 s each) no longer hold the suite. A run is claimed by
whichever of the background and the test gets to it first (an O_EXCL file), so none runs twice; the test
that finds its run in progress raises it to normal priority and waits for it.

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
import time
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

    def run_result(self, tier: str) -> dict | None:
        """The result of `tier`'s kernel run ({returncode, stdout, stderr}) made in the background, waited
        for if it is in progress; None where the caller is to run it itself (the background had not
        reached it: the caller's claim keeps the background from starting it too; or it ended without
        one)."""
        result, claim = _run_paths(self.status, tier)
        while True:
            if result.exists():
                return json.loads(result.read_text())
            if _claim(claim):
                return None
            if self.proc.poll() is not None and not result.exists():
                return None
            self.hurry(_run_name(tier))
            time.sleep(0.2)

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


def _run_name(tier: str) -> str:
    return f"run:{tier}"


def _run_paths(status: Path, tier: str) -> tuple[Path, Path]:
    """(the run's result file, its claim file), beside the status file."""
    return status.with_name(f"tier_run_{tier}.json"), status.with_name(f"tier_run_{tier}.claimed")


def _claim(path: Path) -> bool:
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def start(shm: bool, tiers: list[str], env_of, root: str, status: Path,
          runs: list[tuple[str, list[str], dict]] = ()) -> Prebuild | None:  # fmt: skip
    """Builds the shared-memory extension (with `shm`), then `tiers` in that order; `env_of(tier)` is the
    tier's build environment. Then each of `runs`, (tier, command, environment) of a tier's kernel run
    (tests/tier_cases.py), in that order."""
    if not (shm or tiers or runs) or not enabled():
        return None
    builds = ([(SHM, "shm", {})] if shm else []) + [(t, "kernels", env_of(t)) for t in tiers]
    builds += [(_run_name(t), "run", env, argv) for t, argv, env in runs]
    env = dict(os.environ, **{ENV: "0"})  # a pytest started under it (none is) must not start another
    env.pop("PERFXLM_NATIVE_MARCH", None)  # as the tier tests: the tier's flags, not a raw -march
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.tier_prebuild", str(status), json.dumps(builds)],
        env=env, cwd=root, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    return Prebuild(proc, status)


def _main(status: str, builds: str) -> None:
    for name, kind, env, *argv in json.loads(builds):
        os.setpriority(os.PRIO_PROCESS, 0, 19)  # back to the lowest after a hurried build
        if kind == "run":
            tier = name.split(":", 1)[1]
            result, claim = _run_paths(Path(status), tier)
            if not _claim(claim):
                continue  # its test got there first and runs it
            Path(status).write_text(name)
            try:  # the whole environment, as the test passes it (tier_cases.run_env)
                run = subprocess.run(argv[0], env=env, capture_output=True, text=True, timeout=1200)
                out = {"returncode": run.returncode, "stdout": run.stdout, "stderr": run.stderr}
            except subprocess.TimeoutExpired as exc:
                out = {"returncode": -1, "stdout": str(exc.stdout or ""), "stderr": f"timed out: {exc}"}
            partial = result.with_suffix(".part")
            partial.write_text(json.dumps(out))
            partial.rename(result)  # whole or not there
            continue
        Path(status).write_text(name)
        subprocess.run([sys.executable, "-c", _BUILD[kind]], env=dict(os.environ, **env),
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    Path(status).write_text("")


if __name__ == "__main__":
    _main(*sys.argv[1:3])

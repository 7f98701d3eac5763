"""Several command lines of the CLI run in one fresh process, for the tests of its refusals.

Each refusal a test checks (a missing file, a bad option) is a whole `perfxlm ...` command line whose
exit status and stderr are checked. A process per command line spends most of its seconds starting
Python and importing torch and the engine, the same for each; here one process runs every command line
through the CLI's own `main(argv)` (what `python -m perfxlm.entrypoints.cli` runs and passes to
sys.exit), each with its own stdout and stderr captured, and an argparse refusal's SystemExit taken as
its exit status. Still a process of its own, not pytest's: main() freezes the garbage collector, as a
command's process may."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

_DRIVER = """
import contextlib, io, json, sys, traceback
from perfxlm.entrypoints.cli import main
results = []
for argv, stdin in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    sys.stdin = io.StringIO(stdin or "")  # what a user types (the chat), else an empty input
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's refusals
            code = exc.code
        except Exception:  # a crash fails its own command line, not the ones after it
            traceback.print_exc()
            code = 1
    results.append([code, out.getvalue(), err.getvalue()])
sys.__stdout__.write("\\n" + json.dumps(results) + "\\n")
"""


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


def run_cli_cases(
    *argvs: list[str], timeout: float = 300, stdin: dict[int, str] | None = None
) -> list[Result]:
    """One Result per command line (the arguments after `perfxlm`), in order; `stdin` maps a command
    line's index to the text it reads as typed input."""
    cases = [[list(a), (stdin or {}).get(i)] for i, a in enumerate(argvs)]
    run = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps(cases)],
                         capture_output=True, text=True, timeout=timeout,
                         env={"TQDM_DISABLE": "1", **os.environ})  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return [Result(int(code or 0), out, err) for code, out, err in json.loads(run.stdout.splitlines()[-1])]

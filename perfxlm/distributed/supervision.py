"""Child processes the engine depends on (tensor-parallel workers, data-parallel replicas): started,
watched and stopped one way, talking in typed messages.

Each child runs `child_main` around its own body: it ignores Ctrl-C (the engine handles it), exits when
the engine's process goes away (its parent changes), and reports any failure as a `Failed` message
before it exits, so the engine can say why. Messages are frozen dataclasses pickled whole on a duplex
pipe (`Channel`); the ones every child speaks are here (`Ready`, `Failed`, `Stop`, `StatsQuery` /
`Stats`), each kind of child adds its own (`executor/worker_messages.py`, `engine/replica_messages.py`).

The engine's side is a `Supervisor`: it spawns the children, watches every pipe and process sentinel
together (a message from a child is read before its exit is noticed: one that failed said why first),
and on any failure (a `Failed` message, a process that ended, a reply that did not come in time) kills
every child and raises `WorkerDiedError` now and on every later call. `shutdown` (also run when the
supervisor is collected) sends `Stop`, then terminates and kills what remains. A leaf: it imports
nothing of the package, so the executors and the engine can both build on it.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import sys
import threading
import time
import traceback
import types
import weakref
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any, Callable, Iterator, NoReturn

logger = logging.getLogger("perfxlm")


class WorkerDiedError(RuntimeError):
    """A child process the engine depends on died, hung or failed: the engine cannot go on."""


# ---- messages every child speaks -------------------------------------------------------------
@dataclass(frozen=True)
class Ready:
    """Child -> engine, once its model is loaded: what the engine needs to know of it."""

    info: dict[str, Any]


@dataclass(frozen=True)
class Failed:
    """Child -> engine, before it exits: why (the exception and its traceback)."""

    text: str


@dataclass(frozen=True)
class Stop:
    """Engine -> child: finish and exit."""


@dataclass(frozen=True)
class StatsQuery:
    """Engine -> child: answer with `Stats` between two steps."""


@dataclass(frozen=True)
class Stats:
    """Child -> engine: counters of what the child ran (e.g. `fused_decode_steps`)."""

    values: dict[str, int] = field(default_factory=dict)


class Channel:
    """One end of a child's pipe: messages pickled whole (one `send_bytes` each)."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def send(self, msg: Any) -> None:
        self.conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

    def send_bytes(self, payload: bytes) -> None:
        """An already pickled message (one pickling for several children)."""
        self.conn.send_bytes(payload)

    def recv(self) -> Any:
        return pickle.loads(self.conn.recv_bytes())

    def poll(self) -> bool:
        return self.conn.poll()

    def close(self) -> None:
        self.conn.close()


def encode(msg: Any) -> bytes:
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


# ---- the child's side ---------------------------------------------------------------------
def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(3)  # the engine is gone: nobody will read our results or stop us


def child_main(label: str, body: Callable[..., None], conn: Any, parent_pid: int, *args: Any) -> None:
    """The frame every child runs in: `body(channel, *args)` returns when told to `Stop`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True, name="perfxlm-parent-watch").start()
    channel = Channel(conn)
    try:
        body(channel, *args)
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass  # the engine went away or stopped us
    except BaseException as exc:
        text = f"{label}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        try:
            channel.send(Failed(text))
        except Exception:
            print(text, file=sys.stderr, flush=True)
        os._exit(1)
    os._exit(0)  # no interpreter teardown: nothing left to flush, and no atexit wait on a process group


# ---- the engine's side --------------------------------------------------------------------
@contextlib.contextmanager
def _without_main_module() -> Iterator[None]:
    """Spawned children need nothing from the caller's script: hide it while they start, so that they do
    not run it again (a script calling LLM(..., tensor_parallel_size=2) needs no __main__ guard)."""
    real = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = real


def _stop_children(procs: list[Any], channels: list[Channel], scratch: str | None) -> None:
    for channel in channels:
        try:
            channel.send(Stop())
        except Exception:
            pass
    deadline = time.monotonic() + 5
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(2)
        if p.is_alive():
            p.kill()
            p.join(2)
    for channel in channels:
        channel.close()
    if scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)


class Supervisor:
    """N spawned children running `body(channel, *args[i])`, named `what i` in errors and `name_prefix i`
    as processes. `scratch`: a folder removed when the children are stopped."""

    def __init__(
        self, what: str, name_prefix: str, body: Callable[..., None], args: list[tuple], scratch: str | None = None
    ) -> None:
        self.what = what
        self.dead: str | None = None
        self.procs: list[Any] = []
        self.channels: list[Channel] = []
        self._held: list[tuple[int, Any]] = []  # received, not yet asked for (`expect`)
        self._finalizer = weakref.finalize(self, _stop_children, self.procs, self.channels, scratch)
        ctx = mp.get_context("spawn")
        for i, child_args in enumerate(args):
            parent, child = ctx.Pipe(duplex=True)
            p = ctx.Process(target=child_main, name=f"{name_prefix}{i}", daemon=True,
                            args=(f"{what} {i}", body, child, os.getpid(), *child_args))  # fmt: skip
            with _without_main_module():
                p.start()
            child.close()
            self.procs.append(p)
            self.channels.append(Channel(parent))

    def __len__(self) -> int:
        return len(self.procs)

    # ---- sending -----------------------------------------------------------------------------
    def send(self, i: int, msg: Any) -> None:
        self.send_bytes(i, encode(msg))

    def send_bytes(self, i: int, payload: bytes) -> None:
        self.check()
        try:
            self.channels[i].send_bytes(payload)
        except OSError as exc:
            self.fail(f"sending to {self.what} {i} failed: {exc}")

    def broadcast(self, msg: Any) -> None:
        payload = encode(msg)
        for i in range(len(self)):
            self.send_bytes(i, payload)

    # ---- receiving ---------------------------------------------------------------------------
    def receive(self, timeout: float | None) -> list[tuple[int, Any]]:
        """(child, message) for every message that arrived within `timeout` seconds (None: until one
        does), in the children's order. A `Failed` message or a child's exit fails the supervisor."""
        self.check()
        sentinels = {p.sentinel: i for i, p in enumerate(self.procs)}
        conns = {id(c.conn): i for i, c in enumerate(self.channels)}
        while True:
            ready = wait([c.conn for c in self.channels] + list(sentinels), timeout=1.0 if timeout is None else timeout)
            got: list[tuple[int, Any]] = []
            for obj in ready:  # pipes first: a child that failed said why before it exited
                i = conns.get(id(obj))
                if i is None:
                    continue
                channel = self.channels[i]
                while channel.poll():
                    try:
                        msg = channel.recv()
                    except (EOFError, OSError):
                        break  # closed: its sentinel tells the rest
                    if isinstance(msg, Failed):
                        self.fail(msg.text)
                    got.append((i, msg))
            for obj in ready:
                i = sentinels.get(obj)
                if i is not None:
                    p = self.procs[i]
                    p.join(0.1)
                    self.fail(f"{self.what} {i} (pid {p.pid}) died with exit code {p.exitcode}")
            if got or timeout is not None:
                return got

    def expect(self, i: int, kind: type, timeout: float | None) -> Any:
        """Child i's next message, which must be a `kind`. Other children's messages that arrive meanwhile
        are held for their own `expect` (set-up: children answer in any order)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            for n, (j, msg) in enumerate(self._held):
                if j == i:
                    del self._held[n]
                    if not isinstance(msg, kind):
                        self.fail(f"unexpected message {type(msg).__name__} from {self.what} {j}")
                    return msg
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._held.extend(self.receive(1.0 if left is None else min(left, 1.0)))
            if deadline is not None and time.monotonic() >= deadline and all(j != i for j, _ in self._held):
                self.fail(f"{self.what} {i} did not answer within {timeout} s")

    # ---- health ------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise if a child has failed."""
        if self.dead is not None:
            raise WorkerDiedError(self.dead)

    def check_health(self) -> None:
        """Raise if a child has failed or its process has ended."""
        self.check()
        for i, p in enumerate(self.procs):
            if not p.is_alive():
                self.fail(f"{self.what} {i} (pid {p.pid}) died with exit code {p.exitcode}")

    def fail(self, why: str) -> NoReturn:
        """Mark every child lost (killed: the others may wait for the lost one in a collective, no graceful
        stop), then raise."""
        if self.dead is None:
            self.dead = why
            logger.error("%s: %s", self.what, why)
            for p in self.procs:
                if p.is_alive():
                    p.kill()
            self.shutdown()
        raise WorkerDiedError(self.dead)

    def shutdown(self) -> None:
        self._finalizer()

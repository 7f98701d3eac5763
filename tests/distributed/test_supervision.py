"""The supervision module tensor-parallel workers and data-parallel replicas run under: typed messages,
and a child that fails, dies or goes silent ends the group with an error naming it, within seconds,
leaving no process behind."""

from __future__ import annotations

import os
import time

import pytest

from perfxlm.distributed.supervision import Ready, Stats, StatsQuery, Supervisor, WorkerDiedError
from tests.distributed.supervised_children import echo

pytestmark = pytest.mark.timeout(180)


def _gone(pids: list[int], timeout: float = 10.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            return True
        time.sleep(0.1)
    return False


def _start(*hows: str) -> tuple[Supervisor, list[int]]:
    group = Supervisor("test child", "perfxlm-test", echo, [(i, how) for i, how in enumerate(hows)])
    infos = [group.expect(i, Ready, timeout=120).info for i in reversed(range(len(hows)))]  # any order
    assert sorted(i["index"] for i in infos) == list(range(len(hows)))
    return group, [i["pid"] for i in infos]


def test_children_answer_typed_messages_and_stop():
    group, pids = _start("ok", "ok")
    group.broadcast(StatsQuery())
    assert [group.expect(i, Stats, timeout=30).values for i in range(2)] == [{"index": 0}, {"index": 1}]
    group.check_health()
    group.shutdown()
    assert _gone(pids)
    assert [p.exitcode for p in group.procs] == [0, 0]  # stopped, not killed


@pytest.mark.parametrize("how, says", [("raises", "RuntimeError: child 1 cannot count"),
                                       ("dies", "test child 1 \\(pid \\d+\\) died with exit code 7"),
                                       ("silent", "test child 1 did not answer within 2 s")])
def test_a_failing_child_ends_the_group_with_its_reason(how, says):
    group, pids = _start("ok", how)
    group.send(1, StatsQuery())
    t0 = time.time()
    with pytest.raises(WorkerDiedError, match=says):
        group.expect(1, Stats, timeout=2)
    assert time.time() - t0 < 10
    with pytest.raises(WorkerDiedError, match=says):  # every later call says the same
        group.send(0, StatsQuery())
    with pytest.raises(WorkerDiedError):
        group.check_health()
    assert _gone(pids)  # the healthy child was killed with it

"""Bodies for test_supervision's children (spawned processes import them from here)."""

from __future__ import annotations

import os
import time

from perfxlm.distributed.supervision import Ready, Stats, StatsQuery, Stop


def echo(channel, index: int, how: str) -> None:
    """Ready, then: answer StatsQuery (`ok`), raise at the first query (`raises`), exit with code 7 at the
    first query (`dies`), or never answer (`silent`); Stop ends it."""
    channel.send(Ready({"index": index, "pid": os.getpid()}))
    while True:
        msg = channel.recv()
        if isinstance(msg, Stop):
            return
        if isinstance(msg, StatsQuery):
            if how == "raises":
                raise RuntimeError(f"child {index} cannot count")
            if how == "dies":
                os._exit(7)
            if how == "silent":
                time.sleep(60)
            channel.send(Stats({"index": index}))

"""Blocking work a request waits for (templates, tokenizing, grammar compiles, adapter loads), run on
a thread pool so the HTTP event loop keeps answering."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any


async def run_off_loop(fn: Callable[..., Any], *args: Any, executor: Executor | None = None, **kwargs: Any) -> Any:
    """fn(*args, **kwargs) on `executor` (the loop's default pool when None), awaited.

    A StopIteration escaping fn comes back as a RuntimeError: asyncio cannot hand StopIteration to
    the awaiting future (it logs a TypeError and leaves the future pending), so the request awaiting
    it would wait forever, counted in flight, long after its client went away."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(executor, functools.partial(_no_stop_iteration, fn, args, kwargs))


def _no_stop_iteration(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    try:
        return fn(*args, **kwargs)
    except StopIteration as exc:
        name = getattr(fn, "__qualname__", repr(fn))
        raise RuntimeError(f"{name} raised StopIteration") from exc

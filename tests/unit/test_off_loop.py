import asyncio

import pytest

from perfxlm.entrypoints.openai.off_loop import run_off_loop


def test_stop_iteration_off_loop_is_an_error_not_a_hang():
    """asyncio cannot set StopIteration on a future: without the conversion the awaiting request
    never resumes (asyncio only logs a TypeError)."""

    async def main():
        assert await run_off_loop(lambda a, b=0: a + b, 2, b=3) == 5
        with pytest.raises(RuntimeError, match="StopIteration"):
            await asyncio.wait_for(run_off_loop(next, iter(())), timeout=10)
        with pytest.raises(ValueError, match="bad"):
            await run_off_loop(int, "bad")

    asyncio.run(main())

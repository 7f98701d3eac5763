"""Failure injection for the threaded engine: whatever fails, every caller learns it within a second,
and what belongs to one request ends that request only."""

import asyncio
import threading
import time

import pytest

from perfxlm import AsyncLLM, EngineConfig, SamplingParams
from perfxlm.engine.handle import RequestHandle
from perfxlm.engine.threaded_engine import EngineDeadError
from perfxlm.sampling_params import RequestOutputKind

LONG = SamplingParams(temperature=0, max_tokens=800, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _prompt(i):
    return {"prompt_token_ids": [3 + i, 50, 70 + i, 9, 11]}


@pytest.fixture
def engine(tiny_llama):
    llm = AsyncLLM(EngineConfig(model=tiny_llama, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=256,
                                max_model_len=1024))
    yield llm.engine
    llm.shutdown()


def _handle(engine, rid, i, params=LONG):
    h = RequestHandle(engine, rid)
    params = params.clone()
    params.output_kind = RequestOutputKind.CUMULATIVE
    engine.add_request(rid, _prompt(i), params, h._sink)
    return h


class Callers:
    """Three kinds of waiting callers on one engine: handle.sync(), handle.queue.get() and an async
    generate() in its own event loop; each records when it saw an error."""

    def __init__(self, engine):
        self.errors: dict[str, tuple[float, BaseException]] = {}
        self.started = threading.Barrier(4)
        self.threads = [threading.Thread(target=f, args=(engine,), daemon=True)
                        for f in (self._sync, self._queue, self._async)]
        for t in self.threads:
            t.start()
        self.started.wait(30)

    def _record(self, name, exc):
        self.errors[name] = (time.monotonic(), exc)

    def _sync(self, engine):
        h = _handle(engine, "sync", 0)
        h.queue.get(timeout=30)
        self.started.wait()
        try:
            h.sync(timeout=60)
        except BaseException as exc:
            self._record("sync", exc)

    def _queue(self, engine):
        h = _handle(engine, "queue", 1)
        h.queue.get(timeout=30)
        self.started.wait()
        while True:
            update = h.queue.get(timeout=60)
            if update.error is not None:
                assert update.finished
                self._record("queue", update.error)
                return
            if update.finished:
                return

    def _async(self, engine):
        async def consume():
            llm = AsyncLLM.__new__(AsyncLLM)
            llm.engine = engine
            first = True
            try:
                async for _ in llm.generate(_prompt(2), LONG, request_id="async"):
                    if first:
                        first = False
                        await asyncio.get_running_loop().run_in_executor(None, self.started.wait)
            except BaseException as exc:
                self._record("async", exc)

        asyncio.run(consume())

    def assert_all_learnt(self, since, kind=BaseException):
        for t in self.threads:
            t.join(10)
        assert sorted(self.errors) == ["async", "queue", "sync"], self.errors
        for name, (when, exc) in self.errors.items():
            assert isinstance(exc, kind), (name, exc)
            assert when - since < 1.0, f"{name} learnt it after {when - since:.2f} s"


def _assert_dead(engine):
    with pytest.raises(EngineDeadError):
        engine.check_health()
    with pytest.raises(EngineDeadError):
        engine.add_request("late", _prompt(5), SHORT, lambda item: None)


def test_a_step_that_raises_marks_the_engine_dead_and_every_caller_learns_it(engine):
    callers = Callers(engine)
    fired = []
    real_step = engine.core.step
    since = time.monotonic()

    def failing_step():
        fired.append(time.monotonic())
        raise RuntimeError("injected step failure")

    engine.core.step = failing_step
    callers.assert_all_learnt(since, EngineDeadError)
    assert fired
    assert isinstance(callers.errors["sync"][1].__cause__, RuntimeError)
    _assert_dead(engine)
    engine.core.step = real_step


def test_output_processing_that_raises_marks_the_engine_dead(engine):
    callers = Callers(engine)
    fired = []

    def failing_process(outputs):
        fired.append(time.monotonic())
        raise RuntimeError("injected output failure")

    since = time.monotonic()
    engine.output_processor.process = failing_process
    callers.assert_all_learnt(since, EngineDeadError)
    assert fired
    _assert_dead(engine)


def test_an_engine_wide_command_that_raises_marks_the_engine_dead(engine):
    callers = Callers(engine)
    fired = []

    def failing_finish(*args):
        fired.append(time.monotonic())
        raise RuntimeError("injected command failure")

    engine.core.finish_requests = failing_finish
    since = time.monotonic()
    engine.add_request("victim", _prompt(4), LONG, lambda item: None)
    engine.abort("victim")  # its "finish" command raises in the core thread
    callers.assert_all_learnt(since, EngineDeadError)
    _assert_dead(engine)


def test_a_command_for_one_request_that_raises_fails_that_request_only(engine):
    real_add = engine.core.add_request

    def add(request):
        if request.request_id == "bad":
            raise ValueError("injected: this request cannot be added")
        real_add(request)

    engine.core.add_request = add
    ok = _handle(engine, "ok", 0, SHORT)
    since = time.monotonic()
    bad = _handle(engine, "bad", 1, SHORT)
    update = bad.queue.get(timeout=5)
    assert time.monotonic() - since < 1.0
    assert update.finished and isinstance(update.error, ValueError)
    with pytest.raises(ValueError, match="injected"):
        bad.sync(timeout=5)
    assert len(ok.sync(timeout=30).outputs[0].token_ids) == 6
    engine.check_health()
    assert engine.wait_idle(30) and engine.check_invariants()["used"] == 0


def test_a_sink_that_raises_ends_its_request_and_not_the_output_thread(engine):
    closed = asyncio.new_event_loop()
    closed.close()

    def dead_loop_sink(item):  # what AsyncLLM's sink does once the caller's event loop is gone
        closed.call_soon_threadsafe(print, item)

    finished = []
    real_finish = engine.core.finish_requests
    engine.core.finish_requests = lambda ids, status, reason=None: (finished.append((ids, status.name)),
                                                                    real_finish(ids, status, reason))
    engine.add_request("orphan", _prompt(0), LONG, dead_loop_sink)
    ok = _handle(engine, "ok", 1, SHORT)
    assert len(ok.sync(timeout=30).outputs[0].token_ids) == 6
    # The output thread queues the abort; the core thread applies it on its next turn, which may come
    # after "ok" has finished on a busy machine.
    deadline = time.monotonic() + 30
    while (["orphan"], "FINISHED_ABORTED") not in finished and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (["orphan"], "FINISHED_ABORTED") in finished  # nobody listens: its blocks are freed
    assert engine.wait_idle(30)
    engine.check_health()
    assert engine.check_invariants()["used"] == 0
    again = _handle(engine, "again", 2, SHORT)  # the output thread still delivers
    assert again.sync(timeout=30).finished


def test_duplicate_live_request_ids_are_refused_at_the_edge(engine):
    h = _handle(engine, "dup", 0)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", _prompt(1), SHORT, lambda item: None)
    h.stop()
    # Abort then re-add at once: the abort is applied first, the new request runs normally.
    again = _handle(engine, "dup", 1, SHORT)
    assert len(again.sync(timeout=30).outputs[0].token_ids) == 6
    assert engine.wait_idle(30) and engine.check_invariants()["used"] == 0


def test_check_health_sees_every_engine_thread(engine):
    engine.check_health()
    engine._outputs.put(None)  # the output thread ends as if it had died
    engine._output_thread.join(5)
    with pytest.raises(EngineDeadError):
        engine.check_health()
    with pytest.raises(EngineDeadError):
        engine.add_request("late", _prompt(0), SHORT, lambda item: None)


def test_shutdown_is_not_death_but_refuses_new_requests(engine):
    h = _handle(engine, "running", 0)
    engine.shutdown()
    assert h.sync(timeout=5).outputs[0].finish_reason == "abort"
    with pytest.raises(EngineDeadError, match="shut down"):
        engine.add_request("late", _prompt(0), SHORT, lambda item: None)

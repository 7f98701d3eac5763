"""The background engine: AsyncLLM streaming, abort and cancellation, and the synchronous handle."""

import asyncio

import pytest
import torch

from perfxlm import LLM, AsyncLLM, Engine, EngineConfig, SamplingParams
from perfxlm.sampling_params import RequestOutputKind


def _ids(n, seed):
    return torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def async_tiny(tiny_llama):
    engine = AsyncLLM(EngineConfig(model=tiny_llama, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=512,
                                   max_num_seqs=128))
    yield engine
    engine.shutdown()


def _pool_whole(threaded_engine):
    assert threaded_engine.wait_idle(30)
    counts = threaded_engine.check_invariants()
    assert counts["used"] == 0, counts
    return counts


def test_abort_10_of_100_leaves_90_identical_to_solo(tiny_llama, async_tiny):
    prompts = [{"prompt_token_ids": _ids(5 + i % 23, seed=i)} for i in range(100)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    aborted = set(range(0, 100, 10))

    async def consume(i):
        outs = []
        async for out in async_tiny.generate(prompts[i], params, request_id=f"r{i}"):
            outs.append(out)
            if i in aborted and len(outs) == 2:
                await async_tiny.abort(f"r{i}")
        return outs[-1]

    async def main():
        return await asyncio.gather(*(consume(i) for i in range(100)))

    finals = asyncio.run(main())
    solo = LLM(tiny_llama, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64)
    for i, final in enumerate(finals):
        c = final.outputs[0]
        if i in aborted:
            assert c.finish_reason == "abort" and final.finished
            continue
        ref = solo.generate(prompts[i], params, use_tqdm=False)[0].outputs[0]
        assert c.token_ids == ref.token_ids and c.finish_reason == "length"
    _pool_whole(async_tiny.engine)


def test_cancelling_the_consumer_aborts_and_frees_blocks(async_tiny):
    params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)

    async def main():
        seen = []

        async def consume():
            async for out in async_tiny.generate({"prompt_token_ids": _ids(40, 1)}, params, request_id="cancel-me"):
                seen.append(out)

        task = asyncio.create_task(consume())
        while len(seen) < 3:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return seen

    seen = asyncio.run(main())
    assert 3 <= len(seen) < 500
    _pool_whole(async_tiny.engine)
    assert "cancel-me" not in async_tiny.engine.output_processor.states


def test_abort_all_ends_every_stream_and_frees_blocks(async_tiny):
    """What the server's shutdown calls: every request in flight ends with finish_reason 'abort', the
    engine stays alive and serves the next request."""
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def main():
        finals = {}

        async def consume(i):
            async for out in async_tiny.generate({"prompt_token_ids": _ids(9 + i, i)}, params, request_id=f"all{i}"):
                finals[i] = out

        tasks = [asyncio.create_task(consume(i)) for i in range(5)]
        while len(finals) < 5:
            await asyncio.sleep(0.01)
        assert async_tiny.engine.abort_all() == 5
        await asyncio.gather(*tasks)
        return finals

    finals = asyncio.run(main())
    assert all(f.finished and f.outputs[0].finish_reason == "abort" for f in finals.values())
    assert not async_tiny.errored and async_tiny.engine.abort_all() == 0
    _pool_whole(async_tiny.engine)
    out = asyncio.run(_last(async_tiny.generate({"prompt_token_ids": _ids(6, 0)},
                                                SamplingParams(max_tokens=3, ignore_eos=True))))
    assert len(out.outputs[0].token_ids) == 3


async def _last(stream):
    out = None
    async for out in stream:
        pass
    return out


def test_delta_stream_adds_up_to_cumulative(smollm_fp32, default_model):
    engine = AsyncLLM(model=default_model, dtype="float32", kv_cache_gib=0.25)
    try:
        async def run(kind):
            params = SamplingParams(temperature=0, max_tokens=20, output_kind=kind)
            return [o async for o in engine.generate("The capital of France is", params)]

        deltas = asyncio.run(run(RequestOutputKind.DELTA))
        cumulative = asyncio.run(run(RequestOutputKind.CUMULATIVE))
        final_only = asyncio.run(run(RequestOutputKind.FINAL_ONLY))
        text = "".join(o.outputs[0].text for o in deltas)
        tokens = [t for o in deltas for t in o.outputs[0].token_ids]
        assert len(deltas) > 1 and len(final_only) == 1
        assert text == cumulative[-1].outputs[0].text == final_only[0].outputs[0].text
        assert tokens == cumulative[-1].outputs[0].token_ids
        ref = smollm_fp32.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=20),
                                   use_tqdm=False)[0].outputs[0]
        assert text == ref.text
        _pool_whole(engine.engine)
    finally:
        engine.shutdown()


def test_bad_request_raises_in_caller_and_engine_keeps_serving(async_tiny):
    async def main():
        with pytest.raises(ValueError, match="vocabulary"):
            async for _ in async_tiny.generate({"prompt_token_ids": [10**6]}, SamplingParams()):
                pass
        return [o async for o in async_tiny.generate({"prompt_token_ids": [5, 6]},
                                                     SamplingParams(max_tokens=3, ignore_eos=True))]

    outs = asyncio.run(main())
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3


def test_sync_handle_queue_sync_stop_release(tiny_llama):
    engine = Engine(model=tiny_llama, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=128)
    try:
        h = engine.start_request({"prompt_token_ids": _ids(10, 2)}, SamplingParams(temperature=0, max_tokens=8,
                                                                                  ignore_eos=True))
        first = h.queue.get(timeout=30)
        assert len(first.new_token_ids) >= 1
        final = h.sync(timeout=30)
        assert final.finished and len(final.outputs[0].token_ids) == 8
        updates = [first]
        while not h.queue.empty():
            updates.append(h.queue.get_nowait())
        assert [t for u in updates for t in u.new_token_ids] == final.outputs[0].token_ids
        assert updates[-1].finished and updates[-1].finish_reason == "length"
        h.release()

        long = engine.start_request({"prompt_token_ids": _ids(10, 3)}, SamplingParams(max_tokens=400,
                                                                                     ignore_eos=True))
        long.queue.get(timeout=30)
        long.stop()
        assert long.sync(timeout=30).outputs[0].finish_reason == "abort"
        long.release()
        _pool_whole(engine.engine)
    finally:
        engine.shutdown()

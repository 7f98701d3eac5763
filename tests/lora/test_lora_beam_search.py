"""Beam search with a LoRA adapter: offline against peft's generate(num_beams=...) (no EOS in play, where
vLLM's rules and transformers' agree), and the asynchronous engine and the server (use_beam_search with
an adapter's name) giving the offline beams."""

from __future__ import annotations

import asyncio

import httpx
import torch

from perfxlm import LLM, AsyncLLM, BeamSearchParams, EngineConfig, LoRARequest
from perfxlm.entrypoints.openai.api_server import build_app
from tests.conftest import assert_pool_whole

PROMPT = [5, 17, 40, 9, 300, 2, 77]
WIDTH, NEW = 3, 6


def peft_beams(base: str, adapter: str) -> list[list[int]]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter).eval()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=WIDTH, num_return_sequences=WIDTH,
                             max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0,
                             early_stopping="never")
    return [row[len(PROMPT):] for row in out.tolist()]


def test_beam_search_with_an_adapter(lora_base, adapters):
    params = BeamSearchParams(beam_width=WIDTH, max_tokens=NEW, ignore_eos=True)
    a = LoRARequest("a", 1, adapters["a"])
    llm = LLM(lora_base, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64, enable_lora=True,
              max_loras=2, max_lora_rank=8)
    with_a = [s.tokens[len(PROMPT):] for s in
              llm.beam_search([{"prompt_token_ids": PROMPT}], params, lora_request=a)[0].sequences]
    base = [s.tokens[len(PROMPT):] for s in llm.beam_search([{"prompt_token_ids": PROMPT}], params)[0].sequences]
    assert with_a == peft_beams(lora_base, adapters["a"]) and with_a != base
    assert_pool_whole(llm)
    del llm

    engine = AsyncLLM(EngineConfig(model=lora_base, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64,
                                   enable_lora=True, max_loras=2, max_lora_rank=8))
    try:
        async def offline_async():
            return [out async for out in engine.beam_search({"prompt_token_ids": PROMPT}, "b", params, a)]

        (out,) = asyncio.run(offline_async())
        assert [c.token_ids for c in out.outputs] == with_a

        app = build_app(engine, "tiny", lora_modules=[("a", adapters["a"], None)])

        async def over_http():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
                body = {"prompt": PROMPT, "max_tokens": NEW, "n": WIDTH, "temperature": 0, "ignore_eos": True,
                        "use_beam_search": True, "logprobs": 0}
                return [await client.post("/v1/completions", json={**body, "model": m}) for m in ("a", "tiny")]

        for r, want in zip(asyncio.run(over_http()), (with_a, base)):
            assert r.status_code == 200, r.text
            # without a tokenizer the logprob tokens are the ids themselves
            assert [[int(t) for t in c["logprobs"]["tokens"]] for c in r.json()["choices"]] == want
        assert engine.engine.wait_idle(30)
        assert engine.engine.check_invariants()["used"] == 0
    finally:
        engine.shutdown()

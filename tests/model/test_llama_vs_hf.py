"""Llama against Hugging Face transformers: token-exact greedy output in float32, close logits in bf16."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from perfxlm import LLM, SamplingParams
from tests.conftest import assert_pool_whole, make_llama_checkpoint

NEW_TOKENS = 64


def hf_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )
    return out[0, len(prompt_ids):].tolist()


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # GQA 6:2, tied embeddings
        {  # Llama-3 rope scaling, untied head, explicit head_dim
            "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
            "tie_word_embeddings": False, "head_dim": 32, "num_key_value_heads": 3,
        },
    ],
    ids=["gqa-tied", "llama3-rope-untied"],
)
def test_random_llama_greedy_matches_transformers(tmp_path, overrides):
    path = make_llama_checkpoint(str(tmp_path / "llama"), seed=1, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=128)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (1, 7, 33, 120)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, NEW_TOKENS)
    assert_pool_whole(llm)


def test_bf16_logits_close_to_fp32(tiny_llama):
    from perfxlm.model.loader import get_model, load_hf_config
    from perfxlm.model.forward_context import AttentionMetadata, PrefillSeq, set_forward_context
    from perfxlm.worker.model_runner import ModelRunner

    config = load_hf_config(tiny_llama)
    ids = torch.randint(3, 1000, (40,), generator=torch.Generator().manual_seed(0))
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = get_model(tiny_llama, config, dtype, "safetensors")
        ModelRunner(model, num_blocks=4, block_size=16, dtype=dtype)
        meta = AttentionMetadata(torch.arange(40), 0, None, None, None, [PrefillSeq(0, 40, 0, torch.arange(3))])
        with torch.inference_mode(), set_forward_context(meta):
            logits[dtype] = model.compute_logits(model(ids, torch.arange(40)))
    ref, got = logits[torch.float32], logits[torch.bfloat16]
    # Stated tolerance: bf16 logits within 0.1 absolute + 5 % of the fp32 logit range.
    err = (got - ref).abs().max().item()
    assert err < 0.1 + 0.05 * (ref.max() - ref.min()).item(), err
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8

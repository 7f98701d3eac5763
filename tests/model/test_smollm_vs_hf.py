"""The real default model (SmolLM2-135M-Instruct GGUF) against transformers loading the same GGUF."""

import pytest
import torch

from perfxlm import SamplingParams
from tests.conftest import assert_pool_whole

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n",
    "import numpy as np\nx = np.arange(10)\n",
    "In 1969, the first humans",
]


@pytest.fixture(scope="module")
def hf_model(default_model):
    import os

    from transformers import AutoModelForCausalLM

    kwargs = {}
    try:
        from transformers import GgufConfig  # transformers >= 5 keeps GGUF tensors packed unless asked

        kwargs["quantization_config"] = GgufConfig(gguf_file=os.path.basename(default_model), dequantize=True)
    except ImportError:
        pass
    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(default_model), gguf_file=os.path.basename(default_model), dtype=torch.float32, **kwargs
    ).eval()


def test_greedy_64_tokens_match_transformers(smollm_fp32, hf_model):
    """Each of the 64 greedy tokens is transformers' greedy choice after the same prefix: its argmax at
    every position of one forward over prompt + our tokens (the tokens its greedy generation would give,
    step by step, without its 64 incremental steps per prompt: 16-19 s of CPU each, against 1-5 s)."""
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    tok = smollm_fp32.get_tokenizer()
    prompts = [{"prompt_token_ids": tok.encode(p)} for p in PROMPTS]
    outs = smollm_fp32.generate(prompts, params, use_tqdm=False)
    for p, out in zip(prompts, outs):
        ids, got = p["prompt_token_ids"], list(out.outputs[0].token_ids)
        assert len(got) == 64
        with torch.no_grad():
            logits = hf_model(torch.tensor([ids + got])).logits[0]
        assert logits[len(ids) - 1 : -1].argmax(-1).tolist() == got, p
    assert_pool_whole(smollm_fp32)


def test_bf16_logits_within_tolerance(default_model, hf_model):
    from perfxlm.model.forward_context import AttentionMetadata, PrefillSeq, set_forward_context
    from perfxlm.model.loader import get_model, load_hf_config
    from perfxlm.worker.model_runner import ModelRunner

    config = load_hf_config(default_model)
    ids = torch.tensor(hf_model.config.vocab_size and [1] + list(range(1000, 1063)))
    n = ids.numel()
    with torch.no_grad():
        ref = hf_model(ids[None]).logits[0].float()
    model = get_model(default_model, config, torch.bfloat16, "gguf")
    ModelRunner(model, num_blocks=8, block_size=16, dtype=torch.bfloat16)
    meta = AttentionMetadata(torch.arange(n), 0, None, None, None, [PrefillSeq(0, n, 0, torch.arange(4))])
    with torch.inference_mode(), set_forward_context(meta):
        got = model.compute_logits(model(ids, torch.arange(n)))
    # Stated tolerance: bf16 logits within 5 % of the fp32 logit range (max abs error) and
    # 1.5 % on average; the top-1 token agrees on at least 90 % of positions.
    span = (ref.max() - ref.min()).item()
    err = (got - ref).abs()
    assert err.max().item() < 0.05 * span, (err.max().item(), span)
    assert err.mean().item() < 0.015 * span
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9

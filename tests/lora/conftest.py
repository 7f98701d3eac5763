"""Random-weight Llama checkpoints with PEFT adapters saved beside them (random lora_B, so each adapter
changes the output), and peft's greedy output as the reference."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import make_llama_checkpoint

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(base: str, path: str, seed: int, r: int = 4, targets=ALL_TARGETS, **lora_kwargs) -> str:
    """A PEFT adapter over `base` built by get_peft_model, A and B random (B is zero at PEFT's init)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora_kwargs.setdefault("lora_alpha", 2 * r + 1)
    peft_model = get_peft_model(model, LoraConfig(r=r, target_modules=list(targets), **lora_kwargs))
    g = torch.Generator().manual_seed(seed)
    for name, p in peft_model.named_parameters():
        if "lora_" in name:
            p.data = torch.randn(p.shape, generator=g) * 0.3
    peft_model.save_pretrained(path)
    return path


def peft_greedy(base: str, adapter: str | None, prompt: list[int], n: int) -> list[int]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="package")
def lora_base(tmp_path_factory) -> str:
    # odd sizes: 5 heads of 18 over 1 KV head, 150 MLP channels
    return make_llama_checkpoint(str(tmp_path_factory.mktemp("lora_base")), seed=3, hidden_size=90,
                                 intermediate_size=150, num_attention_heads=5, num_key_value_heads=1)


@pytest.fixture(scope="package")
def adapters(lora_base, tmp_path_factory) -> dict[str, str]:
    """a: every projection, rank 4; b: q, v and down only, rank 7, rsLoRA, a larger alpha for down_proj;
    c: MLP only, rank 3."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a": make_adapter(lora_base, str(root / "a"), seed=1),
        "b": make_adapter(lora_base, str(root / "b"), seed=2, r=7, targets=("q_proj", "v_proj", "down_proj"),
                          use_rslora=True, alpha_pattern={"down_proj": 3.0}),
        "c": make_adapter(lora_base, str(root / "c"), seed=3, r=3, targets=("gate_proj", "up_proj", "down_proj")),
    }

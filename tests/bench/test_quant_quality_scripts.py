"""The quantization-quality benchmark's building blocks: the QuaRot rotation keeps a Llama's function
(benchmarks/make_rotated_model.py), and llama.cpp's KL divergence through llama-cpp-python
(benchmarks/perplexity_llamacpp.py --kl-divergence-base / --kl-divergence) writes a base file and reads
it back with perfxlm's statistics."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_bench", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tiny_llama(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         rms_norm_eps=1e-5, tie_word_embeddings=tied, initializer_range=0.1)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():  # gains away from 1, so that folding them is exercised
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return config, model


@pytest.mark.parametrize("tied", [True, False])
def test_rotation_keeps_the_logits(tied):
    rot = _load("make_rotated_model")
    config, model = _tiny_llama(tied)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    if tied:
        state.pop("lm_head.weight", None)  # as a tied checkpoint stores it
    rotated = rot.quarot(state, seed=3)
    ids = torch.randint(0, config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(1))
    untied = copy.deepcopy(config)
    untied.tie_word_embeddings = False
    result = rot.check_same_function(config, state, untied, rotated, ids, n_new=8)
    assert result["max_abs_logit_diff"] < 1e-4
    # the rotation really moved the weights: the stream's readers and writers, and the gains are folded
    assert not torch.allclose(rotated["model.embed_tokens.weight"], state["model.embed_tokens.weight"], atol=1e-3)
    assert not torch.allclose(rotated["model.layers.0.mlp.down_proj.weight"],
                              state["model.layers.0.mlp.down_proj.weight"], atol=1e-3)  # fmt: skip
    assert all(torch.equal(v, torch.ones_like(v)) for k, v in rotated.items() if k.endswith("norm.weight"))
    assert "lm_head.weight" in rotated


def test_random_orthogonal_is_orthogonal_and_seeded():
    rot = _load("make_rotated_model")
    q = rot.random_orthogonal(48, seed=7)
    assert torch.allclose(q.T @ q, torch.eye(48, dtype=q.dtype), atol=1e-12)
    assert torch.equal(q, rot.random_orthogonal(48, seed=7))
    assert not torch.equal(q, rot.random_orthogonal(48, seed=8))


def test_llamacpp_kl_divergence_of_a_model_with_itself_is_zero(tmp_path, default_model):
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip('llama-cpp-python is not installed (pip install -e ".[llamacpp]")')
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"Sentence {i} says that the number {i * 7} follows {i * 7 - 7}." for i in range(60)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    script = [sys.executable, str(ROOT / "benchmarks" / "perplexity_llamacpp.py"), "-m", default_model,
              "--threads", "2", "--extra-buffers", "off"]  # fmt: skip
    base, out = tmp_path / "base.kld", tmp_path / "kld.json"
    subprocess.run([*script, "-f", str(text), "-c", "64", "--chunks", "2", "--kl-divergence-base", str(base)],
                   check=True, env=env, capture_output=True)  # fmt: skip
    from perfxlm.eval import kld_base

    header = kld_base.open_base(str(base)).header
    assert (header["n_ctx"], header["n_windows"], header["produced_by"]["engine"]) == (64, 2, "llama.cpp")
    run = subprocess.run([*script, "--kl-divergence-base", str(base), "--kl-divergence", "--output-json", str(out)],
                         check=True, env=env, capture_output=True, text=True)  # fmt: skip
    assert "Mean    KLD:" in run.stdout and "Same top p:" in run.stdout
    stats = json.loads(out.read_text())["statistics"]
    assert stats["n_tokens"] == 2 * 31
    assert abs(stats["kld_mean"]["value"]) < 1e-5  # only the base file's 16-bit storage differs
    assert stats["same_top"]["value"] == 1.0

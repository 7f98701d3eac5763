"""What an export holds while it writes: the model loaded as the engine loads it, but never run (no
huge-page arena, no bf16 panels with a tied head's own packed copy), and a bf16 checkpoint the engine holds
in float32 kept in bf16 and widened as each matrix is written. The graph is the same, byte for byte; the
peak of a subprocess's anonymous memory stays under 1.5x the checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
import torch

from perfxlm import LLM, SamplingParams
from perfxlm.export.package import export_onnx

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.usefixtures("one_thread")


def bf16_llama(path: str, **overrides) -> str:
    """A random Llama saved in bf16, as most released checkpoints are."""
    from transformers import LlamaConfig, LlamaForCausalLM

    kwargs = dict(vocab_size=1003, hidden_size=80, intermediate_size=144, num_hidden_layers=2,
                  num_attention_heads=5, num_key_value_heads=1, max_position_embeddings=512,
                  tie_word_embeddings=True, initializer_range=0.15, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**kwargs)).to(torch.bfloat16).eval().save_pretrained(path)
    return path


def _data(folder: str) -> bytes:
    with open(os.path.join(folder, "model.onnx.data"), "rb") as f:
        return f.read()


@pytest.mark.parametrize("flavor", ["perfxlm", "ort"])
def test_a_bf16_checkpoint_exported_float32_is_held_bf16_and_written_the_same(tmp_path, monkeypatch, flavor):
    from perfxlm.export import held_weights

    ckpt = bf16_llama(str(tmp_path / "ckpt"))
    held = []
    load = held_weights.load_for_export
    monkeypatch.setattr(held_weights, "load_for_export",
                        lambda config: held.append(load(config)) or held[-1])
    narrow = str(tmp_path / "narrow")
    export_onnx(ckpt, narrow, flavor=flavor, dtype="float32")
    model, stored = held.pop()
    assert stored == torch.float32
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.model.layers[1].mlp.down_proj.weight.dtype == torch.bfloat16
    del model
    # the same export holding the float32 model the engine runs
    monkeypatch.setattr(held_weights, "checkpoint_all_bf16", lambda folder: False)
    wide = str(tmp_path / "wide")
    export_onnx(ckpt, wide, flavor=flavor, dtype="float32")
    model, _ = held.pop()
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert _data(narrow) == _data(wide)
    proto = onnx.load(os.path.join(narrow, "model.onnx"), load_external_data=False)
    types = {t.data_type for t in proto.graph.initializer if t.name.endswith(".weight") and len(t.dims) == 2}
    assert types == {onnx.TensorProto.FLOAT}
    if flavor != "perfxlm":
        return
    kw = dict(skip_tokenizer_init=True, dtype="float32", num_kv_blocks=32)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    prompts = [{"prompt_token_ids": p} for p in ([5], list(range(7, 30)))]
    got = LLM(narrow, **kw).generate(prompts, params, use_tqdm=False)
    want = LLM(ckpt, **kw).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for g, w in zip(got, want):
        np.testing.assert_array_equal([lp[t].logprob for lp, t in zip(g.outputs[0].logprobs, g.outputs[0].token_ids)],
                                      [lp[t].logprob for lp, t in zip(w.outputs[0].logprobs, w.outputs[0].token_ids)])


def test_a_float32_checkpoint_is_not_narrowed(tmp_path):
    from perfxlm.config import EngineConfig
    from perfxlm.export.held_weights import held_dtype
    from tests.conftest import make_llama_checkpoint

    ckpt = make_llama_checkpoint(str(tmp_path / "ckpt"), num_hidden_layers=1)  # saved float32
    assert held_dtype(EngineConfig(model=ckpt, dtype="float32").resolve()) == torch.float32
    bf16 = bf16_llama(str(tmp_path / "bf16"), num_hidden_layers=1)
    assert held_dtype(EngineConfig(model=bf16, dtype="float32").resolve()) == torch.bfloat16
    assert held_dtype(EngineConfig(model=bf16, dtype="bfloat16").resolve()) == torch.bfloat16
    q = {"method": "int8", "mixed_precision": False, "calibration": False}  # a quantizer reads float32
    assert held_dtype(EngineConfig(model=bf16, dtype="float32", quantization=q).resolve()) == torch.float32


_PEAK = """
import json, sys, threading, time
def anon():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("RssAnon"))
import perfxlm.export.package, perfxlm.export.held_weights, perfxlm.model.loader, onnx, transformers, safetensors
from perfxlm.export.package import export_onnx
export_onnx(sys.argv[5], sys.argv[2] + ".warm", flavor=sys.argv[3], dtype=sys.argv[4])  # what any export loads once
base, peak, done = anon(), [0], []
def sample():
    while not done:
        peak[0] = max(peak[0], anon()); time.sleep(0.005)
t = threading.Thread(target=sample); t.start()
export_onnx(sys.argv[1], sys.argv[2], flavor=sys.argv[3], dtype=sys.argv[4])
done.append(1); t.join()
print(json.dumps({"base": base, "peak": max(peak[0], anon())}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_peak_memory_under_one_and_a_half_checkpoints(tmp_path, dtype):
    """A tied bf16 Llama (its table a third of the model, as Llama 3.2 1B's): the export's anonymous memory
    above the process's after its imports stays under 1.5x the checkpoint, whether the engine holds it in
    float32 (was 2.6x: the float32 model and the arena's copy of the tied table) or in bf16 (was 1.57x on
    a CPU whose bf16 layout is panels: the tied head's packed copy)."""
    ckpt = bf16_llama(str(tmp_path / "ckpt"), vocab_size=32003, hidden_size=512, intermediate_size=1536,
                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2)
    warm = bf16_llama(str(tmp_path / "warm"), num_hidden_layers=1)
    size = sum(os.path.getsize(os.path.join(ckpt, n)) for n in os.listdir(ckpt) if n.endswith(".safetensors"))
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-c", _PEAK, ckpt, str(tmp_path / "graph"), "perfxlm", dtype, warm], env=env,
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    ratio = (result["peak"] - result["base"]) / size
    print(f"export {dtype}: peak {ratio:.2f}x the checkpoint ({size / 2**20:.0f} MiB)")
    assert ratio < 1.5, ratio

"""The engine on a CUDA device: the same scheduler, KV-cache manager and sampler as on the CPU, the model,
KV cache and sampling tensors in GPU memory, attention on the Triton backend.

Float32 greedy tokens on the GPU equal the CPU engine's (TF32 off, so both compute float32 products),
bf16 within tolerance, the KV pool sized by gpu_memory_utilization, bad device names refused. The
tests that need a GPU skip, with the reason printed, where torch sees none."""

from __future__ import annotations

import gc

import pytest
import torch

from perfxlm import LLM, SamplingParams
from tests.conftest import assert_pool_whole, make_llama_checkpoint

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    print("tests/gpu/test_cuda_engine.py: the CUDA tests are skipped: torch sees no CUDA device")
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="torch sees no CUDA device")

# odd lengths, past a block (16) and across the chunk limit below; the last two share a prefix
PROMPTS = [
    [1, 5, 9, 33, 17],
    [1, 80, 41, 7, 3, 9, 11, 250, 31, 64, 8, 5, 99, 4, 6, 13, 21, 34, 55, 89, 144, 233, 377],
    [1] + [(7 * i + 3) % 997 for i in range(40)],
    [1] + [(7 * i + 3) % 997 for i in range(40)] + [12, 14, 16],
]


def _qwen2_checkpoint(path: str) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    config = Qwen2Config(vocab_size=1000, hidden_size=80, intermediate_size=144, num_hidden_layers=3,
                         num_attention_heads=5, num_key_value_heads=1, max_position_embeddings=1024,
                         tie_word_embeddings=False, initializer_range=0.15, bos_token_id=1, eos_token_id=2)  # fmt: skip
    Qwen2ForCausalLM(config).eval().save_pretrained(path)
    return path


def _llama_checkpoint(path: str) -> str:
    return make_llama_checkpoint(path, hidden_size=96, intermediate_size=160, num_hidden_layers=3,
                                 num_attention_heads=6, num_key_value_heads=2)  # fmt: skip


CHECKPOINTS = {"llama": _llama_checkpoint, "qwen2": _qwen2_checkpoint}


@pytest.fixture
def no_tf32():
    """float32 products in float32 on the GPU (TF32 would round their inputs to 10 mantissa bits)."""
    if not HAS_CUDA:
        yield
        return
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _free(llm) -> None:
    """Collect what an engine left (the caller drops its own reference) and give cached blocks back."""
    del llm
    gc.collect()
    if HAS_CUDA:
        torch.cuda.empty_cache()


def _greedy(llm, prompts=PROMPTS, max_tokens=12):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@needs_cuda
@pytest.mark.parametrize("family,kv,eager", [("llama", "auto", False), ("llama", "auto", True), ("llama", "int8", False),
                                             ("qwen2", "auto", False), ("qwen2", "int8", True)])
def test_float32_greedy_tokens_equal_cpu(tmp_path, family, kv, eager, no_tf32):
    path = CHECKPOINTS[family](str(tmp_path / family))
    engine = dict(dtype="float32", max_num_batched_tokens=32, skip_tokenizer_init=True, kv_cache_dtype=kv,
                  num_kv_blocks=64, max_num_seqs=6)  # fmt: skip
    cpu = LLM(path, device="cpu", **engine)
    want = _greedy(cpu)
    _free(cpu)
    gpu = LLM(path, device="cuda", enforce_eager=eager, **engine)
    runner = gpu.llm_engine.core.runner
    assert runner.device.type == "cuda"
    assert all(p.device.type == "cuda" for p in runner.model.parameters())
    assert all(c.key.device.type == "cuda" for c in runner.kv_caches)
    got = _greedy(gpu)
    assert got == want
    again = _greedy(gpu)  # prefix-cache hits on the GPU's blocks
    assert again == want
    # decode steps of 1-4 rows replayed from graphs padded to 1, 2, 4 (6 seats: sizes 1, 2, 4, 6)
    assert (runner.forward_path.replays > 0) != eager
    if not eager:
        assert sorted(runner.forward_path.graphs) == [1, 2, 4, 6]
    layers = [m for m in runner.model.modules() if getattr(m, "backend", None) is not None]
    assert layers and {m.backend.name for m in layers} == {"triton"}
    assert_pool_whole(gpu)
    _free(gpu)


@needs_cuda
def test_bfloat16_and_float16_logprobs_within_tolerance(tmp_path, no_tf32):
    path = _llama_checkpoint(str(tmp_path / "llama"))
    prompt = [{"prompt_token_ids": PROMPTS[2]}]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)

    def prompt_logprobs(llm):
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        return torch.tensor([next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]])

    ref_llm = LLM(path, device="cpu", dtype="float32", skip_tokenizer_init=True, num_kv_blocks=16)
    ref = prompt_logprobs(ref_llm)
    _free(ref_llm)
    for dtype in ("bfloat16", "float16"):
        llm = LLM(path, device="cuda", dtype=dtype, skip_tokenizer_init=True, num_kv_blocks=16)
        assert llm.llm_engine.config.torch_dtype == getattr(torch, dtype)
        got = prompt_logprobs(llm)
        diff = (got - ref).abs()
        print(f"{dtype}: prompt logprobs vs float32 CPU: max {diff.max():.4f}, mean {diff.mean():.4f}")
        assert diff.mean() < 0.05 and diff.max() < 0.3, (dtype, diff)
        _free(llm)


@needs_cuda
def test_dtype_auto_follows_vllm(tmp_path):
    path = _llama_checkpoint(str(tmp_path / "llama"))  # saved float32: vLLM downcasts to bfloat16 (or fp16)
    llm = LLM(path, device="cuda", skip_tokenizer_init=True, num_kv_blocks=16)
    want = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    assert llm.llm_engine.config.torch_dtype == want
    assert next(llm.llm_engine.core.runner.model.parameters()).dtype == want
    _free(llm)


@needs_cuda
def test_kv_pool_respects_gpu_memory_utilization(tmp_path):
    # a long context and many seats: the pool is bounded by the memory share, not by what seats could use
    path = make_llama_checkpoint(str(tmp_path / "llama"), max_position_embeddings=1 << 20)
    _, total = torch.cuda.mem_get_info()
    pools = {}
    for share in (0.15, 0.3):
        llm = LLM(path, device="cuda", dtype="float16", skip_tokenizer_init=True, gpu_memory_utilization=share,
                  max_model_len=1 << 20)  # fmt: skip
        core = llm.llm_engine.core
        pools[share] = core.num_kv_blocks * core.kv_bytes_per_block
        _greedy(llm, max_tokens=4)
        torch.cuda.synchronize()
        free, _ = torch.cuda.mem_get_info()
        print(f"gpu_memory_utilization={share}: pool {pools[share] / 2**30:.2f} GiB, device in use "
              f"{(total - free) / 2**30:.2f} of {total / 2**30:.1f} GiB")
        assert total - free <= share * total, (share, total - free)
        assert pools[share] > 0.5 * share * total  # most of the share goes to the pool (the model is tiny)
        del llm, core  # the next engine measures the device with this one's pool given back
        gc.collect()
        torch.cuda.empty_cache()
    assert pools[0.3] > pools[0.15]


@needs_cuda
def test_sampling_on_gpu_is_seeded_and_leaks_nothing(tmp_path):
    path = _llama_checkpoint(str(tmp_path / "llama"))
    llm = LLM(path, device="cuda", dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64)
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_p=0.01, repetition_penalty=1.1,
                            logit_bias={7: 2.0}, seed=7, max_tokens=10, ignore_eos=True, logprobs=3, n=2)  # fmt: skip
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    first = llm.generate(prompts, params, use_tqdm=False)
    second = llm.generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in first] == [[c.token_ids for c in o.outputs] for o in second]
    assert all(len(c.logprobs) == 10 and len(c.logprobs[0]) >= 3 for o in first for c in o.outputs)
    with pytest.raises(ValueError):
        llm.generate({"prompt_token_ids": [1, 5000]}, params, use_tqdm=False)  # past the vocabulary
    assert_pool_whole(llm)
    _free(llm)


def test_bad_device_is_a_clear_value_error(tmp_path):
    path = make_llama_checkpoint(str(tmp_path / "llama"), num_hidden_layers=1)
    with pytest.raises(ValueError, match="device must be one of auto, cpu, cuda"):
        LLM(path, device="tpu", skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="gpu_memory_utilization must be a fraction"):
        LLM(path, gpu_memory_utilization=0, skip_tokenizer_init=True)
    if not HAS_CUDA:
        with pytest.raises(ValueError, match="torch sees no CUDA device"):
            LLM(path, device="cuda", skip_tokenizer_init=True)
    else:
        with pytest.raises(ValueError, match="CUDA device"):
            LLM(path, device=f"cuda:{torch.cuda.device_count()}", skip_tokenizer_init=True)
        with pytest.raises(ValueError, match="on the CPU engine only"):
            LLM(path, device="cuda", quantization="int8", skip_tokenizer_init=True)
        with pytest.raises(ValueError, match="on the CPU engine only"):
            LLM(path, device="cuda", kv_cache_dtype="fp8", skip_tokenizer_init=True)
    # float16 is a GPU dtype: the CPU engine names its own choices
    with pytest.raises(ValueError, match="dtype must be one of"):
        LLM(path, device="cpu", dtype="float16", skip_tokenizer_init=True)

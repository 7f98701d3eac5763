"""Tensor parallelism on this machine: ranks with one core each, greedy float32 output equal to one
process token for token, and a worker that dies or hangs ends the engine within seconds, leaving no
process behind."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import transformers

from perfxlm import LLM, SamplingParams

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_thread")]

COMMON = dict(vocab_size=1000, max_position_embeddings=512, initializer_range=0.15, bos_token_id=1, eos_token_id=2,
              pad_token_id=0)  # fmt: skip
# name -> (config class, model class, overrides): head counts chosen to split unevenly where they can
CASES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=96, intermediate_size=190, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=3,
        tie_word_embeddings=False, vocab_size=1001)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
        tie_word_embeddings=True)),
    "qwen2moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        num_experts=6, num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=80,
        norm_topk_prob=False, mlp_only_layers=[1])),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, query_pre_attn_scalar=24, sliding_window=12, attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0, initializer_range=0.02)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        hidden_size=48, intermediate_size=88, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=3,
        head_dim=16, query_pre_attn_scalar=16, sliding_window=7, initializer_range=0.05,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=3,
        head_dim=16, num_experts=5, num_experts_per_tok=2, moe_intermediate_size=30, norm_topk_prob=True,
        mlp_only_layers=[0])),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", dict(
        hidden_size=48, intermediate_size=76, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=3,
        head_dim=16, partial_rotary_factor=0.5, tie_word_embeddings=False)),
}  # fmt: skip

PROMPTS = [[5, 17, 300, 42, 9, 77, 13, 600, 2, 45, 81], [8, 8, 100, 200, 3], list(range(3, 40, 2))]


def build(path: str, case: str, seed: int = 0) -> str:
    config_cls, model_cls, overrides = CASES[case]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**COMMON, **overrides})
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:  # norms and biases start at constants: perturb them so they count
                param.add_(torch.randn_like(param) * 0.1)
            if case == "gemma2" and name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(8)  # scores large enough that the soft cap bends them
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    return {case: build(str(root / case), case) for case in CASES}



def _run(path: str, tp: int, dtype: str = "float32", **kw) -> tuple[list[list[int]], list]:
    llm = LLM(path, dtype=dtype, skip_tokenizer_init=True, tensor_parallel_size=tp, **kw)
    try:
        params = [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, detokenize=False, logprobs=2),
                  SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, detokenize=False, prompt_logprobs=1),
                  SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, detokenize=False)]
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        _run.preemptions = llm.llm_engine.scheduler.num_preemptions_total
        _run.fused_steps = _fused_steps(llm)
        return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs]
    finally:
        llm.llm_engine.shutdown()


def _fused_steps(llm) -> list[int]:
    """Per rank, the steps that ran on the fused decode layer (a worker's `Stats`; one process: its model)."""
    from perfxlm.model.fused_decode import fused_decode_steps

    core = llm.llm_engine.core
    if core.model is not None:
        return [fused_decode_steps(core.model)]
    return [s["fused_decode_steps"] for s in core.executor.stats()]


def _children_gone(timeout: float = 10.0) -> bool:
    import multiprocessing

    deadline = time.time() + timeout
    while time.time() < deadline:
        if not [p for p in multiprocessing.active_children() if p.name.startswith("perfxlm-tp")]:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tp2_equals_one_process(checkpoints, case):
    # small blocks and token budget: prefill chunks, decodes and prefills in one batch, and (llama) preemption
    kw = dict(block_size=4, max_num_batched_tokens=16, num_kv_blocks=14 if case == "llama" else 64)
    ref_ids, ref_lps = _run(checkpoints[case], 1, **kw)
    ids, lps = _run(checkpoints[case], 2, **kw)
    assert ids == ref_ids
    assert min(_run.fused_steps) > 0  # every family here decodes fused on each rank's shard
    if case == "llama":
        assert _run.preemptions > 0  # a preempted request's block table was sent again whole
    for a, b in zip(ref_lps[0], lps[0]):  # sampled logprobs agree to float32 rounding
        assert a.keys() == b.keys()
        for t in a:
            assert abs(a[t].logprob - b[t].logprob) < 1e-4
    assert _children_gone()


def test_greedy_tp3_uneven_vocab_and_heads(checkpoints):
    """Three ranks (sharing two cores): 3 KV heads one each, 190 intermediate columns and 1001 vocabulary
    rows split unevenly (the last vocabulary shard padded)."""
    assert _run(checkpoints["llama"], 3)[0] == _run(checkpoints["llama"], 1)[0]


def test_gloo_fallback(checkpoints, monkeypatch):
    monkeypatch.setenv("PERFXLM_ALLREDUCE", "gloo")
    assert _run(checkpoints["qwen2"], 2)[0] == _run(checkpoints["qwen2"], 1)[0]


@pytest.fixture(scope="module")
def quantizable(tmp_path_factory):
    """A Llama whose every rank's share of an input falls on whole groups (64 inputs) for two ranks."""
    path = str(tmp_path_factory.mktemp("tpq") / "llama")
    torch.manual_seed(7)
    config = transformers.LlamaConfig(**{**COMMON, **dict(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
        head_dim=16, tie_word_embeddings=False)})  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    return model, path


@pytest.mark.parametrize("how", ["int8", "gguf_q4_0"])
def test_quantized_weights_tp2_equal_one_process(quantizable, tmp_path, how):
    """Each rank's layers cut their shard of a GGUF file's Q4_0 blocks (rows of codes, columns as whole
    groups), or of the float checkpoint that `quantization=` then quantizes, and the shard runs on the
    format's own kernels; greedy output is one process's. Decode steps run fused on every rank (the
    layer's two native halves, all-reduced between), as in one process. The GGUF case also keeps an fp8
    KV cache, split by KV heads like the rest."""
    import gguf

    from tests.model.test_gguf_vs_hf import write_converted

    model, path = quantizable
    kw: dict = dict(block_size=4, num_kv_blocks=64)
    if how == "int8":
        kw["quantization"] = "int8"
    else:
        suffixes = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight",
                    "up_proj.weight", "down_proj.weight")  # fmt: skip
        path = str(tmp_path / "q4_0.gguf")
        write_converted(path, model, "llama", q8_0=suffixes, qtype=gguf.GGMLQuantizationType.Q4_0)
        kw["kv_cache_dtype"] = "fp8"
    one = LLM(path, dtype="float32", skip_tokenizer_init=True, **kw)
    try:
        proj = one.llm_engine.core.model.model.layers[0].mlp.down_proj
        assert proj.method.quantized  # the format the ranks split, not a dequantized copy
    finally:
        one.llm_engine.shutdown()
    ids = _run(path, 2, **kw)[0]
    assert min(_run.fused_steps) > 0 and len(_run.fused_steps) == 2  # each rank's fused step on its shard
    assert ids == _run(path, 1, **kw)[0]
    assert _run.fused_steps[0] > 0
    assert _children_gone()


def test_int8_bfloat16_tp2_decodes_fused_within_tolerance(quantizable):
    """bf16 weights beside int8 ones, a bf16 KV cache: each rank's fused step on its shard; the first
    tokens and their log-probabilities agree with one process within bf16 rounding."""
    kw: dict = dict(block_size=4, num_kv_blocks=64, quantization="int8")
    ids, lps = _run(quantizable[1], 2, dtype="bfloat16", **kw)
    assert min(_run.fused_steps) > 0
    ref_ids, ref_lps = _run(quantizable[1], 1, dtype="bfloat16", **kw)
    assert [i[:3] for i in ids] == [i[:3] for i in ref_ids]
    for a, b in zip(ref_lps[0][:3], lps[0][:3]):
        for t in a.keys() & b.keys():
            assert abs(a[t].logprob - b[t].logprob) < 0.05


def test_awq_checkpoint_tp2_equals_one_process(quantizable, tmp_path):
    """A pre-quantized checkpoint's packed modules arrive as quantized weights, cut by the same layers."""
    from tests.quant.packed_checkpoints import awq_parts, write_packed
    from tests.quant.test_prequantized import AWQ_CONFIG

    import copy

    model = copy.deepcopy(quantizable[0])  # write_packed puts the dequantized weights in the model it saves
    path = str(tmp_path / "awq")
    write_packed(path, model, lambda name, w: awq_parts(w, 32), AWQ_CONFIG)
    assert _run(path, 2, block_size=4, num_kv_blocks=64)[0] == _run(path, 1, block_size=4, num_kv_blocks=64)[0]
    assert _children_gone()


def test_opt_tp2_equals_one_process(tmp_path):
    """OPT (the module path: learned positions, LayerNorm, biases everywhere, project_in/out around a wider
    hidden size) with 6 heads, 190 fc1 rows and 1001 vocabulary rows split over two ranks."""
    path = str(tmp_path / "opt")
    torch.manual_seed(0)
    model = transformers.OPTForCausalLM(transformers.OPTConfig(**{**COMMON, **dict(
        vocab_size=1001, hidden_size=96, ffn_dim=190, num_hidden_layers=2, num_attention_heads=6,
        word_embed_proj_dim=64, init_std=0.1)}))  # fmt: skip
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(path)
    kw = dict(block_size=4, max_num_batched_tokens=16, num_kv_blocks=64)
    ref_ids, ref_lps = _run(path, 1, **kw)
    ids, lps = _run(path, 2, **kw)
    assert ids == ref_ids
    for a, b in zip(ref_lps[0], lps[0]):
        assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    assert _children_gone()


def test_refusals_come_before_any_worker_starts(quantizable, tmp_path, monkeypatch):
    """A family without parallel layers (OPT marked so here: every family has them now), and an act-order
    checkpoint: ValueErrors naming what to change, raised in the engine's process."""
    from perfxlm.model.models.opt import OPTForCausalLM
    from tests.quant.packed_checkpoints import write_packed
    from tests.quant.test_prequantized import PACKED

    monkeypatch.setattr(OPTForCausalLM, "supports_tensor_parallel", False)
    opt = str(tmp_path / "opt")
    torch.manual_seed(0)
    transformers.OPTForCausalLM(transformers.OPTConfig(
        vocab_size=1000, hidden_size=32, ffn_dim=64, num_hidden_layers=1, num_attention_heads=2,
        word_embed_proj_dim=32)).save_pretrained(opt)  # fmt: skip
    with pytest.raises(ValueError, match="not supported for OPTForCausalLM"):
        LLM(opt, skip_tokenizer_init=True, tensor_parallel_size=2)
    make_parts, qconfig, _ = PACKED["gptq-4bit-g32-sym-act-order"]
    import copy

    act_order = str(tmp_path / "act-order")
    write_packed(act_order, copy.deepcopy(quantizable[0]), make_parts, qconfig)
    with pytest.raises(ValueError, match="act-order checkpoint"):
        LLM(act_order, skip_tokenizer_init=True, tensor_parallel_size=2)
    assert _children_gone(1.0)


def test_workers_run_the_engines_cpu_plan(checkpoints):
    """The plan is decided once, in the engine's process (config.resolved), and handed to the ranks: a
    plan put in force there (as an override would) is the one each worker runs, not one it detects."""
    from perfxlm.ops import cpu_plan

    previous = cpu_plan.use(native_max_rows=5)
    try:
        llm = LLM(checkpoints["qwen2"], dtype="float32", skip_tokenizer_init=True, tensor_parallel_size=2,
                  num_kv_blocks=16)
    finally:
        cpu_plan.use(previous)
    try:
        infos = llm.llm_engine.core.executor.infos
        assert [i["heads"] for i in infos] == [3, 3] and [i["kv_heads"] for i in infos] == [1, 1]
        assert all("native_max_rows=5 " in i["cpu_plan"] for i in infos), [i["cpu_plan"] for i in infos]
    finally:
        llm.llm_engine.shutdown()
    assert _children_gone()


def _worker_pids(llm) -> list[int]:
    return [p.pid for p in llm.llm_engine.core.executor.procs]


@pytest.mark.parametrize("how", ["dies", "hangs"])
def test_worker_failure_ends_the_engine(checkpoints, monkeypatch, how):
    from perfxlm.engine.threaded_engine import EngineDeadError, ThreadedEngine
    from perfxlm.config import EngineConfig

    monkeypatch.setenv("PERFXLM_COLLECTIVE_TIMEOUT", "2")
    engine = ThreadedEngine(EngineConfig(model=checkpoints["qwen2"], dtype="float32", skip_tokenizer_init=True,
                                         tensor_parallel_size=2, num_kv_blocks=64))
    pids = [p.pid for p in engine.core.executor.procs]
    try:
        got: list = []
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, detokenize=False)
        engine.add_request("a", {"prompt_token_ids": PROMPTS[0]}, params, got.append)
        assert engine.wait_idle(60)
        deadline = time.time() + 10  # the output thread delivers the last output after the core goes idle
        while not (got and got[-1].finished) and time.time() < deadline:
            time.sleep(0.01)
        assert got and got[-1].finished  # it serves
        os.kill(pids[1], signal.SIGKILL if how == "dies" else signal.SIGSTOP)
        t0 = time.time()
        if how == "dies":  # noticed while idle, by the health check itself
            deadline = t0 + 5
            while time.time() < deadline:
                try:
                    engine.check_health()
                except EngineDeadError:
                    break
                time.sleep(0.05)
        else:  # a hung rank: the next step's all-reduce gives up on it
            got.clear()
            engine.add_request("b", {"prompt_token_ids": PROMPTS[1]},
                               SamplingParams(max_tokens=50, ignore_eos=True, detokenize=False), got.append)
            while not got or not isinstance(got[-1], BaseException):
                assert time.time() - t0 < 15, got
                time.sleep(0.05)
            assert isinstance(got[-1], EngineDeadError)  # the open request ends with the error
        with pytest.raises(EngineDeadError):
            engine.check_health()
        assert time.time() - t0 < 10
        with pytest.raises(EngineDeadError):
            engine.add_request("c", {"prompt_token_ids": [5, 6]}, params, got.append)
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        engine.shutdown()
    assert _children_gone()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_tp2_equals_one_process(checkpoints, tmp_path, method):
    """Draft tokens travel to the workers in the step delta; greedy output stays one process's. A draft
    model runs in the engine's process (draft_tensor_parallel_size 1) beside the target's two ranks."""
    if method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    else:
        from tests.conftest import make_llama_checkpoint

        draft = make_llama_checkpoint(str(tmp_path / "draft"), seed=3, hidden_size=40, intermediate_size=72,
                                      num_hidden_layers=1, num_attention_heads=5, num_key_value_heads=1)
        spec = {"model": draft, "num_speculative_tokens": 4, "draft_tensor_parallel_size": 1}
    prompts = [{"prompt_token_ids": [5, 17, 300, 42] * 4 + [5, 17]}, {"prompt_token_ids": [8, 9, 10] * 5}]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, detokenize=False)
    kw = dict(dtype="float32", skip_tokenizer_init=True, block_size=4, num_kv_blocks=64)
    ref = LLM(checkpoints["qwen2"], **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(checkpoints["qwen2"], tensor_parallel_size=2, speculative_config=spec, **kw)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.llm_engine.scheduler.spec_stats.num_drafts > 0
        if method == "draft_model":
            proposer = llm.llm_engine.core.proposer
            proposer.drop(list(proposer.seqs))
            assert proposer.kv.check_invariants()["used"] == 0
    finally:
        llm.llm_engine.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert _children_gone()

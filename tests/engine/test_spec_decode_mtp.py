"""Speculative decoding with a checkpoint's own multi-token-prediction layer (`method: "mtp"`): the
proposer's guesses equal a plain-torch reference of DeepSeek-V3's MTP formula over transformers' hidden
states, greedy outputs equal decoding without it (prefix caching, chunked prefill, preemption, n > 1,
a stop string), the counters move, and bad configurations are refused before weights are read."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

from perfxlm import LLM, SamplingParams
from tests.conftest import assert_pool_whole
from tests.model.test_recent_families_vs_hf import build_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

CASE = "deepseekv3-noaux-grouped"  # 3 layers (the first dense), MoE, query bottleneck, interleaved rope


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class Reference:
    """The target (transformers) and its MTP layer as plain torch: transformers' own decoder layer for
    the layer's attention and experts, the MTP formula around it."""

    def __init__(self, target, layer: DeepseekV3DecoderLayer, mtp: dict[str, torch.Tensor]) -> None:
        self.target, self.layer, self.w = target, layer, mtp
        self.eps = target.config.rms_norm_eps

    @torch.no_grad()
    def pre_norm(self, tokens: list[int]) -> torch.Tensor:
        seen = []
        hook = self.target.model.norm.register_forward_hook(lambda m, i, o: seen.append(i[0][0]))
        try:
            self.target(torch.tensor([tokens]))
        finally:
            hook.remove()
        return seen[0]

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int, start: int = 0) -> list[int]:
        """k guesses after `tokens`: position t reads token t+1 and the target's state at t; past the
        last known token, the layer's own output and its last guess. `start`: the first position the
        layer saw (its positions counted from there)."""
        w = self.w
        hidden = self.pre_norm(tokens)[start:-1]  # positions whose next token is known
        ids = list(tokens[start + 1 :])
        out = []
        for _ in range(k):
            n = len(ids)
            e = _rms(w["embed_tokens.weight"][torch.tensor(ids)], w["enorm.weight"], self.eps)
            h = _rms(hidden, w["hnorm.weight"], self.eps)
            x = torch.cat((e, h), -1) @ w["eh_proj.weight"].T
            pos = torch.arange(n)[None]
            cos_sin = self.target.model.rotary_emb(x[None], pos)
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            x = self.layer(x[None], attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
            x = (x[0] if isinstance(x, tuple) else x)[0]
            logits = _rms(x[-1], w["shared_head.norm.weight"], self.eps) @ w["shared_head.head.weight"].T
            out.append(int(logits.argmax()))
            ids.append(out[-1])
            hidden = torch.cat((hidden, x[-1:]))
        return out


def build_mtp_checkpoint(path: str, seed: int = 0, own_embed_head: bool = True) -> Reference:
    """A random DeepSeek-V3 checkpoint with one MTP layer's tensors added (transformers drops them)."""
    target = build_checkpoint(path, CASE, seed)
    config = target.config
    torch.manual_seed(seed + 7)
    layer = DeepseekV3DecoderLayer(config, config.num_hidden_layers).eval()
    hidden, vocab = config.hidden_size, config.vocab_size
    with torch.no_grad():
        for name, p in list(layer.named_parameters()) + list(layer.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                p.copy_(torch.randn_like(p) * 0.05)
            elif p.ndim == 1:
                p.copy_(1 + torch.randn_like(p) * 0.1)
            else:
                p.copy_(torch.randn_like(p) * 0.15)
    mtp = {
        "enorm.weight": 1 + torch.randn(hidden) * 0.1,
        "hnorm.weight": 1 + torch.randn(hidden) * 0.1,
        "eh_proj.weight": torch.randn(hidden, 2 * hidden) * 0.15,
        "shared_head.norm.weight": 1 + torch.randn(hidden) * 0.1,
    }
    ref = {**mtp, "embed_tokens.weight": target.model.embed_tokens.weight.detach().clone(),
           "shared_head.head.weight": target.lm_head.weight.detach().clone()}  # fmt: skip
    if own_embed_head:  # the layer's own copies (as DeepSeek-V3's checkpoints store them), not the target's
        mtp["embed_tokens.weight"] = ref["embed_tokens.weight"] = torch.randn(vocab, hidden) * 0.5
        mtp["shared_head.head.weight"] = ref["shared_head.head.weight"] = torch.randn(vocab, hidden) * 0.15
    prefix = f"model.layers.{config.num_hidden_layers}."
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    tensors.update({prefix + k: v.contiguous() for k, v in layer.state_dict().items()})
    tensors.update({prefix + k: v.contiguous() for k, v in mtp.items()})
    save_file(tensors, file, metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["num_nextn_predict_layers"] = 1
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return Reference(target, layer, ref)


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("deepseek_mtp"))
    return path, build_mtp_checkpoint(path)


def _llm(path: str, k: int = 3, **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 64)
    kwargs.setdefault("skip_tokenizer_init", True)
    return LLM(path, dtype="float32", block_size=4,
               speculative_config={"method": "mtp", "num_speculative_tokens": k}, **kwargs)  # fmt: skip


class _Recorder:
    """Wraps the engine's proposer: what it was asked and what it answered."""

    def __init__(self, proposer) -> None:
        self.proposer, self.calls = proposer, []
        self.name, self.needs_hidden_states = proposer.name, proposer.needs_hidden_states
        self.follows_budget = proposer.follows_budget

    def observe(self, hidden_states) -> None:
        self.proposer.observe(hidden_states)

    def drop(self, ids) -> None:
        self.proposer.drop(ids)

    def propose(self, batch):
        out = self.proposer.propose(batch)
        bases = [getattr(self.proposer.seqs.get(r.request_id), "base", None) for r in batch]
        self.calls += [(list(r.token_ids), r.max_drafts, list(d), b) for r, d, b in zip(batch, out, bases)]
        return out


@pytest.mark.parametrize("own_embed_head", [True, False])
def test_drafts_equal_the_mtp_formula(tmp_path, own_embed_head):
    path = str(tmp_path)
    ref = build_mtp_checkpoint(path, seed=3, own_embed_head=own_embed_head)
    llm = _llm(path, k=3)
    core = llm.llm_engine.core
    core.proposer = rec = _Recorder(core.proposer)
    prompt = [5, 17, 300, 42, 8, 99, 123, 7, 1, 9, 500]
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    # again: 8 prompt tokens from the prefix cache, so the layer starts at position 8
    llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    # n = 2: the second sample's layer sees the prompt as the first's does (both start at position 0)
    two = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, n=2)
    llm.generate({"prompt_token_ids": [600, 3, 44, 5, 61]}, two, use_tqdm=False)
    assert {b for *_, b in rec.calls} == {0, 8}
    assert sum(1 for t, *_ in rec.calls if t[0] == 600 and len(t) == 6) == 2  # both samples guessed for
    assert any(k > 1 and len(d) == k for _, k, d, _ in rec.calls)  # guesses past the first, on its own output
    for tokens, k, drafts, base in rec.calls:
        assert drafts == ref.drafts(tokens, k, base), tokens
    assert_pool_whole(llm)


PROMPTS = [
    {"prompt_token_ids": [11, 12, 13, 14, 15] * 4 + [11, 12, 13]},
    {"prompt_token_ids": [7, 300, 8, 301, 9, 7, 300]},
    {"prompt_token_ids": [11, 12, 13, 14, 15] * 4 + [99, 98, 97]},  # shares a prefix with the first
    {"prompt_token_ids": list(range(40, 69))},
    {"prompt_token_ids": [5, 6, 7]},
]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=21, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=13, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=17, ignore_eos=True, n=2),
    SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
]


def _same(outs, reference) -> None:
    for o, r in zip(outs, reference):
        assert [c.token_ids for c in o.outputs] == [c.token_ids for c in r.outputs], o.prompt_token_ids
        assert [c.finish_reason for c in o.outputs] == [c.finish_reason for c in r.outputs]


def test_greedy_output_equals_decoding_without_it(mtp_checkpoint):
    path, _ = mtp_checkpoint
    plain = LLM(path, skip_tokenizer_init=True, dtype="float32", block_size=4, num_kv_blocks=64)
    reference = plain.generate(PROMPTS, PARAMS, use_tqdm=False)
    llm = _llm(path)
    _same(llm.generate(PROMPTS, PARAMS, use_tqdm=False), reference)
    stats = llm.llm_engine.scheduler.spec_stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens > stats.num_drafts
    assert len(stats.accepted_per_position) == 3
    seeded = SamplingParams(temperature=0.8, seed=4, max_tokens=11, ignore_eos=True)
    a, b = (llm.generate(PROMPTS[1], seeded, use_tqdm=False)[0].outputs[0].token_ids for _ in range(2))
    assert a == b and len(a) == 11
    assert_pool_whole(llm)
    # again: prefix-cache hits (the layer starts where the target's computation does)
    _same(llm.generate(PROMPTS, PARAMS, use_tqdm=False), reference)
    assert_pool_whole(llm)
    # chunked prefill and preemption (a small pool), one guess per step
    small = _llm(path, k=1, num_kv_blocks=20, max_num_batched_tokens=7, enable_prefix_caching=False)
    _same(small.generate(PROMPTS, PARAMS, use_tqdm=False), reference)
    assert small.llm_engine.scheduler.num_preemptions_total > 0
    assert small.llm_engine.scheduler.spec_stats.num_drafts > 0
    assert_pool_whole(small)


def _word_tokenizer(path: str, vocab: int) -> None:
    """A word-level tokenizer of the checkpoint's vocabulary ("w0" ... ), so text and stop strings work."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="w1", eos_token="w2", pad_token="w0").save_pretrained(path)


def test_stop_string(tmp_path):
    path = str(tmp_path)
    build_mtp_checkpoint(path, seed=1)
    make_agreeing(path)  # long accepted runs: the stop string falls inside a verified group of tokens
    _word_tokenizer(path, 1000)
    prompt = " ".join(f"w{t}" for t in PROMPTS[0]["prompt_token_ids"])
    plain = LLM(path, dtype="float32", block_size=4, num_kv_blocks=64)
    free = plain.generate(prompt, SamplingParams(temperature=0, max_tokens=14, ignore_eos=True), use_tqdm=False)
    words = free[0].outputs[0].text.split()
    stop = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, stop=[f"{words[6]} {words[7]}"])
    want = plain.generate(prompt, stop, use_tqdm=False)[0].outputs[0]
    llm = _llm(path, k=4, skip_tokenizer_init=False)
    got = llm.generate(prompt, stop, use_tqdm=False)[0].outputs[0]
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, "stop")
    assert llm.llm_engine.scheduler.spec_stats.num_accepted_tokens > 0
    assert_pool_whole(llm)


def make_agreeing(path: str, seed: int = 0) -> None:
    """Rewrite an MTP checkpoint so target and layer agree: every layer's output projections scaled down
    (the final state is nearly the token's embedding), a head that maps each token's embedding to a fixed
    successor (a permutation of the vocabulary), and an MTP layer passing the next token's embedding
    through to that head: the layer then guesses the target's next-but-one token."""
    file = os.path.join(path, "model.safetensors")
    t = load_file(file)
    with open(os.path.join(path, "config.json")) as f:
        n_layers = json.load(f)["num_hidden_layers"]
    p = f"model.layers.{n_layers}."
    embed = t["model.embed_tokens.weight"]
    vocab, hidden = embed.shape
    successor = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))
    head = embed[torch.argsort(successor)].clone()  # head row successor[i] is token i's embedding
    for name in t:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            t[name] = t[name] * 0.01
    t["lm_head.weight"], t[p + "shared_head.head.weight"] = head, head.clone()
    t[p + "embed_tokens.weight"] = embed.clone()
    t[p + "eh_proj.weight"] = torch.cat((torch.eye(hidden), torch.zeros(hidden, hidden)), 1)
    t[p + "enorm.weight"], t[p + "shared_head.norm.weight"] = torch.ones(hidden), torch.ones(hidden)
    save_file(t, file, metadata={"format": "pt"})


@pytest.mark.usefixtures("full_verify_budget")
def test_agreeing_layer_is_accepted(tmp_path):
    path = str(tmp_path)
    build_mtp_checkpoint(path, seed=2)
    make_agreeing(path)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(path, skip_tokenizer_init=True, dtype="float32", block_size=4, num_kv_blocks=64)
    reference = plain.generate(PROMPTS[:2], params, use_tqdm=False)
    llm = _llm(path, k=4)
    _same(llm.generate(PROMPTS[:2], params, use_tqdm=False), reference)
    stats = llm.llm_engine.scheduler.spec_stats
    assert stats.acceptance_rate > 0.6 and stats.mean_acceptance_length > 3, stats.as_dict()
    assert all(n > 0 for n in stats.accepted_per_position), stats.as_dict()
    assert_pool_whole(llm)


def test_bad_configurations_refused_before_weights(tmp_path, tiny_llama):
    path = str(tmp_path)
    build_checkpoint(path, CASE)  # no MTP tensors
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["num_nextn_predict_layers"] = 0
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="num_nextn_predict_layers=0"):
        _llm(path)
    cfg["num_nextn_predict_layers"] = 1
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match=r"no tensors of its MTP layer \(model\.layers\.3\.\*\)"):
        _llm(path)
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        _llm(tiny_llama)
    for k in (0, 17):
        with pytest.raises(ValueError, match=f"num_speculative_tokens must be in 1..16, got {k}"):
            _llm(path, k=k)


def test_mtp_target_checks_from_the_config_alone(tmp_path):
    from transformers import DeepseekV3Config

    from perfxlm.spec_decode.config import check_mtp_target

    config = DeepseekV3Config(architectures=["DeepseekV3ForCausalLM"], num_nextn_predict_layers=1)
    with pytest.raises(ValueError, match="tensor_parallel_size must be 1 \\(got 2\\)"):
        check_mtp_target(config, str(tmp_path), "safetensors", 2, None)
    with pytest.raises(ValueError, match="load_format 'gguf'"):
        check_mtp_target(config, str(tmp_path), "gguf", 1, None)
    config.quantization_config = {"quant_method": "awq"}
    with pytest.raises(ValueError, match="stored quantized \\('awq'\\)"):
        check_mtp_target(config, str(tmp_path), "safetensors", 1, None)


_PROJECTIONS = ("q_a_proj.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight", "kv_b_proj.weight",
                "o_proj.weight", "gate_proj.weight", "up_proj.weight", "down_proj.weight", "eh_proj.weight")  # fmt: skip


@pytest.mark.usefixtures("full_verify_budget")
def test_fp8_block_checkpoint(tmp_path):
    """DeepSeek-V3's own format: every projection (the MTP layer's too) fp8 blocks with weight_scale_inv;
    the layer guesses as a float checkpoint of the dequantized values does."""
    from tests.quant.test_fp8_blocks import fp8_block_parts

    paths = [str(tmp_path / "float"), str(tmp_path / "fp8")]
    for p in paths:
        os.makedirs(p)
        build_mtp_checkpoint(p, seed=5)
    make = fp8_block_parts((16, 24))
    floats, fp8 = (load_file(os.path.join(p, "model.safetensors")) for p in paths)
    for name in list(floats):
        if name.endswith(_PROJECTIONS) and ".mlp.gate." not in name:
            parts, dequantized = make(name, floats[name])
            floats[name] = dequantized
            fp8[name], fp8[name + "_scale_inv"] = parts["weight"], parts["weight_scale_inv"]
    for p, tensors in zip(paths, (floats, fp8)):
        save_file(tensors, os.path.join(p, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(paths[1], "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [16, 24]}  # fmt: skip
    with open(os.path.join(paths[1], "config.json"), "w") as f:
        json.dump(cfg, f)
    calls = []
    for p in paths:
        llm = _llm(p, k=3)
        core = llm.llm_engine.core
        core.proposer = rec = _Recorder(core.proposer)
        out = llm.generate(PROMPTS[:2], PARAMS[:2], use_tqdm=False)
        calls.append((rec.calls, [c.token_ids for o in out for c in o.outputs]))
        assert_pool_whole(llm)
    assert calls[0][0] and calls[0] == calls[1]

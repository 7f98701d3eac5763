"""An exported perfxlm-flavor graph against the module path on the same weights, same process, rounds
alternating: prefill tok/s (512-token prompt) and batch-1 decode tok/s (512-token context, 128 new tokens).

    python benchmarks/graph_vs_module.py [--model PATH] [--folder OUT_DIR] [--dtype auto] [--repeats 3]
                                         [--threads 2] [--prompt 512] [--new-tokens 128] [--lora-rank 16]

Without --folder the model is exported (`--flavor perfxlm`, the run's dtype) into a temporary folder.
`--random FAMILY` (one of RANDOM's keys: gemma2, gemma3, glm4, opt, gpt-oss, deepseek-v2, deepseek-v3) builds
a random-weight checkpoint of that family at a mid-size shape (a few hundred million parameters, a 32k
vocabulary) instead of --model: speed depends on shapes, not values.
With --lora-rank R both engines run with enable_lora and every request with one random adapter of rank R
on every attention and MLP projection (lora_throughput.py's), so the figures are the graph's LoRA binding
against the module path's.
Prints each round and the medians with graph / module ratios (the engines take turns going first).
Not a test: timings belong here.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from perfxlm import LLM, SamplingParams
from perfxlm.export.package import export_onnx


# family -> (transformers config class, model class, config fields): mid-size shapes of each family's kind
_SHARED = dict(vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=False, pad_token_id=0,
               bos_token_id=1, eos_token_id=2)  # special ids inside the 32k vocabulary
RANDOM = {
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        hidden_size=1152, intermediate_size=6912, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, sliding_window=512)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        hidden_size=1152, intermediate_size=6912, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, sliding_window=512)),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", dict(
        hidden_size=1024, intermediate_size=4096, num_hidden_layers=8, num_attention_heads=16,
        num_key_value_heads=2, head_dim=64)),
    "opt": ("OPTConfig", "OPTForCausalLM", dict(
        hidden_size=1024, ffn_dim=4096, num_hidden_layers=8, num_attention_heads=16, word_embed_proj_dim=1024,
        do_layer_norm_before=True)),
    "gpt-oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        hidden_size=1024, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=16,
        num_key_value_heads=4, head_dim=64, num_local_experts=16, num_experts_per_tok=4, sliding_window=128)),
    "deepseek-v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=8, q_lora_rank=None, kv_lora_rank=256, qk_nope_head_dim=64,
        qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1,
        first_k_dense_replace=1, topk_method="greedy")),
    "deepseek-v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=8, q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64,
        qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1,
        first_k_dense_replace=1, n_group=4, topk_group=2)),
}  # fmt: skip


def random_checkpoint(family: str, path: str) -> str:
    import transformers

    config_cls, model_cls, fields = RANDOM[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**_SHARED, **fields})
    getattr(transformers, model_cls)(config).save_pretrained(path)
    return path


def prompt(length: int, vocab: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(100, vocab, (length,), generator=g).tolist()}]


def prefill_rate(llm: LLM, vocab: int, seed: int, length: int, lora=None) -> float:
    t = time.perf_counter()
    llm.generate(prompt(length, vocab, seed), SamplingParams(max_tokens=1), use_tqdm=False, lora_request=lora)
    return length / (time.perf_counter() - t)


def decode_rate(llm: LLM, vocab: int, seed: int, length: int, new: int, lora=None) -> float:
    params = SamplingParams(max_tokens=new, ignore_eos=True)
    out = llm.generate(prompt(length, vocab, seed), params, use_tqdm=False, lora_request=lora)[0]
    return (new - 1) / (out.metrics.finished_time - out.metrics.first_token_time)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="the source model (default: the embedded default model)")
    ap.add_argument("--folder", default=None, help="its perfxlm-flavor export (default: exported here)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens (prefill, and decode's context)")
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens decoded per decode round")
    ap.add_argument("--lora-rank", type=int, default=0, help="every request with an adapter of this rank (0: none)")
    ap.add_argument("--random", default=None, choices=sorted(RANDOM),
                    help="a random-weight checkpoint of this family instead of --model")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        if args.random:
            args.model = random_checkpoint(args.random, f"{tmp}/{args.random}")
        folder = args.folder
        if folder is None:
            folder = f"{tmp}/graph"
            export_onnx(args.model, folder, flavor="perfxlm", dtype=args.dtype)
        kw = dict(dtype=args.dtype, enable_prefix_caching=False, kv_cache_gib=1.0,
                  skip_tokenizer_init=bool(args.random))  # (a random checkpoint has no tokenizer)
        if args.lora_rank:
            kw.update(enable_lora=True, max_lora_rank=args.lora_rank)
        engines = {"module": LLM(args.model, **kw), "graph": LLM(folder, **kw)}
        config = engines["module"].llm_engine.config.hf_config
        vocab = config.vocab_size
        lora = None
        if args.lora_rank:
            from lora_throughput import write_adapter  # (benchmarks/ is the script's own folder)

            from perfxlm import LoRARequest

            lora = LoRARequest("bench", 1, write_adapter(f"{tmp}/adapter", config, args.lora_rank, 0))
        for llm in engines.values():  # warm-up
            llm.generate(prompt(64, vocab, 0), SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False,
                         lora_request=lora)
        rates: dict[str, dict[str, list[float]]] = {n: {"prefill": [], "decode": []} for n in engines}
        for r in range(args.repeats):
            # alternating, and each first in every other round: a load that grows or falls within a round
            # (or one engine warming the caches for the next) does not always favour the same one
            order = list(engines.items()) if r % 2 == 0 else list(engines.items())[::-1]
            for name, llm in order:
                rates[name]["prefill"].append(prefill_rate(llm, vocab, 100 + r, args.prompt, lora))
                rates[name]["decode"].append(decode_rate(llm, vocab, 200 + r, args.prompt, args.new_tokens, lora))
                print(f"round {r} {name}: prefill {rates[name]['prefill'][-1]:.0f} tok/s, "
                      f"decode {rates[name]['decode'][-1]:.1f} tok/s", flush=True)
    med = {n: {k: statistics.median(v) for k, v in kinds.items()} for n, kinds in rates.items()}
    for kind in ("prefill", "decode"):
        print(f"median {kind}: module {med['module'][kind]:.1f} tok/s, graph {med['graph'][kind]:.1f} tok/s, "
              f"graph/module {med['graph'][kind] / med['module'][kind]:.2f}x")


if __name__ == "__main__":
    main()

"""Multi-LoRA speed against the base model alone, in one run: 16 parallel requests spread over 4 adapters
(generated tokens/s) and batch-1 decode with one adapter (tokens/s after the first token), each next to
the same requests on an engine without LoRA.

The adapters are random PEFT folders of the requested rank over every attention and MLP projection,
written for the model's shapes (adapter_config.json + adapter_model.safetensors, the names PEFT writes),
so any model the engine loads can be measured, GGUF files included. Both engines live in one process
and run alternately (base, LoRA, base, ...), so drift on a shared machine hits both alike; medians.

    python benchmarks/lora_throughput.py                       # the embedded SmolLM2 GGUF
    python benchmarks/lora_throughput.py --model m.gguf --rank 16 --adapters 4 --rounds 3
    python benchmarks/lora_throughput.py --lora-parallel-macs 0   # batch-1 adapter products split too
    python benchmarks/lora_throughput.py --lora-with-base 1       # adapters inside the base product's region
    python benchmarks/lora_throughput.py --lora-prefetch 1        # adapters prefetched in 1-row steps too
    python benchmarks/lora_throughput.py --shape 1b --rounds 3    # a random Llama-3.2-1B-shaped model, int4

`--shape 1b` writes a random-weight Llama with Llama-3.2-1B's shapes (hidden 2048, MLP 8192, 16 layers, 32
heads over 8 KV heads, 128256 tied vocabulary) in bf16 to a temporary folder and loads it with the engine's
own 4-bit weights (`--quantization int4` unless another is given), so its adapters are int8 as beside the
default GGUF; speed depends on shapes, not values.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
from safetensors.torch import save_file

from perfxlm import LLM, LoRARequest, SamplingParams
from perfxlm.config import default_model_path

SHAPES = {  # hidden, intermediate, layers, heads, KV heads, vocab
    "1b": (2048, 8192, 16, 32, 8, 128256),
}

_TARGETS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def _shapes(cfg) -> dict[str, tuple[int, int]]:
    """(in, out) of each target projection of one layer, from the model's Hugging Face config."""
    hidden = cfg.hidden_size
    head_dim = getattr(cfg, "head_dim", None) or hidden // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    inter = cfg.intermediate_size
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def write_shaped_model(path: str, shape: str) -> str:
    """A random-weight Llama of `shape` (SHAPES) saved in bf16, made in bf16 (a 1B model in float32 would
    take 5 GB to build)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, layers, heads, kv, vocab = SHAPES[shape]
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, tie_word_embeddings=True,
                      max_position_embeddings=4096, initializer_range=0.02)
    default = torch.get_default_dtype()
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        LlamaForCausalLM(cfg).eval().save_pretrained(path)
    finally:
        torch.set_default_dtype(default)
    return path


def write_adapter(path: str, cfg, rank: int, seed: int, std: float = 0.02) -> str:
    g = torch.Generator().manual_seed(seed)
    shapes = _shapes(cfg)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for block, names in _TARGETS.items():
            for name in names:
                n_in, n_out = shapes[name]
                prefix = f"base_model.model.model.layers.{layer}.{block}.{name}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) * std
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * std
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0, "bias": "none",
              "target_modules": [n for names in _TARGETS.values() for n in names], "task_type": "CAUSAL_LM"}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return path


# wall time, or with --clock cpu this process's CPU time: on a machine shared with other work, a
# one-thread run's CPU time counts the work done rather than the time slices it was given
CLOCK = {"wall": time.perf_counter, "cpu": time.process_time}


def parallel_tok_s(llm: LLM, prompts: list[list[int]], out_len: int, loras, clock=time.perf_counter) -> float:
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    t0 = clock()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (clock() - t0)


def decode_tok_s(llm: LLM, prompt: list[int], out_len: int, lora, clock=time.perf_counter) -> float:
    if clock is not time.perf_counter:  # the decode steps' time: the whole request less its prefill alone
        first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        t0 = clock()
        llm.generate({"prompt_token_ids": prompt}, first, use_tqdm=False, lora_request=lora)
        t1 = clock()
        params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
        llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False, lora_request=lora)
        return (out_len - 1) / ((clock() - t1) - (t1 - t0))
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False, lora_request=lora)[0]
    m = out.metrics
    return (len(out.outputs[0].token_ids) - 1) / (m.last_token_time - m.first_token_time)


def replay_layers(llm: LLM, prompt: list[int], lora, steps: int, clock=time.perf_counter) -> tuple[list, list]:
    """One batch-1 decode step of the fused decoder layers (`FusedDecode.run`, as the LoRA engine ran it)
    replayed `steps` times with its adapter rows and without them, alternately: seconds per replay of
    each. No scheduler, sampler or LM head around them, so what the adapters add to the layers shows
    apart from the rest of a step."""
    from perfxlm.model.fused_decode import FusedDecode

    seen = []
    run = FusedDecode.run

    def spy(self, x, rope, meta, layer_ropes=None):
        if not seen and meta.lora is not None:
            seen.append((self, x.clone(), rope, meta, layer_ropes))
        return run(self, x, rope, meta, layer_ropes)

    FusedDecode.run = spy
    try:
        llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                     use_tqdm=False, lora_request=lora)
    finally:
        FusedDecode.run = run
    if not seen:
        raise RuntimeError("no decode step ran on the fused decode layer with the adapter")
    fused, x, rope, meta, layer_ropes = seen[0]
    batch = meta.lora
    with_lora, without = [], []
    with torch.inference_mode():
        for i in range(steps + 3):  # the KV write goes to the same slot every time
            for rows, adapters in ((without, None), (with_lora, batch)):
                meta.lora = adapters
                t0 = clock()
                fused.run(x.clone(), rope, meta, layer_ropes)
                if i >= 3:
                    rows.append(clock() - t0)
    return with_lora, without


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    ap.add_argument("--shape", choices=tuple(SHAPES), default=None,
                    help="instead of --model: a random-weight model of these shapes (quantization int4 by default)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--lora-dtype", default="auto", help="what A and B are stored in (auto, float32, bfloat16)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--parallel", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--decode-context", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clock", choices=tuple(CLOCK), default="wall",
                    help="cpu: this process's CPU time (one thread on a shared machine)")
    ap.add_argument("--lora-parallel-macs", type=int, default=None,
                    help="the LoRA kernel's bound for splitting a projection's products across threads "
                         "(PERFXLM_LORA_PARALLEL_MACS; 0: always, batch-1 decode included; default: the kernel's)")
    ap.add_argument("--lora-with-base", type=int, default=None,
                    help="0: the fused layer adds the adapters after each quantized projection instead of in its "
                         "parallel region (PERFXLM_LORA_WITH_BASE; default 0), to compare both on one build")
    ap.add_argument("--lora-prefetch", type=int, default=None,
                    help="1: the fused layer prefetches a projection's adapters before its base product in "
                         "every step, 1-row steps included; 0: never (PERFXLM_LORA_PREFETCH; default: in "
                         "steps of two rows or more only), to compare on one build")
    ap.add_argument("--replay-steps", type=int, default=0,
                    help="also replay one batch-1 step of the fused layers this many times with and without "
                         "the adapter (min and median ms: the layers alone, without the rest of a step)")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    if args.lora_parallel_macs is not None:  # read by the kernels once, when the first product runs
        os.environ["PERFXLM_LORA_PARALLEL_MACS"] = str(args.lora_parallel_macs)
    if args.lora_with_base is not None:
        os.environ["PERFXLM_LORA_WITH_BASE"] = str(args.lora_with_base)
    if args.lora_prefetch is not None:
        os.environ["PERFXLM_LORA_PREFETCH"] = str(args.lora_prefetch)
    shaped = tempfile.TemporaryDirectory() if args.shape else None
    if shaped is not None:
        args.model = write_shaped_model(shaped.name, args.shape)
        args.quantization = args.quantization or "int4"
    if args.model is None:
        args.model = default_model_path()
    common = dict(dtype=args.dtype, quantization=args.quantization, enable_prefix_caching=False,
                  skip_tokenizer_init=shaped is not None)
    base = LLM(args.model, **common)
    lora = LLM(args.model, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank,
               lora_dtype=args.lora_dtype, **common)
    cfg = lora.llm_engine.config.hf_config
    g = torch.Generator().manual_seed(0)
    vocab = cfg.vocab_size
    prompts = [torch.randint(100, vocab - 100, (args.input_len,), generator=g).tolist() for _ in range(args.parallel)]
    long_prompt = torch.randint(100, vocab - 100, (args.decode_context,), generator=g).tolist()
    rows: dict[str, list[float]] = {k: [] for k in ("par_base", "par_lora", "dec_base", "dec_lora")}
    with tempfile.TemporaryDirectory() as tmp:
        requests = [LoRARequest(f"a{i}", i + 1, write_adapter(os.path.join(tmp, f"a{i}"), cfg, args.rank, i))
                    for i in range(args.adapters)]
        spread = [requests[i % len(requests)] for i in range(args.parallel)]
        parallel_tok_s(lora, prompts[:2], 4, spread[:2])  # warm-up: kernels, adapter slots
        parallel_tok_s(base, prompts[:2], 4, None)
        for r in range(args.rounds):
            clock = CLOCK[args.clock]
            rows["par_base"].append(parallel_tok_s(base, prompts, args.output_len, None, clock))
            rows["par_lora"].append(parallel_tok_s(lora, prompts, args.output_len, spread, clock))
            rows["dec_base"].append(decode_tok_s(base, long_prompt, args.output_len, None, clock))
            rows["dec_lora"].append(decode_tok_s(lora, long_prompt, args.output_len, requests[0], clock))
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in rows.items()), flush=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    split = "" if args.lora_parallel_macs is None else f", split past {args.lora_parallel_macs} multiply-adds"
    split += "" if args.lora_prefetch is None else f", prefetch {args.lora_prefetch}"
    model = f"random {args.shape}-shaped Llama ({args.quantization})" if args.shape else args.model
    print(f"\nmodel {model}, {args.adapters} adapters of rank {args.rank} ({args.lora_dtype}{split}), "
          f"{torch.get_num_threads()} threads, {args.clock} clock, medians of {args.rounds} alternating rounds")
    print(f"{args.parallel} parallel {args.input_len}/{args.output_len}, generated tok/s: base {med['par_base']:.1f}, "
          f"across {args.adapters} adapters {med['par_lora']:.1f} -> {med['par_lora'] / med['par_base']:.2f}x")
    print(f"batch-1 decode after {args.decode_context}, tok/s: base {med['dec_base']:.1f}, with an adapter "
          f"{med['dec_lora']:.1f} -> {med['dec_lora'] / med['dec_base']:.2f}x")
    if args.replay_steps:
        with tempfile.TemporaryDirectory() as tmp:
            one = LoRARequest("r0", 99, write_adapter(os.path.join(tmp, "r0"), cfg, args.rank, 0))
            lora_s, base_s = replay_layers(lora, long_prompt, one, args.replay_steps, CLOCK[args.clock])
        rows["replay_lora"], rows["replay_base"] = lora_s, base_s
        lo, bo = min(lora_s), min(base_s)
        print(f"fused layers, one batch-1 step after {args.decode_context} replayed {args.replay_steps} times, ms: "
              f"base min {bo * 1e3:.2f} (median {statistics.median(base_s) * 1e3:.2f}), with the adapter min "
              f"{lo * 1e3:.2f} (median {statistics.median(lora_s) * 1e3:.2f}): +{(lo - bo) * 1e3:.2f} ms, "
              f"{bo / lo:.2f}x")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "rounds": rows, "medians": med}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

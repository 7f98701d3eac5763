"""PPL.LLM's benchmark rows on one NVIDIA GPU: a Llama-2-7B-shaped model with random weights
(`load_format="dummy"`), fp16, batch x (input / output) tokens, reported as PPL.LLM's table is:
prefill ms (the whole batch's prompts to their first tokens), decode ms per step, throughput in generated
tokens per second, memory; and at batch 1 the fraction of the GPU's memory bandwidth a decode step
reaches (the weights' bytes / step time / the GPU's peak). transformers' `generate` on a model of the
same shapes and dtype, same GPU, is the floor (`--hf`).

    python benchmarks/gpu_sweep.py --rows 1x8/256,64x8/256,1x1024/1024 --hf --output-json out.json

Decode ms per step = (time to generate `out` tokens - time to generate 1) / (out - 1), each a median of
`--repeats` runs after a warm-up run (which also compiles the Triton kernels for the row's shapes).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time

import torch

LLAMA2_7B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=32000, hidden_size=4096,
    intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
    max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
    torch_dtype="float16", bos_token_id=1, eos_token_id=2, hidden_act="silu",
)  # fmt: skip
# peak memory bandwidth by device name (bytes/s): the denominator of the batch-1 fraction
PEAK_BANDWIDTH = {"H100 PCIe": 2.0e12, "H100 NVL": 3.9e12, "H100": 3.35e12, "H200": 4.8e12, "H800": 3.35e12,
                  "A100-SXM4-80GB": 2.039e12, "A100": 1.555e12}  # fmt: skip


def peak_bandwidth(name: str) -> float | None:
    for key, value in PEAK_BANDWIDTH.items():
        if key in name:
            return value
    return None


def parse_rows(text: str) -> list[tuple[int, int, int]]:
    rows = []
    for part in text.split(","):
        batch, lens = part.strip().split("x")
        inp, out = lens.split("/")
        rows.append((int(batch), int(inp), int(out)))
    return rows


def model_folder(layers: int) -> str:
    path = tempfile.mkdtemp(prefix="llama2-7b-shape-")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**LLAMA2_7B, "num_hidden_layers": layers}, f)
    return path


def prompts(batch: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 32000, (batch, length), generator=g).tolist()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeats: int) -> float:
    """Median seconds of `repeats` calls (the GPU synchronized around each)."""
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class StepClock:
    """Seconds spent in the scheduler, in the runner (forward, sampling, and the wait for the GPU at its
    end) and in the whole engine step, summed over a run: where a decode step's time goes."""

    def __init__(self, core) -> None:
        self.totals = {"schedule": 0.0, "execute": 0.0, "step": 0.0}
        self.steps = 0
        for owner, name, key in ((core.scheduler, "schedule", "schedule"), (core.runner, "execute", "execute"),
                                 (core, "step", "step")):  # fmt: skip
            setattr(owner, name, self._timed(getattr(owner, name), key))

    def _timed(self, fn, key):
        def call(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.totals[key] += time.perf_counter() - t0
                self.steps += key == "step"

        return call

    def reset(self) -> None:
        self.totals = dict.fromkeys(self.totals, 0.0)
        self.steps = 0

    def per_step_ms(self) -> dict:
        n = max(1, self.steps)
        return {f"{k}_ms": v / n * 1e3 for k, v in self.totals.items()}


def perfxlm_rows(path: str, rows, args) -> list[dict]:
    from perfxlm import LLM, SamplingParams
    from perfxlm.worker.cuda_graphs import EagerForward

    longest = max(i + o for _, i, o in rows)
    llm = LLM(path, load_format="dummy", dtype=args.dtype, device=args.device, skip_tokenizer_init=True,
              max_model_len=longest, max_num_seqs=max(b for b, _, _ in rows),
              max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_dtype=args.kv_cache_dtype,
              gpu_memory_utilization=args.gpu_memory_utilization, enable_prefix_caching=False)  # fmt: skip
    core = llm.llm_engine.core
    weights = sum(p.numel() * p.element_size() for p in core.runner.model.parameters())
    per_token = core.kv_bytes_per_block // llm.llm_engine.config.block_size
    out_rows = []
    clock = StepClock(core)
    graphs = core.runner.forward_path
    eager_rows = parse_rows(args.eager_rows) if args.eager_rows else []
    for batch, inp, out, eager in [(*r, False) for r in rows] + [(*r, True) for r in eager_rows]:
        # the same engine with its decode graphs set aside: the eager path's cost, same weights and pool
        core.runner.forward_path = EagerForward() if eager else graphs
        ids = [{"prompt_token_ids": p} for p in prompts(batch, inp, inp)]

        def run(n: int) -> None:
            params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            llm.generate(ids, params, use_tqdm=False)

        run(min(out, 4))  # warm-up: Triton compiles this row's shapes
        on_gpu = args.device != "cpu"
        if on_gpu:
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if on_gpu else 0
        prefill = timed(lambda: run(1), args.repeats)
        clock.reset()
        total = timed(lambda: run(out), args.repeats)
        breakdown = clock.per_step_ms()
        if not eager and hasattr(graphs, "graphs") and batch in graphs.graphs:
            # the forward pass alone on the GPU: the row's captured graph replayed back to back (the static
            # inputs still hold this row's last step)
            graph = graphs.graphs[batch][0]
            breakdown["graph_replay_ms"] = timed(lambda: [graph.replay() for _ in range(20)], 1) / 20 * 1e3
        activations = torch.cuda.max_memory_allocated() - base if on_gpu else 0
        decode = (total - prefill) / max(1, out - 1)
        kv_used = batch * (inp + out) * per_token
        row = dict(engine="perfxlm eager" if eager else "perfxlm", batch=batch, input=inp, output=out, prefill_ms=prefill * 1e3,
                   decode_ms=decode * 1e3, throughput=batch * out / total,
                   memory_gib=(weights + kv_used + activations) / 2**30, weights_gib=weights / 2**30,
                   kv_pool_gib=core.num_kv_blocks * core.kv_bytes_per_block / 2**30, **breakdown)  # fmt: skip
        print(json.dumps(row), flush=True)
        out_rows.append(row)
    del llm, core
    gc.collect()
    torch.cuda.empty_cache()
    return out_rows


def hf_rows(layers: int, rows, args) -> list[dict]:
    """transformers' generate on a model of the same shapes and dtype (random weights made on the GPU:
    speed does not depend on the values), greedy, every row running to its full length."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{k: v for k, v in LLAMA2_7B.items() if k not in ("architectures", "model_type",
                                                                           "torch_dtype")})  # fmt: skip
    config.num_hidden_layers = layers
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).eval()
    torch.set_default_dtype(old)
    torch.cuda.reset_peak_memory_stats()
    out_rows = []
    for batch, inp, out in rows:
        ids = torch.tensor(prompts(batch, inp, inp), device="cuda")

        def run(n: int) -> None:
            with torch.inference_mode():
                model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

        run(min(out, 4))
        prefill = timed(lambda: run(1), args.repeats)
        total = timed(lambda: run(out), args.repeats)
        decode = (total - prefill) / max(1, out - 1)
        row = dict(engine="transformers", batch=batch, input=inp, output=out, prefill_ms=prefill * 1e3,
                   decode_ms=decode * 1e3, throughput=batch * out / total,
                   memory_gib=torch.cuda.max_memory_allocated() / 2**30)  # fmt: skip
        print(json.dumps(row), flush=True)
        out_rows.append(row)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return out_rows


def table(rows: list[dict], bandwidth: float | None, weight_bytes: float) -> str:
    lines = ["| engine | batch | in / out | prefill ms | decode ms | throughput tok/s | memory GiB | "
             "HBM fraction (batch 1) |", "|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        frac = ""
        if r["batch"] == 1 and bandwidth:
            frac = f"{weight_bytes / (r['decode_ms'] / 1e3) / bandwidth:.0%}"
        lines.append(f"| {r['engine']} | {r['batch']} | {r['input']} / {r['output']} | {r['prefill_ms']:.2f} | "
                     f"{r['decode_ms']:.2f} | {r['throughput']:,.1f} | {r['memory_gib']:.2f} | {frac} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1x8/256,64x8/256,1x1024/1024,64x1024/1024",
                    help="batch x input / output, comma-separated")
    ap.add_argument("--layers", type=int, default=32, help="fewer layers for a quick check")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--hf", action="store_true", help="also transformers' generate (the floor)")
    ap.add_argument("--hf-rows", default=None, help="the rows transformers runs (default: --rows)")
    ap.add_argument("--eager-rows", default="", help="rows also run with the decode graphs set aside")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of the script itself (use --layers 1)")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)
    if args.device != "cpu" and not torch.cuda.is_available():
        print("gpu_sweep: torch sees no CUDA device", file=sys.stderr)
        return 2
    rows = parse_rows(args.rows)
    name = torch.cuda.get_device_name() if args.device != "cpu" else "cpu"
    print(f"device: {name}, torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)
    path = model_folder(args.layers)
    results = perfxlm_rows(path, rows, args)
    weight_bytes = results[0]["weights_gib"] * 2**30
    if args.hf:
        results += hf_rows(args.layers, parse_rows(args.hf_rows) if args.hf_rows else rows, args)
    print(table(results, peak_bandwidth(name), weight_bytes))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "rows": results, "layers": args.layers,
                       "kv_cache_dtype": args.kv_cache_dtype}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

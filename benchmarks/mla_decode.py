"""DeepSeek-V2-Lite-shaped decode at a long context against a dense model of the same active bytes per step.

Two models of random weights (`--load-format dummy`: only a config.json is written), both bf16 by default:
  deepseek  DeepSeek-V2-Lite's shapes (hidden 2048, 16 heads, no query bottleneck, kv_lora_rank 512, rope 64,
            nope 128, v 128, 64 routed experts of 1408 top-6 plus 2 shared, the first layer dense of 10944,
            vocab 102400), with --layers layers (each MoE layer holds ~1.1 GB of bf16 experts)
  dense     a Llama of the same hidden size, vocab and layer count whose weights read per decode step
            (active bytes) are the same: 16 heads of 128, --dense-kv-heads KV heads, the MLP sized to make
            up the rest
Each is timed at batch-1 decode after a --context-token prompt (`perfxlm bench latency`), rounds
alternating which goes first; printed: KV-cache bytes per token (the latent against expanded K/V and the
dense model's K/V), active bytes per step, the median step times and their ratio (target: deepseek within
1.3x of dense).

    python benchmarks/mla_decode.py --threads 2 --rounds 3              # the 4k-context comparison
    python benchmarks/mla_decode.py --kernel-only                       # the MLA attention alone, per layer
    python benchmarks/mla_decode.py --gguf /tmp/ds-lite.Q8_0.gguf       # and llama.cpp's deepseek2 file
    python benchmarks/mla_decode.py --narrow --gguf /tmp/ds-narrow.Q8_0.gguf --gguf-only --context 1024
                                                                        # the 27-layer file for llama.cpp

--kernel-only times one layer's MLA attention at the context (4k, DeepSeek-V2-Lite's shapes): the one-call
kernel (csrc/mla_kernels.cpp) against the composition it replaced (absorption bmm, the paged attention
kernel over the latent as one KV head, W_UV bmm), per cache dtype.
--gguf OUT writes the deepseek model as llama.cpp's `deepseek2` GGUF (make_dummy_gguf.write_deepseek2:
materialises the weights in float32, ~4.5 GB per MoE layer) and prints the compare_llamacpp.py command that
runs llama.cpp and perfxlm on that file at the same context. llama.cpp loads a deepseek2 file without a
query bottleneck only at 27 layers (it recognises V2-Lite by its layer count): for fewer layers give
--q-lora-rank 1536 (DeepSeek-V2's), which both models' active bytes then include. The file carries the
embedded model's tokenizer, so with --gguf both models take its vocabulary (49152) instead of 102400.
--narrow keeps V2-Lite's 27 layers and its attention as it is (16 heads, kv_lora_rank 512, rope 64, nope
128, v 128: what a decode at a long context spends its time in) but narrows the rest (hidden 1024, 16
routed experts of 352, top-6 with 2 shared, the first layer dense of 2752), so llama.cpp takes it as V2-Lite
and the file is ~0.9 GB in Q8_0 instead of ~15 GB; --gguf-only then writes it and prints the comparison's
command without timing the dense model.
Not a test: timings on a shared machine are noise; take them on a quiet one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HIDDEN, HEADS, VOCAB = 2048, 16, 102400
DONOR_VOCAB = 49152  # the embedded SmolLM2 model's, whose tokenizer a --gguf file carries
LITE = dict(
    hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=HEADS, q_lora_rank=None, kv_lora_rank=512,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, intermediate_size=10944, moe_intermediate_size=1408,
    n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2, first_k_dense_replace=1, topk_method="greedy",
    routed_scaling_factor=1.0, vocab_size=VOCAB, max_position_embeddings=8192, tie_word_embeddings=False,
    rope_scaling=None,
)  # fmt: skip


# V2-Lite's layer count (how llama.cpp recognises a deepseek2 file without a query bottleneck) and its
# attention, the rest narrowed so the file fits a small machine (every width a whole number of 32-blocks)
NARROW = dict(hidden_size=1024, intermediate_size=2752, moe_intermediate_size=352, n_routed_experts=16)
LITE_LAYERS = 27


def deepseek_config(layers: int, q_lora_rank: int | None = None, narrow: bool = False) -> dict:
    return dict(LITE, **(NARROW if narrow else {}), num_hidden_layers=layers, q_lora_rank=q_lora_rank,
                architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2")


def active_params(c: dict) -> int:
    """Weights one decode step reads (embedding row aside): every layer's attention, the dense MLP or the
    routed top-k plus shared experts and the router, and the LM head."""
    h, layers = c["hidden_size"], c["num_hidden_layers"]
    if c["model_type"] == "deepseek_v2":
        H, n, r, v, rank = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
        q = c["q_lora_rank"]
        attn = (q * (h + H * (n + r)) if q else h * H * (n + r)) + h * (rank + r) + rank * H * (n + v) + H * v * h
        dense = 3 * h * c["intermediate_size"]
        moe = h * c["n_routed_experts"] + (c["num_experts_per_tok"] + c["n_shared_experts"]) * 3 * h * c["moe_intermediate_size"]
        first = c["first_k_dense_replace"]
        body = layers * attn + first * dense + (layers - first) * moe
    else:
        d = c["head_dim"]
        attn = 2 * h * c["num_attention_heads"] * d + 2 * h * c["num_key_value_heads"] * d
        body = layers * (attn + 3 * h * c["intermediate_size"])
    return body + c["vocab_size"] * h


def dense_config(ds: dict, kv_heads: int) -> dict:
    """A Llama with the deepseek model's hidden size, vocab and layers and its active weights per step."""
    layers, h, d = ds["num_hidden_layers"], ds["hidden_size"], 128
    attn = 2 * h * HEADS * d + 2 * h * kv_heads * d
    per_layer = (active_params(ds) - ds["vocab_size"] * h) / layers
    inter = round((per_layer - attn) / (3 * h) / 64) * 64
    return dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=h, num_hidden_layers=layers,
        num_attention_heads=HEADS, num_key_value_heads=kv_heads, head_dim=d, intermediate_size=inter,
        vocab_size=ds["vocab_size"], max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=False, hidden_act="silu",
    )  # fmt: skip


def kv_bytes(c: dict, itemsize: int) -> int:
    """KV-cache bytes per token and layer as the engine stores them."""
    if c["model_type"] == "deepseek_v2":
        return (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * itemsize
    return 2 * c["num_key_value_heads"] * c["head_dim"] * itemsize


def expanded_kv_bytes(c: dict, itemsize: int) -> int:
    """What MLA's K and V would take expanded per head (as a non-latent cache would hold them)."""
    return c["num_attention_heads"] * (c["qk_nope_head_dim"] + c["qk_rope_head_dim"] + c["v_head_dim"]) * itemsize


def run_once(folder: Path, a: argparse.Namespace) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "lat.json"
        cmd = [sys.executable, "-m", "perfxlm", "bench", "latency", "--model", str(folder), "--load-format", "dummy",
               "--dtype", a.dtype, "--batch-size", "1", "--input-len", str(a.context), "--output-len",
               str(a.new_tokens), "--num-iters", "1", "--num-iters-warmup", "1", "--threads", str(a.threads),
               "--kv-cache-dtype", a.kv, "--quiet", "--output-json", str(out)]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
        return json.loads(out.read_text())["median_decode_step_ms"]


def kernel_only(a: argparse.Namespace) -> dict:
    """One layer's MLA attention at the context: the kernel against the composition it replaced."""
    import torch

    from perfxlm.ops import native
    from perfxlm.ops.attention import paged_decode_attention, write_kv_cache_torch
    from perfxlm.ops.kv_quant import KVCacheSpec

    torch.set_num_threads(a.threads)
    ops = native.kernels()
    if ops is None:
        raise SystemExit("the native kernels are not built on this machine")
    c = LITE
    H, n, r, v, rank = HEADS, c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
    block, T = 16, a.context
    g = torch.Generator().manual_seed(0)
    query = torch.randn(1, H, n + r, generator=g)
    w_uk = (torch.randn(H, n, rank, generator=g) * 0.05).bfloat16()
    w_uv_t = (torch.randn(H, rank, v, generator=g) * 0.05).bfloat16()
    scale = (n + r) ** -0.5
    tables = torch.arange((T + block - 1) // block, dtype=torch.int64)[None]
    lens = torch.tensor([T])
    results = {}
    for kv in ["bfloat16", "int8", "fp8_e4m3"]:
        spec = KVCacheSpec.resolve("auto", torch.bfloat16) if kv == "bfloat16" else KVCacheSpec.resolve(kv, torch.bfloat16)
        cache = spec.allocate(tables.shape[1], block, 1, rank + r, value_is_key=True)
        rows = torch.randn(T, 1, rank + r, generator=g)
        write_kv_cache_torch(rows, rows, cache.key, cache.value, torch.arange(T), cache.key_scale, cache.value_scale)
        uk, uv = w_uk.float(), w_uv_t.float()  # the module path's absorbed matrices (float32 activations)

        def kernel(cache=cache):
            return ops.mla_decode_attention(query, cache.key, cache.key_scale, tables, lens, w_uk, w_uv_t, scale)

        def composed(cache=cache, uk=uk, uv=uv):
            q_lat = torch.bmm(query[..., :n].transpose(0, 1), uk).transpose(0, 1)
            q = torch.cat((q_lat, query[..., n:]), dim=-1)
            o = paged_decode_attention(q, cache.key, cache.value, tables, lens, scale, key_scale=cache.key_scale,
                                       value_scale=cache.value_scale)[..., :rank]  # fmt: skip
            return torch.bmm(o.transpose(0, 1), uv).transpose(0, 1)

        times = {"kernel": [], "composed": []}
        for fn in (kernel, composed):
            fn()
        for rnd in range(a.rounds):
            for name, fn in (("kernel", kernel), ("composed", composed))[:: 1 if rnd % 2 == 0 else -1]:
                t0 = time.perf_counter()
                for _ in range(a.repeats):
                    fn()
                times[name].append((time.perf_counter() - t0) / a.repeats * 1e3)
        k, m = statistics.median(times["kernel"]), statistics.median(times["composed"])
        err = (kernel() - composed()).abs().max().item()
        print(f"{kv:>9} cache, {T} tokens: kernel {k:.3f} ms/layer, composed {m:.3f} ms/layer "
              f"({m / k:.2f}x), max |diff| {err:.2e}")  # fmt: skip
        results[kv] = {"kernel_ms": k, "composed_ms": m}
    return results


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=3, help="decoder layers of both models (the first dense)")
    ap.add_argument("--dense-kv-heads", type=int, default=4, help="the dense model's KV heads (GQA)")
    ap.add_argument("--context", type=int, default=4096, help="prompt tokens before the timed decode steps")
    ap.add_argument("--new-tokens", type=int, default=32, help="decode steps per run")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--kv", default="auto", help="kv_cache_dtype of both models")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=20, help="--kernel-only: calls per timing")
    ap.add_argument("--kernel-only", action="store_true", help="time the MLA attention alone, per layer")
    ap.add_argument("--gguf", default=None, help="also write the deepseek model as llama.cpp's deepseek2 GGUF here")
    ap.add_argument("--gguf-type", default="Q8_0", help="--gguf: GGML type of its matrices")
    ap.add_argument("--q-lora-rank", type=int, default=None,
                    help="a query bottleneck (DeepSeek-V2's 1536): llama.cpp takes a deepseek2 file without one only "
                         "at 27 layers, V2-Lite's count (it tells Lite apart by the layer count)")
    ap.add_argument("--narrow", action="store_true",
                    help=f"{LITE_LAYERS} layers of V2-Lite's attention, the rest narrowed (see above)")
    ap.add_argument("--gguf-only", action="store_true", help="with --gguf: write the file, time nothing")
    ap.add_argument("--output-json", default=None)
    a = ap.parse_args(argv)
    if a.narrow:
        a.layers = LITE_LAYERS
    if a.gguf_only and not a.gguf:
        ap.error("--gguf-only needs --gguf OUT")
    if a.kernel_only:
        result = {"kernel": kernel_only(a)}
        if a.output_json:
            Path(a.output_json).write_text(json.dumps(result, indent=2))
        return result

    ds = deepseek_config(a.layers, a.q_lora_rank, a.narrow)
    if a.gguf:  # llama.cpp needs a tokenizer: the embedded model's (a donor GGUF), so its vocabulary
        ds["vocab_size"] = DONOR_VOCAB
    if a.gguf and not a.q_lora_rank and a.layers != LITE_LAYERS:
        ap.error(f"llama.cpp loads a deepseek2 file without a query bottleneck only at {LITE_LAYERS} layers: "
                 f"give --layers {LITE_LAYERS}, --narrow or --q-lora-rank 1536")
    if a.gguf_only:
        print(f"active weights per step: {active_params(ds) / 1e6:.1f} M; KV cache per token and layer: latent "
              f"{kv_bytes(ds, 2)} B in bf16, expanded K/V would be {expanded_kv_bytes(ds, 2)} B")  # fmt: skip
        write_gguf(ds, a)
        return {"config": vars(a), "active_params": {"deepseek": active_params(ds)}}
    dense = dense_config(ds, a.dense_kv_heads)
    item = 4 if a.dtype == "float32" and a.kv == "auto" else (2 if a.kv == "auto" else 1)
    print(f"active weights per step: deepseek {active_params(ds) / 1e6:.1f} M, dense {active_params(dense) / 1e6:.1f} M "
          f"(dense MLP {dense['intermediate_size']}, {a.dense_kv_heads} KV heads)")  # fmt: skip
    lat, exp, dkv = kv_bytes(ds, item), expanded_kv_bytes(ds, item), kv_bytes(dense, item)
    print(f"KV cache per token and layer ({a.kv}, {item} B/value): latent {lat} B, expanded K/V would be {exp} B "
          f"({exp / lat:.1f}x), the dense model's {dkv} B")  # fmt: skip
    result: dict = {"config": vars(a), "kv_bytes_per_token_layer": {"latent": lat, "expanded": exp, "dense": dkv},
                    "active_params": {"deepseek": active_params(ds), "dense": active_params(dense)}}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        folders = {}
        for name, config in (("deepseek", ds), ("dense", dense)):
            folders[name] = Path(tmp) / name
            folders[name].mkdir()
            (folders[name] / "config.json").write_text(json.dumps(dict(config, torch_dtype=a.dtype)))
        times: dict[str, list[float]] = {"deepseek": [], "dense": []}
        for rnd in range(a.rounds):
            for name in (["deepseek", "dense"] if rnd % 2 == 0 else ["dense", "deepseek"]):
                times[name].append(run_once(folders[name], a))
                print(f"  round {rnd + 1}: {name} {times[name][-1]:.2f} ms / decode step", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"decode at {a.context} tokens, batch 1, {a.threads} threads: deepseek {med['deepseek']:.2f} ms, dense "
          f"{med['dense']:.2f} ms, ratio {med['deepseek'] / med['dense']:.2f} (target <= 1.3)")  # fmt: skip
    result["decode_step_ms"] = {"raw": times, "median": med, "ratio": med["deepseek"] / med["dense"]}
    if a.gguf:
        write_gguf(ds, a)
    if a.output_json:
        Path(a.output_json).write_text(json.dumps(result, indent=2))
    return result


def write_gguf(ds: dict, a: argparse.Namespace) -> None:
    import torch
    import transformers

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from make_dummy_gguf import write_deepseek2

    from perfxlm.config import default_model_path

    config = transformers.DeepseekV2Config(**{k: v for k, v in ds.items() if k not in ("architectures", "model_type")})
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = transformers.DeepseekV2ForCausalLM(config).eval()
    write_deepseek2(a.gguf, model, a.gguf_type, donor=default_model_path())
    print(f"wrote {a.gguf}; llama.cpp against perfxlm on it at the same context:\n"
          f"  python benchmarks/compare_llamacpp.py --gguf {a.gguf} --rows prefill,decode --prompt-tokens {a.context} "
          f"--decode-tokens {a.new_tokens} --threads {a.threads} --rounds {a.rounds}")  # fmt: skip


if __name__ == "__main__":
    main()

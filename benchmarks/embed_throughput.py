"""Embedding throughput, same run: perfxlm's pooling runner against sentence-transformers on one folder and
llama.cpp (llama-cpp-python's build of it, embedding mode) on that folder's GGUF.

Texts are the first human turns of the ShareGPT sample, truncated to --max-tokens (256) by both engines.
Without --model, a random-weight encoder of a real model's shape is built (all-MiniLM-L6: 6 layers of 384;
bge-base: 12 of 768) with a WordPiece tokenizer trained on the same texts, so token counts look like a
real English vocabulary's. Reports texts/s and tokens/s of each, their ratio, and the lowest cosine
between the two engines' embeddings (a check that both computed the same thing).

    python benchmarks/embed_throughput.py --shape minilm --threads 2
    python benchmarks/embed_throughput.py --shape bge-base --num-texts 1024 --output-json embed.json
    python benchmarks/embed_throughput.py --model /path/to/sentence-transformers/folder
    python benchmarks/embed_throughput.py --shape bge-base --quantization w8a8-token   # + the int8 fast path
    python benchmarks/embed_throughput.py --shape bge-base --num-texts 1024 --llamacpp        # the issue's rows

--llamacpp converts the folder to a GGUF of the same weights (`make_dummy_gguf.py --from-hf`'s BERT writer;
F32, or --llamacpp-type F16 / Q8_0 through llama.cpp's own quantizer) and times llama.cpp's forward on the
token ids the HF tokenizer gives (the same ids perfxlm embeds; llama.cpp's own tokenizing is left out of
its time), batched as `llama-embedding` batches: whole sequences packed up to --llamacpp-batch tokens, one
ubatch each (non-causal attention needs a sequence in one ubatch), longest first as perfxlm packs them.

--quantization also times perfxlm with that quantization (a name, JSON, or "w8a8-token": W8A8 with one
activation scale per token, the integer-GEMM path, which plain "w8a8" also means on the pooling runner)
in the same run, and reports its cosine to the
float32 reference and how often each text's nearest other text stays the same.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

SHAPES = {
    "minilm": dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536),
    "bge-base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
}
DEFAULT_DATA = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "datasets", "sharegpt_samples_1024.json")


def load_texts(path: str, n: int) -> list[str]:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    texts = []
    for entry in data:
        turns = entry.get("conversations") or []
        if turns and turns[0].get("value"):
            texts.append(turns[0]["value"])
    if not texts:
        raise SystemExit(f"{path}: no ShareGPT conversations found.")
    return [texts[i % len(texts)] for i in range(n)]


def build_model(folder: str, shape: str, texts: list[str]) -> str:
    """A random encoder of `shape` saved as sentence-transformers saves one (CLS pooling, normalized)."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from tokenizers import BertWordPieceTokenizer
    from transformers import BertConfig, BertModel, BertTokenizerFast

    raw = os.path.join(folder, "raw")
    os.makedirs(raw, exist_ok=True)
    wordpiece = BertWordPieceTokenizer(lowercase=True)
    wordpiece.train_from_iterator(texts, vocab_size=30522, show_progress=False)
    wordpiece.save_model(raw)
    BertTokenizerFast(os.path.join(raw, "vocab.txt"), model_max_length=512).save_pretrained(raw)
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=wordpiece.get_vocab_size(), max_position_embeddings=512,
                         **SHAPES[shape])).eval().save_pretrained(raw)
    transformer = Transformer(raw, max_seq_length=512)
    modules = [transformer, Pooling(transformer.get_embedding_dimension(), pooling_mode="cls"), Normalize()]
    out = os.path.join(folder, "st")
    SentenceTransformer(modules=modules, device="cpu").save(out)
    return out


def write_gguf(folder: str, tmp: str, ftype: str) -> str:
    """The folder's encoder as a llama.cpp `bert` GGUF (F32), quantized by llama.cpp itself to `ftype`."""
    import importlib.util

    import llama_cpp

    spec = importlib.util.spec_from_file_location("make_dummy_gguf", os.path.join(os.path.dirname(__file__),
                                                                                  "make_dummy_gguf.py"))
    converter = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(converter)
    path = os.path.join(tmp, "model.f32.gguf")
    converter.write_bert(path, folder)
    if ftype == "F32":
        return path
    out = os.path.join(tmp, f"model.{ftype.lower()}.gguf")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = {"F16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16, "Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0}[ftype]
    if llama_cpp.llama_model_quantize(path.encode(), out.encode(), params) != 0:
        raise SystemExit(f"llama.cpp could not quantize {path} to {ftype}")
    return out


def llamacpp_embed(path: str, token_ids: list[list[int]], threads: int, batch: int, flash_attn: bool):
    """llama.cpp's pooled embeddings of `token_ids` (in their order), and the wall and CPU seconds its forward
    passes took (its threads run in this process):
    llama-cpp-python's `Llama.embed` loop on ids instead of texts (so both engines embed the same tokens)."""
    import llama_cpp
    import numpy as np

    longest = max(len(t) for t in token_ids)
    if longest > batch:
        raise SystemExit(f"--llamacpp-batch {batch} is shorter than the longest input ({longest} tokens)")
    llm = llama_cpp.Llama(path, embedding=True, n_ctx=batch, n_batch=batch, n_ubatch=batch, n_threads=threads,
                          n_threads_batch=threads, flash_attn=flash_attn, verbose=False)
    ctx, n_embd, max_seqs = llm._ctx, llm.n_embd(), llm.context_params.n_seq_max
    out = np.zeros((len(token_ids), n_embd), dtype=np.float32)

    def decode(rows: list[int]) -> None:
        ctx.kv_cache_clear()
        ctx.decode(llm._batch)
        llm._batch.reset()
        for seq, row in enumerate(rows):
            out[row] = np.ctypeslib.as_array(llama_cpp.llama_get_embeddings_seq(ctx.ctx, seq), shape=(n_embd,))

    def run(order: list[int]) -> None:
        llm._batch.reset()
        rows: list[int] = []
        tokens = 0
        for row in order:
            n = len(token_ids[row])
            if rows and (tokens + n > batch or len(rows) >= max_seqs):
                decode(rows)
                rows, tokens = [], 0
            llm._batch.add_sequence(token_ids[row], len(rows), True)
            rows.append(row)
            tokens += n
        decode(rows)

    order = sorted(range(len(token_ids)), key=lambda i: -len(token_ids[i]))
    run(order[:8])  # warm-up
    start, cpu = time.perf_counter(), time.process_time()
    run(order)
    return out, time.perf_counter() - start, time.process_time() - cpu


def quality(ours, ref) -> dict:
    """Cosine of each embedding to the reference's, and retrieval stability: for each text, whether its
    nearest other text (top 1) and its 10 nearest stay the same under `ours` as under `ref`."""
    import numpy as np

    a = ours / np.linalg.norm(ours, axis=1, keepdims=True)
    b = ref / np.linalg.norm(ref, axis=1, keepdims=True)
    cos = (a * b).sum(1)
    sa, sb = a @ a.T, b @ b.T
    np.fill_diagonal(sa, -2.0)
    np.fill_diagonal(sb, -2.0)
    k = min(10, len(a) - 1)
    ta, tb = np.argsort(-sa, axis=1)[:, :k], np.argsort(-sb, axis=1)[:, :k]
    overlap = np.mean([len(set(x) & set(y)) / k for x, y in zip(ta, tb)])
    return {"q_min_cosine": float(cos.min()), "q_mean_cosine": float(cos.mean()),
            "q_top1_same": float((ta[:, 0] == tb[:, 0]).mean()), "q_top10_overlap": float(overlap)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a sentence-transformers folder (default: a random --shape model)")
    ap.add_argument("--shape", default="minilm", choices=sorted(SHAPES))
    ap.add_argument("--dataset", default=DEFAULT_DATA, help="ShareGPT JSON (the first human turn of each entry)")
    ap.add_argument("--num-texts", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=256, help="inputs truncated to this many tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--st-batch-size", type=int, default=32, help="sentence-transformers' encode batch size")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="perfxlm's tokens per forward pass")
    ap.add_argument("--skip-reference", action="store_true", help="time perfxlm only")
    ap.add_argument("--quantization", default=None, help="also time perfxlm with this quantization "
                    "(a name, JSON, or w8a8-token: one activation scale per token)")
    ap.add_argument("--llamacpp", action="store_true", help="also time llama.cpp on the folder's GGUF")
    ap.add_argument("--llamacpp-type", default="F32", choices=("F32", "F16", "Q8_0"), help="the GGUF's matrices")
    ap.add_argument("--llamacpp-batch", type=int, default=2048, help="llama.cpp's tokens per forward pass "
                    "(its attention spans the whole batch: smaller batches can be faster)")
    ap.add_argument("--llamacpp-flash-attn", action="store_true", help="llama.cpp with flash attention")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()

    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    texts = load_texts(args.dataset, args.num_texts)
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model or build_model(tmp, args.shape, texts)
        from perfxlm import LLM, PoolingParams

        kwargs = {"max_num_batched_tokens": args.max_num_batched_tokens} if args.max_num_batched_tokens else {}
        params = PoolingParams(truncate_prompt_tokens=args.max_tokens)

        def run(**extra):
            llm = LLM(folder, dtype="float32", **kwargs, **extra)
            llm.embed(texts[:8], pooling_params=params, use_tqdm=False)  # warm-up
            start, cpu = time.perf_counter(), time.process_time()
            outs = llm.embed(texts, pooling_params=params, use_tqdm=False)
            cpu_s[len(cpu_s)] = time.process_time() - cpu
            return outs, time.perf_counter() - start

        cpu_s: dict[int, float] = {}  # CPU seconds of each timed run, in order: under load, steadier than wall
        outs, ours_s = run()
        quant_outs = None
        if args.quantization:
            q = args.quantization
            q = {"method": "w8a8", "activation_group_size": -1} if q == "w8a8-token" else (
                json.loads(q) if q.startswith("{") else q)
            quant_outs, quant_s = run(quantization=q)
            result_cpu = {"perfxlm_q_cpu_s": cpu_s[1]}
        tokens = sum(len(o.prompt_token_ids) for o in outs)
        result = {"model": args.model or args.shape, "num_texts": len(texts), "tokens": tokens,
                  "threads": args.threads, "perfxlm_texts_per_s": len(texts) / ours_s,
                  "perfxlm_tokens_per_s": tokens / ours_s, "perfxlm_cpu_s": cpu_s[0]}
        if quant_outs is not None:
            result.update(quantization=args.quantization, perfxlm_q_texts_per_s=len(texts) / quant_s,
                          q_speedup_over_float=ours_s / quant_s, **result_cpu)
        if not args.skip_reference:
            from sentence_transformers import SentenceTransformer

            st = SentenceTransformer(folder, device="cpu")
            st.max_seq_length = args.max_tokens
            st.encode(texts[:8], batch_size=args.st_batch_size)
            start, cpu = time.perf_counter(), time.process_time()
            ref = st.encode(texts, batch_size=args.st_batch_size, convert_to_numpy=True)
            st_s, st_cpu = time.perf_counter() - start, time.process_time() - cpu
            ours = np.array([o.outputs.embedding for o in outs])
            cos = (ours * ref).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(ref, axis=1)
            result.update(st_texts_per_s=len(texts) / st_s, st_tokens_per_s=tokens / st_s, speedup=st_s / ours_s,
                          st_cpu_s=st_cpu,
                          min_cosine=float(cos.min()))
            if quant_outs is not None:
                q = np.array([o.outputs.embedding for o in quant_outs])
                result.update(q_speedup=st_s / quant_s, **quality(q, ref))
        if args.llamacpp:
            gguf_path = write_gguf(folder, tmp, args.llamacpp_type)
            ids = [o.prompt_token_ids for o in outs]
            peer, peer_s, peer_cpu = llamacpp_embed(gguf_path, ids, args.threads, args.llamacpp_batch, args.llamacpp_flash_attn)
            ours = np.array([o.outputs.embedding for o in outs])
            peer_cos = (ours * peer).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(peer, axis=1)
            result.update(llamacpp_type=args.llamacpp_type, llamacpp_cpu_s=peer_cpu, llamacpp_batch=args.llamacpp_batch,
                          llamacpp_texts_per_s=len(texts) / peer_s, llamacpp_tokens_per_s=tokens / peer_s,
                          speedup_over_llamacpp=peer_s / ours_s, llamacpp_min_cosine=float(peer_cos.min()))
            if quant_outs is not None:
                result.update(q_speedup_over_llamacpp=peer_s / quant_s)
    for key, value in result.items():
        print(f"{key:>22}: {value:.4f}" if isinstance(value, float) else f"{key:>22}: {value}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

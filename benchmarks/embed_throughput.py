"""Embedding throughput, same run: perfxlm's pooling runner against sentence-transformers on one folder.

Texts are the first human turns of the ShareGPT sample, truncated to --max-tokens (256) by both engines.
Without --model, a random-weight encoder of a real model's shape is built (all-MiniLM-L6: 6 layers of 384;
bge-base: 12 of 768) with a WordPiece tokenizer trained on the same texts, so token counts look like a
real English vocabulary's. Reports texts/s and tokens/s of each, their ratio, and the lowest cosine
between the two engines' embeddings (a check that both computed the same thing).

    python benchmarks/embed_throughput.py --shape minilm --threads 2
    python benchmarks/embed_throughput.py --shape bge-base --num-texts 1024 --output-json embed.json
    python benchmarks/embed_throughput.py --model /path/to/sentence-transformers/folder
    python benchmarks/embed_throughput.py --shape bge-base --quantization w8a8-token   # + the int8 fast path

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
            start = time.perf_counter()
            outs = llm.embed(texts, pooling_params=params, use_tqdm=False)
            return outs, time.perf_counter() - start

        outs, ours_s = run()
        quant_outs = None
        if args.quantization:
            q = args.quantization
            q = {"method": "w8a8", "activation_group_size": -1} if q == "w8a8-token" else (
                json.loads(q) if q.startswith("{") else q)
            quant_outs, quant_s = run(quantization=q)
        tokens = sum(len(o.prompt_token_ids) for o in outs)
        result = {"model": args.model or args.shape, "num_texts": len(texts), "tokens": tokens,
                  "threads": args.threads, "perfxlm_texts_per_s": len(texts) / ours_s,
                  "perfxlm_tokens_per_s": tokens / ours_s}
        if quant_outs is not None:
            result.update(quantization=args.quantization, perfxlm_q_texts_per_s=len(texts) / quant_s,
                          q_speedup_over_float=ours_s / quant_s)
        if not args.skip_reference:
            from sentence_transformers import SentenceTransformer

            st = SentenceTransformer(folder, device="cpu")
            st.max_seq_length = args.max_tokens
            st.encode(texts[:8], batch_size=args.st_batch_size)
            start = time.perf_counter()
            ref = st.encode(texts, batch_size=args.st_batch_size, convert_to_numpy=True)
            st_s = time.perf_counter() - start
            ours = np.array([o.outputs.embedding for o in outs])
            cos = (ours * ref).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(ref, axis=1)
            result.update(st_texts_per_s=len(texts) / st_s, st_tokens_per_s=tokens / st_s, speedup=st_s / ours_s,
                          min_cosine=float(cos.min()))
            if quant_outs is not None:
                q = np.array([o.outputs.embedding for o in quant_outs])
                result.update(q_speedup=st_s / quant_s, **quality(q, ref))
    for key, value in result.items():
        print(f"{key:>22}: {value:.4f}" if isinstance(value, float) else f"{key:>22}: {value}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

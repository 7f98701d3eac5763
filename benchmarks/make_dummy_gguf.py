"""Write a Llama GGUF of a chosen shape with random weights, for speed comparisons at sizes no local file has.

The tokenizer (and so the vocabulary size) is copied from a donor GGUF, by default the embedded
SmolLM2 model, so prompts tokenize as usual; every other tensor is drawn from N(0, 0.02) (norms 1.0) and
stored as F16, which `compare_llamacpp.py --llamacpp-ftype` / `requantize` turn into Q8_0, Q4_0, ...
Speed depends on shapes, not on values, so a dummy file measures what a real one of that shape would.

    python benchmarks/make_dummy_gguf.py /tmp/llama-1b-shape.f16.gguf            # Llama-3.2-1B body
    python benchmarks/make_dummy_gguf.py out.gguf --hidden 4096 --layers 32 --intermediate 14336
"""

from __future__ import annotations

import argparse

import numpy as np
from tqdm import tqdm


def donor_tokenizer(path: str) -> list[tuple[str, object, object]]:
    """(key, value, GGUFValueType) of every tokenizer.* field of the donor file."""
    import gguf

    reader = gguf.GGUFReader(path)
    fields = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            item_type = field.types[1] if len(field.types) > 1 else None
            fields.append((key, field.contents(), item_type))
        else:
            fields.append((key, field.contents(), kind))
    return fields


def write_dummy(path: str, donor: str, hidden: int, layers: int, intermediate: int, heads: int, kv_heads: int,
                context: int, rope_theta: float, seed: int) -> None:
    import gguf

    rng = np.random.default_rng(seed)
    tokenizer = donor_tokenizer(donor)
    vocab = next(len(v) for k, v, _ in tokenizer if k == "tokenizer.ggml.tokens")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name(f"dummy-llama-{hidden}x{layers}")
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_rope_freq_base(rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for key, value, kind in tokenizer:
        if isinstance(value, list):
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, kind)

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)

    head_dim = hidden // heads
    writer.add_tensor("token_embd.weight", normal(vocab, hidden))  # tied: no output.weight
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in tqdm(range(layers), desc="layers", unit="layer"):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{i}.attn_q.weight", normal(heads * head_dim, hidden))
        writer.add_tensor(f"blk.{i}.attn_k.weight", normal(kv_heads * head_dim, hidden))
        writer.add_tensor(f"blk.{i}.attn_v.weight", normal(kv_heads * head_dim, hidden))
        writer.add_tensor(f"blk.{i}.attn_output.weight", normal(hidden, heads * head_dim))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", normal(intermediate, hidden))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", normal(intermediate, hidden))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", normal(hidden, intermediate))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=True)
    writer.close()


def main() -> None:
    from perfxlm.config import default_model_path

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="GGUF file to write")
    p.add_argument("--donor", default=None, 
                   help="GGUF whose tokenizer is copied (default: the embedded model)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--intermediate", type=int, default=8192)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--rope-theta", type=float, default=500000.0)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    donor = a.donor or default_model_path()
    write_dummy(a.out, donor, a.hidden, a.layers, a.intermediate, a.heads, a.kv_heads, a.context, a.rope_theta,
                a.seed)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()

"""`perfxlm bench embed` end to end: random token ids on a causal LM (as a last-token embedder), ShareGPT
texts on an encoder, each cut to --max-tokens."""

from __future__ import annotations

import json
import os

import pytest

from perfxlm.entrypoints.cli import main
from tests.pooling.checkpoints import make_encoder

SHAREGPT = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "datasets", "sharegpt_samples_1024.json")


def test_bench_embed_random_on_a_causal_lm(tiny_llama, tmp_path, capsys):
    out = tmp_path / "embed.json"
    assert main(["bench", "embed", tiny_llama, "--dataset", "random", "--num-prompts", "7", "--input-len", "11",
                 "--skip-tokenizer-init", "--disable-tqdm", "--output-json", str(out)]) == 0
    assert "Embedding throughput:" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["num_texts"] == 7 and data["total_input_tokens"] == 77
    assert data["texts_per_second"] == pytest.approx(7 / data["elapsed_time"])
    assert data["config"]["pooling_type"] == "LAST"


def test_bench_embed_sharegpt_on_an_encoder(tmp_path, capsys):
    path = os.path.abspath(SHAREGPT)
    if not os.path.isfile(path):
        pytest.skip(f"the ShareGPT sample file is not there ({path})")
    model = make_encoder(str(tmp_path / "enc"), "bert", max_positions=48)
    out = tmp_path / "embed.json"
    assert main(["bench", "embed", model, "--dataset", "sharegpt", path, "--num-prompts", "9", "--max-tokens", "40",
                 "--disable-tqdm", "--output-json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["num_texts"] == 9 and 9 * 3 <= data["total_input_tokens"] <= 9 * 40
    assert data["config"]["max_tokens"] == 40 and data["config"]["pooling_type"] == "CLS"


def test_bert_gguf_writer_gives_llama_cpp_the_same_encoder(tmp_path):
    """The embedding benchmark's llama.cpp peer runs a GGUF of the folder's weights: llama.cpp's CLS
    embeddings of that file equal sentence-transformers' on the folder, and its WordPiece vocabulary
    tokenizes as the folder's tokenizer does."""
    llama_cpp = pytest.importorskip("llama_cpp")
    import numpy as np
    from sentence_transformers import SentenceTransformer

    from tests.model.dummy_gguf import converter
    from tests.pooling.checkpoints import make_sentence_transformer

    folder = make_sentence_transformer(str(tmp_path / "st"), "bert", pooling="cls", hidden_size=45, heads=3,
                                       intermediate=71, layers=3)
    path = str(tmp_path / "bert.gguf")
    converter().write_bert(path, folder)
    llm = llama_cpp.Llama(path, embedding=True, n_ctx=64, n_batch=64, n_ubatch=64, n_threads=1, verbose=False)
    st = SentenceTransformer(folder, device="cpu")
    texts = ["the cat sat on the mat", "what is paris?", "berlin, capital of germany. red blue green dog"]
    assert [llm.tokenize(t.encode()) for t in texts] == st.tokenizer(texts)["input_ids"]
    ours, ref = np.array(llm.embed(texts, normalize=True)), st.encode(texts)
    cos = (ours * ref).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() >= 0.9999, cos
    # the benchmark's own loop on token ids: longest first, packed 16 tokens a pass (12, then 8 + 6),
    # each embedding back in its text's row
    import importlib.util

    spec = importlib.util.spec_from_file_location("embed_throughput", os.path.join(
        os.path.dirname(__file__), "..", "..", "benchmarks", "embed_throughput.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    ids = st.tokenizer(texts)["input_ids"]
    got, wall, cpu = bench.llamacpp_embed(path, ids, 1, 16, False)
    assert wall > 0 and cpu > 0 and sorted(len(t) for t in ids) == [6, 8, 12]
    np.testing.assert_allclose(got / np.linalg.norm(got, axis=1, keepdims=True), ours, rtol=0, atol=1e-5)

"""Encoders on the pooling runner against sentence-transformers on the same folder (float32, random weights):
bi-encoder embeddings (SentenceTransformer.encode) and cross-encoder scores (CrossEncoder.predict)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from perfxlm import LLM, PoolingParams
from tests.pooling.checkpoints import make_encoder, make_sentence_transformer

TEXTS = [
    "what is the capital of france?",
    "a",
    "the cat sat on the mat, and the dog sat on the red mat!",
    "berlin is the capital of germany",
    "query: blue green 42",
    "passage: paris",
    "zzzz qqq xylophone",  # word pieces and unknown characters
]


@pytest.fixture(scope="module", params=[
    ("bert", "cls", True), ("bert", "mean", False), ("xlmr", "cls", True), ("xlmr", "mean", True),
    ("modernbert", "mean", True),
], ids=lambda p: "-".join(map(str, p)))
def bi_encoder(request, tmp_path_factory):
    family, pooling, normalize = request.param
    path = str(tmp_path_factory.mktemp("st") / "model")
    # odd sizes: 5 heads of 7, 3 layers; a short window so that truncation shows
    # rotary (ModernBERT) needs an even head size: 3 heads of 10 there
    hidden, heads = (30, 3) if family == "modernbert" else (35, 5)
    make_sentence_transformer(path, family, pooling, normalize, max_seq_length=13, hidden_size=hidden, heads=heads,
                              layers=3, intermediate=47)
    return path


def test_embeddings_equal_sentence_transformers(bi_encoder):
    from sentence_transformers import SentenceTransformer

    expected = SentenceTransformer(bi_encoder, device="cpu").encode(TEXTS, convert_to_numpy=True)
    llm = LLM(bi_encoder, dtype="float32")
    assert llm.runner_kind == "pooling"  # an encoder: runner="auto" picks pooling
    outs = llm.embed(TEXTS, truncate_prompt_tokens=-1, use_tqdm=False)  # ST truncates to its window
    got = np.array([o.outputs.embedding for o in outs])
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)
    cos = (got * expected).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)
    assert cos.min() >= 0.9999
    # one at a time, and in batches of odd budgets: the same values (padding-free batches, per-sequence masks)
    small = LLM(bi_encoder, dtype="float32", max_num_batched_tokens=17, max_num_seqs=3)
    batched = np.array([o.outputs.embedding for o in small.embed(TEXTS, truncate_prompt_tokens=-1, use_tqdm=False)])
    single = np.array([llm.embed(t, truncate_prompt_tokens=-1, use_tqdm=False)[0].outputs.embedding for t in TEXTS])
    np.testing.assert_allclose(batched, got, atol=1e-6, rtol=0)
    np.testing.assert_allclose(single, got, atol=1e-6, rtol=0)


@pytest.mark.parametrize("family", ["bert", "xlmr", "modernbert"])
def test_cross_encoder_scores_equal_crossencoder_predict(family, tmp_path):
    from sentence_transformers import CrossEncoder

    path = make_encoder(str(tmp_path / "ce"), family, classifier=True, num_labels=1,
                        hidden_size=42 if family == "modernbert" else 33, heads=3,
                        layers=2, intermediate=41, seed=3)
    query = "what is the capital of france?"
    docs = ["paris is the capital of france", "the cat sat on the mat", "berlin", "red blue green dog"]
    expected = CrossEncoder(path, device="cpu").predict([(query, d) for d in docs])
    llm = LLM(path, dtype="float32")
    one_to_many = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
    np.testing.assert_allclose(one_to_many, expected, atol=1e-5, rtol=0)
    pairwise = [o.outputs.score for o in llm.score([query] * 2, docs[:2], use_tqdm=False)]
    np.testing.assert_allclose(pairwise, expected[:2], atol=1e-5, rtol=0)
    # the pair went through the tokenizer together: [CLS] query [SEP] doc [SEP] (segments for BERT)
    out = llm.score(query, docs[0], use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    assert out.prompt_token_ids == tok(query, docs[0])["input_ids"]


def test_classifier_probabilities_equal_transformers(tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = make_encoder(str(tmp_path / "clf"), "bert", classifier=True, num_labels=3, seed=5)
    texts = ["the red dog", "a cat sat on the mat and the dog sat on the mat"]
    hf = AutoModelForSequenceClassification.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        logits = torch.cat([hf(**tok(t, return_tensors="pt")).logits for t in texts])
    llm = LLM(path, dtype="float32")
    probs = np.array([o.outputs.probs for o in llm.classify(texts, use_tqdm=False)])
    np.testing.assert_allclose(probs, torch.softmax(logits, -1).numpy(), atol=1e-5, rtol=0)
    raw = llm.classify(texts, use_tqdm=False, pooling_params=PoolingParams(use_activation=False))
    np.testing.assert_allclose(np.array([o.outputs.probs for o in raw]), logits.numpy(), atol=1e-5, rtol=0)
    assert raw[0].outputs.num_classes == 3
    with pytest.raises(ValueError, match="classifier"):
        llm.embed("the red dog", use_tqdm=False)
    with pytest.raises(ValueError, match="serves"):  # three labels: no single relevance score
        llm.score("a", "b", use_tqdm=False)

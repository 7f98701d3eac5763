"""Qwen3-Reranker's yes/no form, as vLLM serves it: a causal LM's own checkpoint loaded with hf_overrides
{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
"is_original_qwen3_reranker": true}; its score is softmax over the "no" and "yes" logits at the last
position, checked against transformers' causal LM on random weights (tied and untied heads)."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest
import torch

from perfxlm import LLM, EngineConfig, PoolingParams
from perfxlm.entrypoints.openai.serving_pooling import build_pooling_app
from perfxlm.pooling.engine import PoolingEngine
from tests.pooling.checkpoints import save_tokenizer

RERANKER = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
            "is_original_qwen3_reranker": True}
QUERY = "what is the capital of france?"
DOCS = ["paris is the capital of france.", "berlin is the capital of germany", "a red cat sat on the mat", "no"]


def _causal_lm(path: str, tied: bool, seed: int) -> str:
    import transformers as tf

    vocab = save_tokenizer(path, "decoder")
    torch.manual_seed(seed)
    config = tf.Qwen3Config(vocab_size=vocab, hidden_size=40, intermediate_size=68, num_hidden_layers=2,
                            num_attention_heads=5, num_key_value_heads=1, head_dim=8, max_position_embeddings=96,
                            tie_word_embeddings=tied, initializer_range=0.2)
    tf.Qwen3ForCausalLM(config).eval().save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def qwen3_lm(request, tmp_path_factory):
    return _causal_lm(str(tmp_path_factory.mktemp("qwen3lm") / "lm"), request.param, seed=3 + request.param)


def _expected(path: str, query: str, docs: list[str]) -> np.ndarray:
    """Qwen3-Reranker's own recipe: the log-softmax of the [no, yes] logits at the last token, exp of yes."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    no, yes = tok.convert_tokens_to_ids("no"), tok.convert_tokens_to_ids("yes")
    scores = []
    for doc in docs:
        ids = tok(query, doc)["input_ids"]
        with torch.no_grad():
            last = hf(torch.tensor([ids])).logits[0, -1]
        scores.append(torch.log_softmax(last[[no, yes]], dim=-1)[1].exp().item())
    return np.array(scores)


def test_yes_no_scores_equal_the_causal_lm(qwen3_lm):
    llm = LLM(qwen3_lm, dtype="float32", hf_overrides=RERANKER)  # the overridden architecture picks pooling
    assert llm.runner_kind == "pooling"
    got = np.array([o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)])
    expected = _expected(qwen3_lm, QUERY, DOCS)
    np.testing.assert_allclose(got, expected, atol=2e-6, rtol=0)
    assert np.ptp(expected) > 1e-3  # the random model tells the documents apart: the check can fail
    raw = llm.classify(QUERY + " " + DOCS[0], use_tqdm=False, pooling_params=PoolingParams(use_activation=False))
    assert len(raw[0].outputs.probs) == 1  # one label: the yes - no logit
    assert 1 / (1 + np.exp(-raw[0].outputs.probs[0])) == pytest.approx(expected[0], abs=1e-5)


def test_rerank_and_score_endpoints_serve_it(qwen3_lm):
    engine = PoolingEngine(EngineConfig(model=qwen3_lm, dtype="float32", runner="pooling",
                                        hf_overrides=dict(RERANKER)))
    app = build_pooling_app(engine, "qwen3-reranker")
    expected = _expected(qwen3_lm, QUERY, DOCS)

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await asyncio.gather(
                client.post("/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 2}),
                client.post("/score", json={"text_1": QUERY, "text_2": DOCS}),
                client.post("/v1/rerank", json={"query": QUERY, "documents": []}),
            )

    rerank, score, empty = asyncio.run(main())
    assert rerank.status_code == 200, rerank.text
    results = rerank.json()["results"]
    order = np.argsort(-expected)[:2]
    assert [r["index"] for r in results] == list(order)
    np.testing.assert_allclose([r["relevance_score"] for r in results], expected[order], atol=2e-6)
    assert score.status_code == 200, score.text
    got = [d["score"] for d in sorted(score.json()["data"], key=lambda d: d["index"])]
    np.testing.assert_allclose(got, expected, atol=2e-6)
    assert empty.status_code == 400 and "error" in empty.json()


@pytest.mark.parametrize("overrides,needle", [
    ({**RERANKER, "classifier_from_token": ["no", "yes", "cat"]}, 'classifier_from_token: \\["no", "yes"\\]'),
    ({**RERANKER, "classifier_from_token": ["no", "maybe"]}, "'maybe' is not a token"),
    ({"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
      "method": "from_3_way"}, "method must be one of"),
    ({"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True}, "architectures"),
    (["architectures"], "must be a dict"),
])
def test_bad_overrides_are_clear_errors(tmp_path, overrides, needle):
    path = _causal_lm(str(tmp_path / "lm"), tied=False, seed=5)
    with pytest.raises(ValueError, match=needle):
        LLM(path, dtype="float32", runner="pooling", hf_overrides=overrides)


def test_no_post_processing_keeps_one_logit_per_token(tmp_path):
    """vLLM's other method: the named tokens' logits themselves, one label each."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = _causal_lm(str(tmp_path / "lm"), tied=False, seed=9)
    tokens = ["no", "yes", "cat"]
    llm = LLM(path, dtype="float32", skip_tokenizer_init=False, hf_overrides={
        "architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": tokens,
        "method": "no_post_processing"})
    text = "the dog sat on the blue mat"
    got = llm.classify(text, use_tqdm=False, pooling_params=PoolingParams(use_activation=False))[0].outputs.probs
    tok = AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(path).eval()(torch.tensor([tok(text)["input_ids"]])).logits
    np.testing.assert_allclose(got, logits[0, -1, tok.convert_tokens_to_ids(tokens)].numpy(), atol=2e-5, rtol=0)
    with pytest.raises(ValueError, match="needs the tokenizer"):
        LLM(path, skip_tokenizer_init=True, hf_overrides={**RERANKER})


def test_command_line_takes_hf_overrides_as_json():
    import argparse
    import json

    from perfxlm.entrypoints.cli import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    kwargs = engine_kwargs(parser.parse_args(["m", "--hf-overrides", json.dumps(RERANKER)]))
    assert kwargs["hf_overrides"] == RERANKER
    with pytest.raises(SystemExit, match="not valid JSON"):
        engine_kwargs(parser.parse_args(["m", "--hf-overrides", "{architectures: 1}"]))


def test_hf_overrides_as_a_function_of_the_config(tmp_path):
    path = _causal_lm(str(tmp_path / "lm"), tied=True, seed=6)

    def as_reranker(config):
        for key, value in RERANKER.items():
            setattr(config, key, value)
        return config

    llm = LLM(path, dtype="float32", hf_overrides=as_reranker)  # runner chosen from the function's config
    assert llm.runner_kind == "pooling"
    got = [o.outputs.score for o in llm.score(QUERY, DOCS[:2], use_tqdm=False)]
    np.testing.assert_allclose(got, _expected(path, QUERY, DOCS[:2]), atol=2e-6, rtol=0)
    with pytest.raises(ValueError, match="returned None"):
        LLM(path, runner="pooling", hf_overrides=lambda config: None)

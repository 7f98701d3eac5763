"""vLLM's pooling interface: runner selection, PoolingParams (normalize, Matryoshka dimensions, truncation),
causal LMs as last-token embedders, and the errors a bad request gets."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from perfxlm import LLM, EmbeddingRequestOutput, PoolingParams, SamplingParams
from tests.pooling.checkpoints import make_encoder


@pytest.fixture(scope="module")
def matryoshka_bert(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("mrl") / "model")
    make_encoder(path, "bert", hidden_size=30, heads=5, layers=2, intermediate=37, max_positions=24,
                 matryoshka_dimensions=[8, 16, 30])
    return path


@pytest.fixture(scope="module")
def bert_llm(matryoshka_bert):
    return LLM(matryoshka_bert, dtype="float32")


def test_causal_lm_embeds_its_normalized_last_hidden_state(tiny_llama):
    from transformers import LlamaModel

    prompts = [[5, 17, 93, 4, 250], [7], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
    llm = LLM(tiny_llama, runner="pooling", dtype="float32", skip_tokenizer_init=True, max_num_batched_tokens=11)
    outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    hf = LlamaModel.from_pretrained(tiny_llama).eval()
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            last = hf(torch.tensor([p])).last_hidden_state[0, -1]
        expected = torch.nn.functional.normalize(last, dim=-1).numpy()
        np.testing.assert_allclose(out.outputs.embedding, expected, atol=1e-5, rtol=0)
        assert out.prompt_token_ids == p
    # task="embed", vLLM's older spelling, is the same runner
    again = LLM(tiny_llama, task="embed", dtype="float32", skip_tokenizer_init=True)
    assert again.runner_kind == "pooling"
    with pytest.raises(ValueError, match="runner='generate'"):
        again.generate({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=1))
    raw = again.embed({"prompt_token_ids": prompts[0]}, pooling_params=PoolingParams(normalize=False), use_tqdm=False)
    assert abs(np.linalg.norm(raw[0].outputs.embedding) - 1.0) > 1e-3  # not normalized when asked not to


def test_default_model_embeds_and_generate_runner_refuses_pooling(default_model):
    llm = LLM(default_model, runner="pooling")
    out = llm.embed(["Hello there", "A longer sentence about the weather."], use_tqdm=False)
    assert isinstance(out[0], EmbeddingRequestOutput)
    assert out[0].outputs.hidden_size == 576
    assert abs(np.linalg.norm(out[1].outputs.embedding) - 1.0) < 1e-4


def test_generate_runner_refuses_pooling_methods(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=8)
    assert llm.runner_kind == "generate"
    with pytest.raises(ValueError, match="runner='pooling'"):
        llm.embed({"prompt_token_ids": [1, 2]})
    with pytest.raises(ValueError, match="runner='pooling'"):
        llm.score("a", "b")


def test_encoder_cannot_generate(matryoshka_bert):
    with pytest.raises(ValueError, match="cannot generate"):
        LLM(matryoshka_bert, runner="generate")
    with pytest.raises(ValueError, match="runner must be"):
        LLM(matryoshka_bert, runner="draft")
    with pytest.raises(ValueError, match="task must be"):
        LLM(matryoshka_bert, task="transcribe")


def test_matryoshka_dimensions_truncate_then_normalize(bert_llm):
    full = bert_llm.embed("the cat sat", use_tqdm=False, pooling_params=PoolingParams(normalize=False))[0]
    cut = bert_llm.embed("the cat sat", use_tqdm=False, pooling_params=PoolingParams(dimensions=16))[0]
    head = np.array(full.outputs.embedding[:16])
    np.testing.assert_allclose(cut.outputs.embedding, head / np.linalg.norm(head), atol=1e-6)
    assert cut.outputs.hidden_size == 16
    with pytest.raises(ValueError, match=r"supports \[8, 16, 30\]"):
        bert_llm.embed("the cat", pooling_params=PoolingParams(dimensions=12))
    with pytest.raises(ValueError, match="dimensions must be a positive integer"):
        PoolingParams(dimensions=0)


def test_dimensions_refused_without_matryoshka(tmp_path):
    llm = LLM(make_encoder(str(tmp_path / "plain"), "xlmr"), dtype="float32")
    with pytest.raises(ValueError, match="Matryoshka"):
        llm.embed("the cat", pooling_params=PoolingParams(dimensions=8))


def test_bad_inputs_fail_whole_call_with_clear_errors(bert_llm):
    long_text = " ".join(["cat"] * 40)  # more than the window of 24
    with pytest.raises(ValueError, match="window of 24"):
        bert_llm.embed(["the cat", long_text])
    with pytest.raises(ValueError, match="got no inputs"):
        bert_llm.embed([])
    with pytest.raises(ValueError, match="empty"):
        bert_llm.embed({"prompt_token_ids": []})
    with pytest.raises(ValueError, match="outside the vocabulary"):
        bert_llm.embed({"prompt_token_ids": [3, 10**6]})
    with pytest.raises(ValueError, match="larger than the model's window"):
        bert_llm.embed("the cat", truncate_prompt_tokens=100)
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be"):
        bert_llm.embed("the cat", truncate_prompt_tokens=0)
    with pytest.raises(ValueError, match="PoolingParams"):
        bert_llm.embed("the cat", pooling_params=SamplingParams())
    with pytest.raises(ValueError, match="one to one"):
        bert_llm.score(["a", "b"], ["c", "d", "e"])
    with pytest.raises(ValueError, match="not served"):
        bert_llm.classify("the cat")
    # the engine is unharmed: a good call after the bad ones
    cut = bert_llm.embed(long_text, truncate_prompt_tokens=9, use_tqdm=False)[0]
    assert len(cut.prompt_token_ids) == 9
    assert cut.prompt_token_ids[-1] == bert_llm.get_tokenizer().sep_token_id  # the tokenizer's truncation


def test_bi_encoder_score_is_cosine_and_encode_returns_tensors(bert_llm):
    a, b = bert_llm.embed(["the red dog", "a blue cat"], use_tqdm=False, pooling_params=PoolingParams(normalize=False))
    expected = float(np.dot(a.outputs.embedding, b.outputs.embedding)
                     / np.linalg.norm(a.outputs.embedding) / np.linalg.norm(b.outputs.embedding))
    got = bert_llm.score("the red dog", ["a blue cat"], use_tqdm=False)[0]
    assert got.outputs.score == pytest.approx(expected, abs=1e-6)
    tokens = bert_llm.encode(["the red dog"], pooling_task="token_embed", use_tqdm=False)[0]
    assert tuple(tokens.outputs.data.shape) == (len(tokens.prompt_token_ids), 30)
    pooled = bert_llm.encode("the red dog", use_tqdm=False)[0]
    np.testing.assert_allclose(pooled.outputs.data.numpy(), np.array(a.outputs.embedding)
                               / np.linalg.norm(a.outputs.embedding), atol=1e-6)


def test_pooler_config_overrides_sentence_transformers_files(matryoshka_bert, tmp_path):
    llm = LLM(matryoshka_bert, dtype="float32", pooler_config={"pooling_type": "MEAN", "normalize": False})
    assert llm.llm_engine.pooler_config.pooling_type == "MEAN"
    tokens = llm.encode("the red dog", pooling_task="token_embed", use_tqdm=False,
                        pooling_params=PoolingParams(normalize=False))[0]
    mean = llm.embed("the red dog", use_tqdm=False)[0]
    np.testing.assert_allclose(mean.outputs.embedding, tokens.outputs.data.mean(0).numpy(), atol=1e-6)
    with pytest.raises(ValueError, match="pooling_type must be"):
        LLM(matryoshka_bert, pooler_config={"pooling_type": "MAX"})
    # a sentence-transformers pooling the runner cannot reproduce is refused at load
    folder = tmp_path / "maxpool"
    make_encoder(str(folder), "bert")
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]))
    with pytest.raises(ValueError, match="not supported"):
        LLM(str(folder))
    assert os.path.isfile(folder / "config.json")


def test_quantized_encoder_embeds_close_to_float(matryoshka_bert, bert_llm, tmp_path):
    texts = ["the cat sat on the mat", "paris"]
    ref = np.array([o.outputs.embedding for o in bert_llm.embed(texts, use_tqdm=False)])
    int8 = LLM(matryoshka_bert, dtype="float32", quantization="int8")
    got = np.array([o.outputs.embedding for o in int8.embed(texts, use_tqdm=False)])
    assert (got * ref).sum(1).min() > 0.999 and np.abs(got - ref).max() > 0  # quantized, and close
    wide = make_encoder(str(tmp_path / "wide"), "bert", hidden_size=64, heads=4, intermediate=128)  # int4: 32s
    with pytest.raises(ValueError, match="calibration false"):
        LLM(wide, quantization="int4")  # int4 calibrates by default, over a causal LM's text windows
    plain = LLM(wide, quantization={"method": "int4", "calibration": False})
    assert plain.embed("paris", use_tqdm=False)[0].outputs.hidden_size == 64
    with pytest.raises(ValueError, match="one process"):
        LLM(matryoshka_bert, data_parallel_size=2)


def test_generation_front_ends_refuse_pooling_models(matryoshka_bert, tiny_llama):
    from perfxlm import AsyncLLM, EngineConfig

    with pytest.raises(ValueError, match="cannot generate"):
        AsyncLLM(EngineConfig(model=matryoshka_bert))
    with pytest.raises(ValueError, match="runner='pooling'"):
        AsyncLLM(EngineConfig(model=tiny_llama, runner="pooling", skip_tokenizer_init=True))


@pytest.mark.parametrize("family,labels", [("qwen3", 1), ("llama", 3)])
def test_decoder_score_head_equals_transformers(family, labels, tmp_path):
    """Qwen3-Reranker converted to a score head (seq-cls), and a Llama classifier: the last token's logits."""
    import transformers as tf

    cls = {"qwen3": (tf.Qwen3Config, tf.Qwen3ForSequenceClassification),
           "llama": (tf.LlamaConfig, tf.LlamaForSequenceClassification)}[family]
    torch.manual_seed(1)
    config = cls[0](vocab_size=301, hidden_size=48, intermediate_size=72, num_hidden_layers=2, num_attention_heads=6,
                    num_key_value_heads=2, head_dim=8, max_position_embeddings=128, num_labels=labels,
                    initializer_range=0.1)
    hf = cls[1](config).eval()
    hf.save_pretrained(str(tmp_path))
    prompts = [[5, 17, 93, 4, 250, 7], [9], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]
    llm = LLM(str(tmp_path), dtype="float32", skip_tokenizer_init=True)
    assert llm.runner_kind == "pooling"  # a score head and no LM head: pooling by itself
    raw = llm.classify([{"prompt_token_ids": p} for p in prompts], use_tqdm=False,
                       pooling_params=PoolingParams(use_activation=False))
    for p, out in zip(prompts, raw):
        with torch.no_grad():
            expected = hf(torch.tensor([p])).logits[0]
        np.testing.assert_allclose(out.outputs.probs, expected.numpy(), atol=1e-5, rtol=0)
    if labels == 1:  # a reranker: the sigmoid of the one logit is its score
        out = llm.encode({"prompt_token_ids": prompts[0]}, use_tqdm=False)[0]
        assert float(out.outputs.data[0]) == pytest.approx(float(torch.sigmoid(torch.tensor(raw[0].outputs.probs[0]))))

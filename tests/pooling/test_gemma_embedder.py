"""EmbeddingGemma's shape: Gemma 3's text stack (Gemma3TextModel, use_bidirectional_attention) with local
layers shorter than the texts, mean pooling, two Dense projections without bias or activation, and
Normalize; embeddings equal SentenceTransformer.encode on a folder saved with its own classes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from perfxlm import LLM
from tests.pooling.checkpoints import save_tokenizer

TEXTS = ["what is the capital of france?", "a", "the cat sat on the mat, and the dog sat on the red mat!",
         "query: blue green 42", "berlin is the capital of germany"]


def _embedding_gemma(path: str, bidirectional: bool = True) -> str:
    import transformers as tf
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling, Transformer

    raw = path + "_raw"
    vocab = save_tokenizer(raw, "decoder")
    # odd sizes; a window of 8 tokens (|distance| < 5 both ways once bidirectional) on the local layers
    config = tf.Gemma3TextConfig(
        vocab_size=vocab, hidden_size=45, intermediate_size=71, num_hidden_layers=3, num_attention_heads=3,
        num_key_value_heads=1, head_dim=12, query_pre_attn_scalar=12, max_position_embeddings=64,
        sliding_window=8, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        use_bidirectional_attention=bidirectional, initializer_range=0.2, pad_token_id=0,
    )
    torch.manual_seed(11)
    tf.Gemma3TextModel(config).eval().save_pretrained(raw)
    transformer = Transformer(raw, max_seq_length=40)
    torch.manual_seed(12)
    modules = [transformer, Pooling(45, pooling_mode="mean"),
               Dense(45, 133, bias=False, activation_function=None),
               Dense(133, 45, bias=False, activation_function=None), Normalize()]
    SentenceTransformer(modules=modules, device="cpu").save(path)
    return path


@pytest.fixture(scope="module")
def embedding_gemma(tmp_path_factory):
    return _embedding_gemma(str(tmp_path_factory.mktemp("gemma") / "model"))


def test_embeddings_equal_sentence_transformers(embedding_gemma):
    from sentence_transformers import SentenceTransformer

    expected = SentenceTransformer(embedding_gemma, device="cpu").encode(TEXTS, convert_to_numpy=True)
    llm = LLM(embedding_gemma, dtype="float32", max_num_batched_tokens=30)  # several batches, odd widths
    assert llm.runner_kind == "pooling"  # no LM head: pooling by itself
    pc = llm.llm_engine.pooler_config
    assert (pc.pooling_type, pc.normalize, pc.hidden_size) == ("MEAN", True, 45)
    got = np.array([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)
    single = np.array([llm.embed(t, use_tqdm=False)[0].outputs.embedding for t in TEXTS])
    np.testing.assert_allclose(single, got, atol=1e-6, rtol=0)


def test_a_causal_text_stack_embeds_its_last_token(tmp_path):
    """Without use_bidirectional_attention the same stack stays causal: the last token's normalized state,
    as transformers' Gemma3TextModel gives it."""
    from transformers import AutoModel, AutoTokenizer

    path = _embedding_gemma(str(tmp_path / "causal"), bidirectional=False) + "_raw"
    llm = LLM(path, dtype="float32")
    assert llm.llm_engine.pooler_config.pooling_type == "LAST"
    hf = AutoModel.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    for text in TEXTS[:3]:
        with torch.no_grad():
            last = hf(torch.tensor([tok(text)["input_ids"]])).last_hidden_state[0, -1]
        got = llm.embed(text, use_tqdm=False)[0].outputs.embedding
        np.testing.assert_allclose(got, (last / last.norm()).numpy(), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="cannot generate"):
        LLM(path, runner="generate")

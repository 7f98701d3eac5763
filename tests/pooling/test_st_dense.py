"""sentence-transformers' Dense modules after pooling (linear + activation, with a residual), then
Normalize: embeddings equal SentenceTransformer.encode on a folder saved with its own classes."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from torch import nn

from perfxlm import LLM, PoolingParams
from tests.pooling.checkpoints import make_sentence_transformer

TEXTS = ["what is the capital of france?", "a", "the cat sat on the mat, and the dog sat on the red mat!",
         "query: blue green 42", "zzzz qqq"]
# odd widths: 35 -> 23 (Tanh) -> 17 (no bias, identity) -> 17 (GELU, residual)
DENSE = [
    {"out_features": 23, "activation_function": nn.Tanh()},
    {"out_features": 17, "bias": False, "activation_function": None},
    {"out_features": 17, "activation_function": nn.GELU(), "use_residual": True},
]


@pytest.fixture(scope="module", params=[("cls", True), ("mean", False)], ids=["cls-normalize", "mean-raw"])
def dense_model(request, tmp_path_factory):
    pooling, normalize = request.param
    path = str(tmp_path_factory.mktemp("dense") / "model")
    make_sentence_transformer(path, "bert", pooling, normalize, max_seq_length=15, hidden_size=35, heads=5,
                              layers=2, intermediate=47, dense=DENSE, is_matryoshka=True, seed=4)
    return path


def test_dense_embeddings_equal_sentence_transformers(dense_model):
    from sentence_transformers import SentenceTransformer

    expected = SentenceTransformer(dense_model, device="cpu").encode(TEXTS, convert_to_numpy=True)
    assert expected.shape == (len(TEXTS), 17)
    llm = LLM(dense_model, dtype="float32", max_num_batched_tokens=20)  # several batches
    got = np.array([o.outputs.embedding for o in llm.embed(TEXTS, truncate_prompt_tokens=-1, use_tqdm=False)])
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)
    cut = llm.embed(TEXTS[0], pooling_params=PoolingParams(dimensions=9, normalize=True), use_tqdm=False)
    np.testing.assert_allclose(cut[0].outputs.embedding, expected[0, :9] / np.linalg.norm(expected[0, :9]), atol=1e-5)
    with pytest.raises(ValueError, match="at most the model's hidden size 17"):
        llm.embed(TEXTS[0], pooling_params=PoolingParams(dimensions=20), use_tqdm=False)
    scores = llm.score(TEXTS[0], [TEXTS[1], TEXTS[3]], use_tqdm=False)  # cosine of the projected embeddings
    other = expected[[1, 3]]
    cos = other @ expected[0] / np.linalg.norm(other, axis=1) / np.linalg.norm(expected[0])
    np.testing.assert_allclose([o.outputs.score for o in scores], cos, atol=1e-5)
    tokens = llm.encode(TEXTS[1], pooling_task="token_embed", use_tqdm=False)[0].outputs.data
    assert tokens.shape[-1] == 35  # per-token states are the encoder's, as sentence-transformers' token_embeddings


def _copy_with(src: str, dst: str, edit) -> str:
    shutil.copytree(src, dst)
    edit(dst)
    return dst


def _edit_json(path: str, change) -> None:
    with open(path) as f:
        data = json.load(f)
    data = change(data) or data
    with open(path, "w") as f:
        json.dump(data, f)


def _dense_dirs(folder: str) -> list[str]:
    with open(os.path.join(folder, "modules.json")) as f:
        return [os.path.join(folder, m["path"]) for m in json.load(f) if m["type"].endswith("Dense")]


@pytest.mark.parametrize("edit,needle", [
    (lambda d: _edit_json(os.path.join(_dense_dirs(d)[0], "config.json"),
                          lambda c: c.update(activation_function="mypkg.Swish")), "not one of torch's"),
    (lambda d: _edit_json(os.path.join(_dense_dirs(d)[1], "config.json"),
                          lambda c: c.update(in_features=22)), "linear.weight is \\(17, 23\\)"),
    (lambda d: _edit_json(os.path.join(d, "modules.json"), lambda m: [m[0], m[2], m[1]] + m[3:]), "before Pooling"),
    (lambda d: _edit_json(os.path.join(_dense_dirs(d)[0], "config.json"),
                          lambda c: c.update(module_input_name="token_embeddings")), "over the sentence embedding"),
    (lambda d: os.remove(os.path.join(_dense_dirs(d)[2], "model.safetensors")), "has no model.safetensors"),
])
def test_unsupported_dense_modules_are_clear_errors(dense_model, tmp_path, edit, needle):
    folder = _copy_with(dense_model, str(tmp_path / "copy"), edit)
    with pytest.raises(ValueError, match=needle):
        LLM(folder, dtype="float32")


def test_dense_weights_saved_as_pytorch_model_bin(dense_model, tmp_path):
    """Older sentence-transformers releases save Dense weights with torch.save: the same embeddings."""
    import torch
    from safetensors.torch import load_file

    def to_bin(folder):
        for d in _dense_dirs(folder):
            torch.save(load_file(os.path.join(d, "model.safetensors")), os.path.join(d, "pytorch_model.bin"))
            os.remove(os.path.join(d, "model.safetensors"))

    folder = _copy_with(dense_model, str(tmp_path / "bin"), to_bin)
    ref = LLM(dense_model, dtype="float32").embed(TEXTS[:2], use_tqdm=False)
    got = LLM(folder, dtype="float32").embed(TEXTS[:2], use_tqdm=False)
    np.testing.assert_array_equal([o.outputs.embedding for o in got], [o.outputs.embedding for o in ref])

"""Running an exported decoder graph in ONNX Runtime the way onnxruntime-genai does: the prompt in one
call, then one token per call with the growing past fed back."""

from __future__ import annotations

import json
import os

import numpy as np


def ort_session(folder: str):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(os.path.join(folder, "model.onnx"), opts, providers=["CPUExecutionProvider"])


def ort_greedy(folder: str, prompt: list[int], steps: int, reference=None):
    """Greedy decoding of `steps` tokens after `prompt`; returns (tokens, logprob of each, logits of every
    call [rows, vocab]). `reference(ids) -> logits [len(ids), vocab]`, if given, is called on the whole
    sequence at every call, and the largest difference of the call's rows is collected (4th value)."""
    with open(os.path.join(folder, "genai_config.json")) as f:
        dec = json.load(f)["model"]["decoder"]
    sess = ort_session(folder)
    layers, kv, d = dec["num_hidden_layers"], dec["num_key_value_heads"], dec["head_size"]
    past = {dec["inputs"][f"past_{k}_names"] % i: np.zeros((1, kv, 0, d), np.float32)
            for i in range(layers) for k in ("key", "value")}
    names = [o.name for o in sess.get_outputs()]
    seq, new = list(prompt), list(prompt)
    tokens, logprobs, diffs = [], [], []
    for _ in range(steps + 1):
        n, s = len(seq), len(new)
        feeds = {"input_ids": np.array([new], np.int64), "attention_mask": np.ones((1, n), np.int64),
                 "position_ids": np.arange(n - s, n, dtype=np.int64)[None], **past}
        out = dict(zip(names, sess.run(None, feeds)))
        logits = out["logits"][0]
        if reference is not None:
            diffs.append(float(np.abs(logits - reference(seq)[-s:]).max()))
        past = {k: out[k.replace("past_key_values", "present")] for k in past}
        if len(tokens) == steps:
            break
        last = logits[-1].astype(np.float64)
        tok = int(last.argmax())
        logprobs.append(float(last[tok] - np.log(np.exp(last - last.max()).sum()) - last.max()))
        tokens.append(tok)
        seq.append(tok)
        new = [tok]
    return tokens, logprobs, diffs

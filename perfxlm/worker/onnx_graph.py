"""An exported decoder graph (`perfxlm export onnx`) in an ONNX Runtime session: token ids and a past
in, logits and the present out, one sequence per call.

The folder is checked before the session starts: its manifest's format version, and every node's op
against the ops the exporter writes, so a graph from elsewhere (or a newer exporter) is refused by name
rather than failing somewhere inside ONNX Runtime."""

from __future__ import annotations

import json
import os

import numpy as np

from perfxlm.export.manifest import GENAI_CONFIG, GRAPH_FILE, check_graph_ops, read_manifest


class OnnxDecoderGraph:
    def __init__(self, folder: str, num_threads: int) -> None:
        import onnxruntime as ort

        self.manifest = read_manifest(folder)
        path = os.path.join(folder, self.manifest.get("graph", GRAPH_FILE))
        check_graph_ops(path)
        with open(os.path.join(folder, GENAI_CONFIG)) as f:
            decoder = json.load(f)["model"]["decoder"]
        self.num_layers = decoder["num_hidden_layers"]
        self.num_kv_heads = decoder["num_key_value_heads"]
        self.head_dim = decoder["head_size"]
        names = decoder["inputs"], decoder["outputs"]
        self.past_names = [names[0][f"past_{kind}_names"] % i for i in range(self.num_layers)
                           for kind in ("key", "value")]
        self.present_names = [names[1][f"present_{kind}_names"] % i for i in range(self.num_layers)
                              for kind in ("key", "value")]
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = num_threads
        opts.inter_op_num_threads = 1
        # no busy-waiting between ops: the engine's own threads (sampling, detokenizing) share the cores
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
        self.flavor = self.manifest.get("flavor", "?")

    @property
    def kv_bytes_per_token(self) -> int:
        """float32 K and V of every layer: what a sequence's past costs per token."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4

    def empty_past(self) -> list[np.ndarray]:
        return [np.zeros((1, self.num_kv_heads, 0, self.head_dim), np.float32) for _ in self.past_names]

    def run(self, token_ids: list[int], past: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        """Logits [len(token_ids), vocab] of the tokens that follow `past` (whose length is its axis 2),
        and the present (past + these tokens) to pass next time."""
        past_len = past[0].shape[2]
        total = past_len + len(token_ids)
        feeds = {"input_ids": np.asarray([token_ids], np.int64),
                 "attention_mask": np.ones((1, total), np.int64),
                 "position_ids": np.arange(past_len, total, dtype=np.int64)[None],
                 **dict(zip(self.past_names, past))}
        outputs = self.session.run(["logits", *self.present_names], feeds)
        return outputs[0][0], outputs[1:]

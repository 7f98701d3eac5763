"""ONNX Runtime (CPU provider) on an `ort` / `standard` export against perfxlm on the same weights: prefill
tok/s (a 512-token prompt, batch 1) and batch-1 decode tok/s (128 new tokens after it), same process,
rounds alternating.

    python benchmarks/ort_vs_perfxlm.py [--model PATH] [--flavor ort|standard] [--quantization Q]
                                        [--threads 2] [--rounds 3] [--prompt 512] [--new-tokens 128]
                                        [--output-json OUT.json]

The model (default: the embedded default model's GGUF, whose packed blocks the `ort` flavor writes as
`MatMulNBits`) is exported once into a temporary folder. ONNX Runtime runs it as onnxruntime-genai would
drive it: one session, greedy, each step's present K/V handed back as the next step's past through an
I/O binding (no copies to numpy between steps), `intra_op_num_threads` = --threads. perfxlm runs the
source model under its defaults (`dtype="auto"`, the same file), through `LLM.generate`, so its figures
include the engine's scheduler, sampler and detokenizer; ONNX Runtime's are the bare session (an argmax
in numpy per step), which favours it. Prints each round, the medians and the perfxlm / ONNX Runtime
ratios. Not a test: timings belong here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import numpy as np
import torch

from perfxlm import LLM, SamplingParams
from perfxlm.config import default_model_path
from perfxlm.export.package import export_onnx


class OrtGreedy:
    """A greedy decoder over an exported folder in one ONNX Runtime session."""

    def __init__(self, folder: str, threads: int) -> None:
        import onnxruntime as ort

        with open(os.path.join(folder, "genai_config.json")) as f:
            decoder = json.load(f)["model"]["decoder"]
        layers, self.kv_heads, self.head_dim = (decoder[k] for k in ("num_hidden_layers", "num_key_value_heads",
                                                                       "head_size"))
        names_in, names_out = decoder["inputs"], decoder["outputs"]
        self.past = [names_in[f"past_{kind}_names"] % i for i in range(layers) for kind in ("key", "value")]
        self.present = [names_out[f"present_{kind}_names"] % i for i in range(layers) for kind in ("key", "value")]
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        self.ort = ort
        self.session = ort.InferenceSession(os.path.join(folder, "model.onnx"), opts,
                                            providers=["CPUExecutionProvider"])

    def _step(self, tokens: list[int], past_len: int, past: list) -> tuple[int, list]:
        binding = self.session.io_binding()
        total = past_len + len(tokens)
        binding.bind_cpu_input("input_ids", np.asarray([tokens], np.int64))
        binding.bind_cpu_input("attention_mask", np.ones((1, total), np.int64))
        binding.bind_cpu_input("position_ids", np.arange(past_len, total, dtype=np.int64)[None])
        for name, value in zip(self.past, past):
            binding.bind_ortvalue_input(name, value)
        binding.bind_output("logits", "cpu")
        for name in self.present:
            binding.bind_output(name, "cpu")
        self.session.run_with_iobinding(binding)
        outputs = binding.get_outputs()
        return int(np.argmax(outputs[0].numpy()[0, -1])), outputs[1:]

    def generate(self, prompt: list[int], new_tokens: int) -> tuple[float, float]:
        """(seconds to the first token, seconds for the other new_tokens - 1)."""
        empty = np.zeros((1, self.kv_heads, 0, self.head_dim), np.float32)
        past = [self.ort.OrtValue.ortvalue_from_numpy(empty) for _ in self.past]
        t0 = time.perf_counter()
        token, past = self._step(prompt, 0, past)
        t1 = time.perf_counter()
        length = len(prompt) + 1
        for _ in range(new_tokens - 1):
            token, past = self._step([token], length - 1, past)
            length += 1
        return t1 - t0, time.perf_counter() - t1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="the source model (default: the embedded default model)")
    ap.add_argument("--flavor", default="ort", choices=("ort", "standard"))
    ap.add_argument("--quantization", default=None, help="export option for a float checkpoint (int4, int8)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    model = args.model or default_model_path()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        folder = f"{tmp}/{args.flavor}"
        t = time.perf_counter()
        export_onnx(model, folder, flavor=args.flavor, quantization=args.quantization)
        print(f"exported {args.flavor} in {time.perf_counter() - t:.1f} s", flush=True)
        ort_run = OrtGreedy(folder, args.threads)
        llm = LLM(model, quantization=args.quantization, enable_prefix_caching=False, kv_cache_gib=1.0)
        vocab = llm.llm_engine.config.hf_config.vocab_size
        rates: dict[str, dict[str, list[float]]] = {n: {"prefill": [], "decode": []} for n in ("perfxlm", "ort")}
        params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True, temperature=0)
        for r in range(args.rounds + 1):  # round 0 warms both up and is not counted
            prompt = torch.randint(100, vocab, (args.prompt,), generator=torch.Generator().manual_seed(r)).tolist()
            out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
            m = out.metrics
            px = (m.first_token_time - m.arrival_time, m.finished_time - m.first_token_time)
            ox = ort_run.generate(prompt, args.new_tokens)
            if r == 0:
                continue
            for name, (first, rest) in (("perfxlm", px), ("ort", ox)):
                rates[name]["prefill"].append(args.prompt / first)
                rates[name]["decode"].append((args.new_tokens - 1) / rest)
            print(f"round {r}: perfxlm prefill {rates['perfxlm']['prefill'][-1]:.0f} decode "
                  f"{rates['perfxlm']['decode'][-1]:.1f} tok/s; onnxruntime prefill {rates['ort']['prefill'][-1]:.0f}"
                  f" decode {rates['ort']['decode'][-1]:.1f} tok/s", flush=True)
    med = {n: {k: statistics.median(v) for k, v in kinds.items()} for n, kinds in rates.items()}
    for kind in ("prefill", "decode"):
        print(f"median {kind}: perfxlm {med['perfxlm'][kind]:.1f} tok/s, onnxruntime {med['ort'][kind]:.1f} tok/s, "
              f"perfxlm/onnxruntime {med['perfxlm'][kind] / med['ort'][kind]:.2f}x")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"model": model, "flavor": args.flavor, "threads": args.threads, "rates": rates,
                       "medians": med}, f, indent=1)


if __name__ == "__main__":
    main()

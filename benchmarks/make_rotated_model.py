"""A model whose weights are not already on a 4-bit grid, for measuring quantization quality.

The default model ships as a Q4_1 GGUF: its weights already sit on a 4-bit grid, so any 4-bit format
that happens to share that grid looks lossless and the comparison says nothing. Turning the residual
stream by a random rotation (QuaRot) gives the same function with weights off every grid:

1. the default model dequantized to float32 (perfxlm's GGUF loader, Hugging Face names);
2. each RMSNorm gain folded into the linears that read it (input_layernorm -> q, k, v;
   post_attention_layernorm -> gate, up; the final norm -> lm_head, which is untied from the
   embedding first) and the gains set to 1: an RMSNorm without gain commutes with a rotation;
3. the residual stream turned by a seeded random orthogonal Q (QR of a gaussian, signs fixed so Q is
   uniformly distributed): embedding E -> E Q, every linear reading the stream W -> W Q, every linear
   writing it (o_proj, down_proj) W -> Q^T W;
4. transformers' LlamaForCausalLM checked to give the same logits (max abs difference printed) and
   the same greedy text before and after, in float32;
5. saved as a Hugging Face folder in bfloat16 (with the tokenizer perfxlm builds from the GGUF file and
   a generation config): these bf16-rounded weights are the base of every comparison;
6. converted by llama.cpp's own converter (convert_hf_to_gguf.py --outtype bf16) and quantized with
   llama-cpp-python (as llama-quantize) to Q8_0, Q6_K, Q4_K_M and Q4_0.

    python benchmarks/make_rotated_model.py --llama-cpp path/to/llama.cpp
    # or llama-cpp-python's source archive, whose vendor/llama.cpp holds the converter:
    python benchmarks/make_rotated_model.py --llama-cpp llama_cpp_python-0.3.36.tar.gz

Output (--out, default ~/.cache/perfxlm/quality): rotated-hf/, rotated.bf16.gguf, rotated.q8_0.gguf,
rotated.q6_k.gguf, rotated.q4_k_m.gguf, rotated.q4_0.gguf. Steps whose output exists are skipped.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import torch

DEFAULT_OUT = Path.home() / ".cache" / "perfxlm" / "quality"
FTYPES = ("q8_0", "q6_k", "q4_k_m", "q4_0")
PROMPT = "What is the capital of France? Answer in one sentence."
# float32 sums over 30 layers in another order: differences of a few 1e-4 on logits of size ~20
LOGIT_TOLERANCE = 1e-2

READERS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
WRITERS = ("self_attn.o_proj", "mlp.down_proj")
NORM_READERS = {"input_layernorm": READERS[:3], "post_attention_layernorm": READERS[3:]}


# ---- the rotation ---------------------------------------------------------------------------------------

def random_orthogonal(dim: int, seed: int) -> torch.Tensor:
    """A float64 orthogonal matrix drawn uniformly (Haar): QR of a gaussian with R's diagonal made
    positive, without which the QR routine's sign convention would bias the draw."""
    g = torch.randn(dim, dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    q, r = torch.linalg.qr(g)
    return q * torch.sign(torch.diagonal(r)).unsqueeze(0)


def num_layers(state: dict[str, torch.Tensor]) -> int:
    return 1 + max(int(k.split(".")[2]) for k in state if k.startswith("model.layers."))


def fold_norms(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each RMSNorm gain g moved into the linears that read the norm's output (W -> W diag(g)) and set
    to 1. The head gets its own copy of the embedding first: the final norm's gain must go into the head
    and not into the embedding, so a tied model comes out untied."""
    out = {k: v.double() for k, v in state.items()}
    if "lm_head.weight" not in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"].clone()
    for i in range(num_layers(state)):
        for norm, readers in NORM_READERS.items():
            gain = out[f"model.layers.{i}.{norm}.weight"]
            for name in readers:
                out[f"model.layers.{i}.{name}.weight"] = out[f"model.layers.{i}.{name}.weight"] * gain
            out[f"model.layers.{i}.{norm}.weight"] = torch.ones_like(gain)
    out["lm_head.weight"] = out["lm_head.weight"] * out["model.norm.weight"]
    out["model.norm.weight"] = torch.ones_like(out["model.norm.weight"])
    return out


def rotate_residual(state: dict[str, torch.Tensor], q: torch.Tensor) -> dict[str, torch.Tensor]:
    """The residual stream h -> h Q (row vectors). A Linear computes x W^T, so a reader W becomes W Q
    (it sees x Q and must give the same output) and a writer W becomes Q^T W (its output is added to
    the turned stream). The norms must have no gain left (fold_norms): RMSNorm(h Q) = RMSNorm(h) Q only
    then."""
    out = dict(state)
    q = q.to(torch.float64)
    out["model.embed_tokens.weight"] = state["model.embed_tokens.weight"] @ q
    out["lm_head.weight"] = state["lm_head.weight"] @ q
    for i in range(num_layers(state)):
        for name in READERS:
            key = f"model.layers.{i}.{name}.weight"
            out[key] = state[key] @ q
        for name in WRITERS:
            key = f"model.layers.{i}.{name}.weight"
            out[key] = q.T @ state[key]
    return out


def quarot(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """The rotated model's weights, float32 (the arithmetic is float64, so only the final rounding
    differs from the exact product)."""
    folded = fold_norms(state)
    q = random_orthogonal(folded["model.embed_tokens.weight"].shape[1], seed)
    return {k: v.float().contiguous() for k, v in rotate_residual(folded, q).items()}


# ---- loading and checking -----------------------------------------------------------------------------

def llama_config(gguf_config, tied: bool):
    """transformers' LlamaConfig from the plain config perfxlm reads out of the GGUF file."""
    from transformers import LlamaConfig

    c = gguf_config
    if c.architectures != ["LlamaForCausalLM"]:
        raise SystemExit(f"the rotation is written for Llama; this model is {c.architectures}: pass a Llama --model.")
    return LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": float(c.rope_theta)},
        hidden_act="silu", tie_word_embeddings=tied, bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id, pad_token_id=c.pad_token_id,
    )  # fmt: skip


def load_gguf_float(path: str):
    """(perfxlm's config of the file, float32 state dict with HF names), every tensor dequantized."""
    from perfxlm.model.loader.gguf import iter_gguf_weights, load_gguf_config

    config = load_gguf_config(path)
    rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type != "default" or getattr(config, "rope_freq_factors", None) is not None:
        raise SystemExit(f"{path} uses rope scaling, which this script does not carry over: pick another --model.")
    return config, {name: t.float() for name, t in iter_gguf_weights(path, config)}


def build_model(config, state: dict[str, torch.Tensor]):
    """transformers' LlamaForCausalLM in float32 holding `state` (all of it: no key left over or missing)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(config).float().eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    # a tied model has no lm_head.weight of its own; anything else missing is a naming bug
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"state dict does not fit the model: missing {missing}, unexpected {unexpected}")
    return model


@torch.inference_mode()
def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits[0].float()


@torch.inference_mode()
def greedy(model, ids: torch.Tensor, n_new: int) -> list[int]:
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                         do_sample=False, pad_token_id=model.config.pad_token_id)
    return out[0, ids.shape[1]:].tolist()


def check_same_function(config_before, before, config_after, after, ids: torch.Tensor, n_new: int = 32) -> dict:
    """Logits and greedy continuation of the two weight sets on `ids` [1, T]; raises when they differ."""
    m0, m1 = build_model(config_before, before), build_model(config_after, after)
    l0, l1 = logits_of(m0, ids), logits_of(m1, ids)
    diff = float((l0 - l1).abs().max())
    g0, g1 = greedy(m0, ids, n_new), greedy(m1, ids, n_new)
    result = {"max_abs_logit_diff": diff, "max_abs_logit": float(l0.abs().max()), "greedy_before": g0,
              "greedy_after": g1}
    if diff > LOGIT_TOLERANCE:
        raise RuntimeError(f"the rotated model's logits differ by up to {diff:.3g} (> {LOGIT_TOLERANCE}): "
                           "the rotation is not exact")
    if g0 != g1:
        raise RuntimeError(f"greedy texts differ: {g0} before, {g1} after the rotation")
    return result


# ---- saving and converting ----------------------------------------------------------------------------

def save_hf_folder(folder: Path, config, state: dict[str, torch.Tensor], tokenizer) -> None:
    """safetensors in bfloat16 + config.json + tokenizer + generation_config.json, written to a temporary
    folder and renamed, so an interrupted run never leaves a folder that looks finished."""
    from transformers import GenerationConfig

    model = build_model(config, state).to(torch.bfloat16)
    tmp = folder.with_name(folder.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id).save_pretrained(tmp)
    tmp.rename(folder)


def bf16_rounding_effect(config, state: dict[str, torch.Tensor], ids: torch.Tensor) -> float:
    """Max abs logit change from rounding the weights to bfloat16 (computed in float32 either way)."""
    rounded = {k: v.to(torch.bfloat16).float() for k, v in state.items()}
    return float((logits_of(build_model(config, state), ids) - logits_of(build_model(config, rounded), ids)).abs().max())


def find_converter(source: Path, out: Path) -> Path:
    """convert_hf_to_gguf.py in a llama.cpp tree, or extracted once (with the `conversion` package and
    gguf-py it imports) from llama-cpp-python's source archive, whose vendor/llama.cpp is the tree its
    library was built from."""
    if source.is_dir():
        script = source / "convert_hf_to_gguf.py"
        if not script.is_file():
            raise SystemExit(f"{source} has no convert_hf_to_gguf.py: pass --llama-cpp a llama.cpp source tree.")
        return script
    if not source.is_file() or not source.name.endswith((".tar.gz", ".tgz")):
        raise SystemExit(
            f"--llama-cpp {source}: not found. Pass a llama.cpp source tree (git clone "
            "https://github.com/ggml-org/llama.cpp, at the version llama-cpp-python vendors) or llama-cpp-python's "
            "source archive (pip download --no-binary :all: --no-deps llama-cpp-python==<installed version>)."
        )
    target = out / "llama.cpp-src"
    script = target / "convert_hf_to_gguf.py"
    if script.is_file():
        return script
    with tarfile.open(source) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name and
                   (m.name.endswith("/convert_hf_to_gguf.py") or "/vendor/llama.cpp/conversion/" in m.name
                    or "/vendor/llama.cpp/gguf-py/" in m.name)]
        if not any(m.name.endswith("/vendor/llama.cpp/convert_hf_to_gguf.py") for m in members):
            raise SystemExit(f"{source} holds no vendor/llama.cpp/convert_hf_to_gguf.py: is it llama-cpp-python's sdist?")
        prefix = members[0].name.split("/vendor/llama.cpp/")[0] + "/vendor/llama.cpp/"
        for m in members:
            m.name = m.name[len(prefix):]
        tar.extractall(target, members=members, filter="data")
    return script


def convert_to_bf16_gguf(script: Path, hf_folder: Path, out: Path) -> None:
    tmp = out.with_suffix(".tmp")
    cmd = [sys.executable, str(script), str(hf_folder), "--outtype", "bf16", "--outfile", str(tmp)]
    print("running", " ".join(cmd), flush=True)
    # the converter puts its own gguf-py first on sys.path; perfxlm's path must not shadow it
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run(cmd, check=True, env=env)
    tmp.rename(out)


def quantize_all(bf16: Path, out: Path, ftypes: list[str], threads: int) -> list[Path]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from compare_llamacpp import requantize

    paths = []
    for ftype in ftypes:
        target = out / f"rotated.{ftype}.gguf"
        t0 = time.perf_counter()
        existed = target.exists()
        requantize(str(bf16), ftype, threads, out=target)
        print(f"{target}: {'exists' if existed else f'quantized in {time.perf_counter() - t0:.1f} s'}", flush=True)
        paths.append(target)
    return paths


# ---- main ---------------------------------------------------------------------------------------------

def make_hf_folder(model: str, folder: Path, seed: int) -> None:
    from perfxlm.model.loader.gguf_tokenizer import load_gguf_tokenizer

    t0 = time.perf_counter()
    gguf_config, state = load_gguf_float(model)
    tokenizer = load_gguf_tokenizer(model, use_cache=False)
    rotated = quarot(state, seed)
    config = llama_config(gguf_config, tied="lm_head.weight" not in state)
    config_rot = llama_config(gguf_config, tied=False)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                         tokenize=False)
    ids = torch.tensor([tokenizer.encode(chat, add_special_tokens=False)])
    check = check_same_function(config, state, config_rot, rotated, ids)
    print(f"rotation (seed {seed}): max |logit difference| {check['max_abs_logit_diff']:.3g} "
          f"(logits up to {check['max_abs_logit']:.1f}), greedy text the same: "
          f"{tokenizer.decode(check['greedy_after'])!r}", flush=True)
    effect = bf16_rounding_effect(config_rot, rotated, ids)
    print(f"saved in bfloat16: the rounding moves the logits by up to {effect:.3g}; these bf16 weights are "
          "the base of every comparison", flush=True)
    save_hf_folder(folder, config_rot, rotated, tokenizer)
    print(f"{folder}: written in {time.perf_counter() - t0:.1f} s", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a Llama GGUF file (default: perfxlm's default model)")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="output folder (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random rotation")
    ap.add_argument("--llama-cpp", default=None, metavar="PATH",
                    help="llama.cpp source tree, or llama-cpp-python's source archive (.tar.gz), for "
                         "convert_hf_to_gguf.py (default: a tree extracted earlier into OUT/llama.cpp-src)")
    ap.add_argument("--ftypes", default=",".join(FTYPES), help="llama.cpp formats to quantize to (comma list)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    from perfxlm.config import default_model_path

    model = args.model or default_model_path()
    out = Path(args.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    hf_folder, bf16 = out / "rotated-hf", out / "rotated.bf16.gguf"
    if hf_folder.exists():
        print(f"{hf_folder}: exists")
    else:
        make_hf_folder(model, hf_folder, args.seed)
    if bf16.exists():
        print(f"{bf16}: exists")
    else:
        t0 = time.perf_counter()
        source = Path(args.llama_cpp).expanduser() if args.llama_cpp else out / "llama.cpp-src"
        convert_to_bf16_gguf(find_converter(source, out), hf_folder, bf16)
        print(f"{bf16}: converted in {time.perf_counter() - t0:.1f} s", flush=True)
    ftypes = [f.strip() for f in args.ftypes.split(",") if f.strip()]
    quantize_all(bf16, out, ftypes, args.threads)


if __name__ == "__main__":
    main()

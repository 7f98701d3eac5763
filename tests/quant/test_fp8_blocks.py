"""DeepSeek-V3's block-quantized FP8 checkpoints (`quant_method: "fp8"`, `weight_block_size`): the e4m3
bytes kept with one scale per block, greedy float32 output token-identical to transformers on the
dequantized weights; block shapes that do not divide the weights (partial last blocks), experts, a module
left unquantized; bad checkpoints refused by name from the headers."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
import transformers

from perfxlm import LLM
from tests.model.test_architectures_vs_hf import COMMON, assert_greedy_matches
from tests.model.test_recent_families_vs_hf import perturb
from tests.quant.packed_checkpoints import write_packed

pytestmark = pytest.mark.usefixtures("one_thread")

FP8_MAX = 448.0
# what DeepSeek-V3 quantizes: every projection of attention, the dense MLPs, the experts and the shared
# experts (the router `mlp.gate`, embeddings, head and norms stay as they are)
DEEPSEEK_PROJECTIONS = re.compile(
    r"\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|gate_proj|up_proj|down_proj)$"
)
# hidden 200: not whole 128-column blocks (the second block of every row is partial, 72 columns)
CONFIG = dict(
    hidden_size=200, intermediate_size=136, moe_intermediate_size=40, num_hidden_layers=2,
    num_attention_heads=3, num_key_value_heads=3, q_lora_rank=48, kv_lora_rank=36, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=6, num_experts_per_tok=2, n_shared_experts=1,
    first_k_dense_replace=1, n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.0,
)  # fmt: skip


def fp8_block_parts(block: tuple[int, int], skip: tuple[str, ...] = ()):
    """make_parts for write_packed: w [N, K] -> e4m3 bytes and weight_scale_inv [ceil(N/BN), ceil(K/BK)]
    (each block's absmax / 448, as DeepSeek quantizes), dequantized = fp8 x scale_inv."""
    bn, bk = block

    def make(name: str, w: torch.Tensor):
        if name.removesuffix(".weight") in skip:
            return {"weight": w}, w
        n, k = w.shape
        rows, cols = math.ceil(n / bn), math.ceil(k / bk)
        padded = torch.zeros(rows * bn, cols * bk)
        padded[:n, :k] = w
        amax = padded.view(rows, bn, cols, bk).abs().amax(dim=(1, 3))
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
        q = (w / full).to(torch.float8_e4m3fn)
        return {"weight": q, "weight_scale_inv": scale.float()}, q.float() * full

    return make


def build_fp8_checkpoint(path: str, block=(128, 128), skip: tuple[str, ...] = (), seed: int = 0, **config_over):
    """A random-weight DeepseekV3 model saved with its projections as fp8 blocks; returns the model holding
    the dequantized weights (the reference)."""
    torch.manual_seed(seed)
    config = transformers.DeepseekV3Config(**{**COMMON, **CONFIG, **config_over})
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    model.set_experts_implementation("eager")
    perturb(model)
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    if skip:
        qc["modules_to_not_convert"] = list(skip)
    write_packed(path, model, fp8_block_parts(block, skip), qc, projections=DEEPSEEK_PROJECTIONS)
    return model


@pytest.mark.parametrize("block,skip", [
    ((128, 128), ()),  # DeepSeek-V3's blocks: partial ones on every 200-wide side
    ((16, 24), ("model.layers.0.self_attn.o_proj", "model.layers.1.mlp.shared_experts.down_proj")),
])  # fmt: skip
def test_fp8_block_checkpoint_matches_transformers(tmp_path, block, skip):
    path = str(tmp_path / "fp8")
    hf = build_fp8_checkpoint(path, block, skip)
    assert_greedy_matches(path, hf)


def test_fp8_blocks_stay_packed(tmp_path):
    """The weights are the checkpoint's bytes (one byte a weight plus a float32 scale per row and group of
    the block's columns), float where the checkpoint left them float."""
    from perfxlm.quant.weight import QuantizedWeight

    path = str(tmp_path / "fp8")
    build_fp8_checkpoint(path, (128, 128), ("model.layers.0.self_attn.o_proj",))
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=16)
    model = llm.llm_engine.core.model
    attn0, attn1 = (model.model.layers[i].self_attn for i in (0, 1))
    o = attn1.o_proj.weight  # [200, 36]: gcd(128, 36) = 4 columns a group, one scale per row and group
    assert isinstance(o, QuantizedWeight) and o.bits == 8 and o.levels is not None and o.codes.dtype == torch.uint8
    assert (o.group, tuple(o.scales.shape), o.scales.dtype) == (4, (200, 9), torch.float32)
    assert tuple(attn1.q_a_proj.weight.scales.shape) == (48, 200 // 8)  # gcd(128, 200) = 8
    experts = model.model.layers[1].mlp.experts
    assert isinstance(experts.gate_up_proj, QuantizedWeight) and tuple(experts.gate_up_proj.codes.shape) == (6, 80, 200)
    assert isinstance(experts.down_proj, QuantizedWeight) and experts.down_proj.levels is not None
    assert not isinstance(attn0.o_proj.weight, QuantizedWeight)  # modules_to_not_convert: float


@pytest.mark.parametrize("edit,named", [
    (lambda qc, sd: sd.__setitem__("model.layers.1.self_attn.q_b_proj.weight_scale_inv", torch.ones(2, 2)),
     r"'model\.layers\.1\.self_attn\.q_b_proj\.weight_scale_inv' is F32 \[2, 2\].*needs F32 \[1, 1\]"),
    (lambda qc, sd: sd.pop("model.layers.0.mlp.down_proj.weight_scale_inv"),
     r"'model\.layers\.0\.mlp\.down_proj\.weight_scale_inv' is missing"),
    (lambda qc, sd: qc.__setitem__("weight_block_size", [128]), r"weight_block_size=\[128\] is not supported"),
    (lambda qc, sd: qc.__setitem__("activation_scheme", "static"), r"activation_scheme='static' is not supported"),
])  # fmt: skip
def test_bad_fp8_checkpoint_named_before_weights(tmp_path, edit, named):
    from safetensors.torch import load_file, save_file

    path = tmp_path / "fp8"
    build_fp8_checkpoint(str(path), (128, 128))
    config = json.loads((path / "config.json").read_text())
    sd = load_file(path / "model.safetensors")
    edit(config["quantization_config"], sd)
    (path / "config.json").write_text(json.dumps(config))
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=named):
        LLM(str(path), skip_tokenizer_init=True, dtype="float32", num_kv_blocks=16)


def test_transformers_own_fp8_loading_is_the_reference(tmp_path):
    """transformers loads these checkpoints itself (on a CPU it dequantizes them at load, and only block
    shapes that divide every weight): its model is the reference the engine is held to, greedy
    token-identical in float32."""
    path = str(tmp_path / "fp8")
    ours = build_fp8_checkpoint(path, (4, 4))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    theirs.set_experts_implementation("eager")
    ids = torch.randint(3, 1000, (1, 23))
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids).logits, rtol=0, atol=0)
    assert_greedy_matches(path, theirs)


def test_fp8_blocks_on_a_fused_qkv_family(tmp_path):
    """Qwen3's FP8 checkpoints are the same format: q, k and v (and gate, up) arrive as separate fp8 blocks
    and are fused into one weight, each part's rows keeping their own blocks' scales."""
    from tests.model.test_architectures_vs_hf import build_checkpoint
    from tests.quant.packed_checkpoints import PROJECTIONS

    path = str(tmp_path / "qwen3")
    hf = build_checkpoint(path, "qwen3-qknorm-headdim-bias")
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 32]}
    write_packed(path, hf, fp8_block_parts((16, 32)), qc, projections=PROJECTIONS)
    assert_greedy_matches(path, hf)


def test_whole_16_column_groups_take_the_native_kernel(tmp_path, monkeypatch):
    """Inputs whose groups are whole 16-column runs (gcd(128, K) a multiple of 16: every DeepSeek-V3
    projection) multiply the e4m3 bytes in the native kernel (csrc/fp8_linear.cpp), experts included; the
    rest (o_proj's 36 inputs here: groups of 4) keep the plain-torch product; greedy output unchanged."""
    from perfxlm.ops import fp8_linear, native

    if native.kernels() is None:
        pytest.skip("no compiler for the native kernels")
    widths = []
    real = fp8_linear.fp8_linear
    monkeypatch.setattr(fp8_linear, "fp8_linear", lambda *a: widths.append(a[2].in_features) or real(*a))
    path = str(tmp_path / "fp8")
    hf = build_fp8_checkpoint(path, (128, 128), hidden_size=192, intermediate_size=160, moe_intermediate_size=48,
                              q_lora_rank=48)
    assert_greedy_matches(path, hf)
    # hidden-wide inputs (q_a, kv_a, gate / up), the dense MLP's down, q_b and the experts' down (48)
    assert {192, 160, 48} <= set(widths) and 36 not in widths

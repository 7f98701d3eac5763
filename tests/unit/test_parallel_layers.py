"""Tensor-parallel layers in one process: each "rank" a thread with its own shard, the collectives a
barrier over shared slots (summed in rank order, as the shared-memory all-reduce does). Every layer's
ranks together must compute what the whole layer computes; with one rank a layer is its plain kind and
calls no collective."""

from __future__ import annotations

import threading
from typing import Any, Callable

import pytest
import torch

from perfxlm.quant import joining
from perfxlm.distributed.parallel_state import SINGLE, TPGroup, building_for, split_sizes, tp_group
from perfxlm.model.layers.embed_head import LMHead, ParallelLMHead, VocabEmbedding, VocabParallelEmbedding
from perfxlm.model.layers.linear import Linear, MergedLinear
from perfxlm.model.layers.moe import FusedMoE
from perfxlm.model.layers.parallel_linear import (
    ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear,
)  # fmt: skip

pytestmark = pytest.mark.usefixtures("one_thread")


class ThreadComm:
    """The collectives of `world` threads: a rank's tensor into its slot, wait for all, read them all."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=30)
        self.slots: list[Any] = [None] * world
        self.calls = 0

    def rank(self, r: int) -> "RankComm":
        return RankComm(self, r)


class RankComm:
    def __init__(self, shared: ThreadComm, rank: int) -> None:
        self.shared, self.rank = shared, rank

    def _exchange(self, x: torch.Tensor, combine: Callable[[list[torch.Tensor]], torch.Tensor]) -> torch.Tensor:
        s = self.shared
        s.slots[self.rank] = x.clone()
        s.barrier.wait()
        out = combine(list(s.slots))
        s.barrier.wait()
        if self.rank == 0:
            s.calls += 1
        return out

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        def total(parts: list[torch.Tensor]) -> torch.Tensor:
            acc = parts[0].clone()
            for p in parts[1:]:
                acc += p
            return acc

        return self._exchange(x, total)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return self._exchange(x, lambda parts: torch.cat(parts, dim=-1))


def on_ranks(world: int, build: Callable[[], Any], run: Callable[[Any], Any]) -> tuple[list[Any], ThreadComm]:
    """Build a layer per rank (inside building_for its group), then run them together, one thread each."""
    comm = ThreadComm(world)
    layers = []
    for r in range(world):
        with building_for(TPGroup(r, world, comm.rank(r))):
            layers.append(build())
    results: list[Any] = [None] * world
    errors: list[BaseException] = []

    def target(r: int) -> None:
        try:
            with torch.no_grad():
                results[r] = run(layers[r])
        except BaseException as exc:  # surfaced below
            errors.append(exc)
            comm.barrier.abort()

    threads = [threading.Thread(target=target, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results, comm


def load(layer: torch.nn.Module, name: str, tensor: torch.Tensor, shard: str | None = None) -> None:
    """What the loader does with one checkpoint tensor: the layer's part, then into its parameter."""
    part = layer.rank_part(name, tensor, shard, None) if hasattr(layer, "rank_part") else tensor
    param = getattr(layer, name)
    if shard is None:
        param.data.copy_(part)
    else:
        layer.load_shard(param, part, shard)


@pytest.mark.parametrize("world", [2, 3])
def test_column_then_row_parallel_equals_whole(world):
    torch.manual_seed(world)
    hidden, inter, out = 37, 50, 29
    w1, b1, w2, b2 = torch.randn(inter, hidden), torch.randn(inter), torch.randn(out, inter), torch.randn(out)
    x = torch.randn(7, hidden)
    ref = torch.nn.functional.linear(torch.nn.functional.linear(x, w1, b1), w2, b2)

    def build():
        col, row = ColumnParallelLinear(hidden, inter, bias=True), RowParallelLinear(inter, out, bias=True)
        for layer, w, b in ((col, w1, b1), (row, w2, b2)):
            load(layer, "weight", w)
            load(layer, "bias", b)
        return col, row

    outs, comm = on_ranks(world, build, lambda layers: layers[1](layers[0](x)))
    for o in outs:
        torch.testing.assert_close(o, ref, atol=1e-4, rtol=1e-5)
        assert torch.equal(o, outs[0])  # every rank holds the same bits after the all-reduce
    assert comm.calls == 1  # one all-reduce for the pair, none for the column-parallel layer


def test_qkv_splits_by_kv_heads_and_feeds_its_output_projection():
    """6 query heads over 3 KV heads on 2 ranks: KV heads 2 and 1, so query heads 4 and 2, and the output
    projection's columns follow the query heads, not an even split."""
    torch.manual_seed(1)
    hidden, hd, heads, kv = 20, 4, 6, 3
    q, k, v = torch.randn(heads * hd, hidden), torch.randn(kv * hd, hidden), torch.randn(kv * hd, hidden)
    o = torch.randn(hidden, heads * hd)
    x = torch.randn(5, hidden)
    ref = torch.nn.functional.linear(torch.nn.functional.linear(x, q), o)

    def build():
        qkv = QKVParallelLinear(hidden, hd, heads, kv)
        for name, t in (("q", q), ("k", k), ("v", v)):
            load(qkv, "weight", t, name)
        out = RowParallelLinear(heads * hd, hidden, input_part=qkv.q_part)
        load(out, "weight", o)
        return qkv, out

    def run(layers):
        qkv, out = layers
        y = qkv(x)
        return (qkv.num_heads, qkv.num_kv_heads), y, out(y[:, : qkv.num_heads * hd].contiguous())

    results, _ = on_ranks(2, build, run)
    assert [r[0] for r in results] == [(4, 2), (2, 1)]
    whole_q = torch.cat([r[1][:, : r[0][0] * hd] for r in results], dim=1)
    torch.testing.assert_close(whole_q, torch.nn.functional.linear(x, q))
    whole_k = torch.cat([r[1][:, r[0][0] * hd : (r[0][0] + r[0][1]) * hd] for r in results], dim=1)
    torch.testing.assert_close(whole_k, torch.nn.functional.linear(x, k))
    for r in results:
        torch.testing.assert_close(r[2], ref, atol=1e-4, rtol=1e-5)


def test_fused_checkpoint_tensor_gives_the_same_shard_as_its_parts():
    """Phi-3 stores qkv_proj and gate_up_proj already fused: a rank's cut of the fused tensor equals its
    parts' cuts stacked."""
    torch.manual_seed(2)
    q, k, v = torch.randn(24, 10), torch.randn(8, 10), torch.randn(8, 10)
    gate, up = torch.randn(15, 10), torch.randn(15, 10)
    for r in range(2):
        with building_for(TPGroup(r, 2, object())):
            by_parts, fused = QKVParallelLinear(10, 4, 6, 2), QKVParallelLinear(10, 4, 6, 2)
            mlp_parts, mlp_fused = (MergedColumnParallelLinear(10, {"gate": 15, "up": 15}) for _ in range(2))
        for name, t in (("q", q), ("k", k), ("v", v)):
            load(by_parts, "weight", t, name)
        load(fused, "weight", torch.cat([q, k, v]))
        assert torch.equal(by_parts.weight, fused.weight)
        for name, t in (("gate", gate), ("up", up)):
            load(mlp_parts, "weight", t, name)
        load(mlp_fused, "weight", torch.cat([gate, up]))
        assert torch.equal(mlp_parts.weight, mlp_fused.weight)
        assert mlp_parts.output_sizes == {"gate": split_sizes(15, 2)[r], "up": split_sizes(15, 2)[r]}


def test_vocab_parallel_embedding_and_head_pad_the_last_shard():
    """1001 rows over 3 ranks: 334 each, the last holding 333 and a zero row; lookups of every rank's ids
    and the gathered logits are the whole table's (padding cut off), the tied head sharing the shard."""
    torch.manual_seed(3)
    vocab, hidden = 1001, 12
    table = torch.randn(vocab, hidden)
    ids = torch.tensor([0, 333, 334, 667, 668, 1000, 5])
    h = torch.randn(4, hidden)

    def build():
        emb = VocabParallelEmbedding(vocab, hidden)
        load(emb, "weight", table)
        return emb, ParallelLMHead(vocab, hidden, tied_to=emb, logit_soft_cap=3.0)

    results, comm = on_ranks(3, build, lambda layers: (layers[0](ids), layers[1](h), layers[0].weight.shape))
    ref_head = LMHead(vocab, hidden, logit_soft_cap=3.0)
    ref_head.weight.data.copy_(table)
    for emb, logits, shape in results:
        assert shape == (334, hidden)
        assert torch.equal(emb, table[ids])
        assert logits.shape == (4, vocab)
        torch.testing.assert_close(logits, ref_head(h))
    assert comm.calls == 2


@pytest.mark.parametrize("fused_stack", [False, True])
def test_fused_moe_splits_every_expert(fused_stack):
    torch.manual_seed(4)
    experts, top_k, hidden, inter = 5, 2, 16, 27
    gate, up = torch.randn(experts, inter, hidden) * 0.3, torch.randn(experts, inter, hidden) * 0.3
    down = torch.randn(experts, hidden, inter) * 0.3
    x, logits = torch.randn(9, hidden), torch.randn(9, experts)
    whole = FusedMoE(experts, top_k, hidden, inter, renormalize=True)
    whole.gate_up_proj.data.copy_(torch.cat([gate, up], dim=1))
    whole.down_proj.data.copy_(down)
    ref = whole(x, logits)

    def build():
        moe = FusedMoE(experts, top_k, hidden, inter, renormalize=True)
        if fused_stack:  # transformers 5's stacked checkpoint tensors
            for name, t in (("gate_up_proj", torch.cat([gate, up], dim=1)), ("down_proj", down)):
                getattr(moe, name).data.copy_(moe.rank_part(name, t, None, None))
        else:
            for e in range(experts):
                for name, shard, t in (("gate_up_proj", "gate", gate[e]), ("gate_up_proj", "up", up[e]),
                                       ("down_proj", "down", down[e])):  # fmt: skip
                    moe.load_shard(getattr(moe, name), moe.rank_part(name, t, shard, e), shard, e)
        return moe

    outs, comm = on_ranks(2, build, lambda moe: moe(x, logits))
    for o in outs:
        torch.testing.assert_close(o, ref, atol=1e-4, rtol=1e-5)
    assert comm.calls == 1


def test_one_rank_is_the_plain_layer_and_calls_no_collective():
    assert tp_group() is SINGLE
    row = RowParallelLinear(13, 7, bias=True)
    col = ColumnParallelLinear(13, 7)
    qkv = QKVParallelLinear(13, 4, 5, 5)  # 5 heads, 5 KV heads: any split works with one rank
    assert not row.reduces_output and row.tp.comm is None
    assert (row.weight.shape, col.weight.shape, qkv.weight.shape) == ((7, 13), (7, 13), (60, 13))
    t = torch.randn(7, 13)
    assert row.rank_part("weight", t, None, None) is t  # no copy, no narrowing
    emb = VocabParallelEmbedding(11, 3)
    assert emb.weight.shape == (11, 3)
    with torch.no_grad():  # layers start from torch.empty: give them finite values to compare
        row.weight.copy_(torch.randn(7, 13))
        row.bias.copy_(torch.randn(7))
    plain = Linear(13, 7, bias=True)
    plain.load_state_dict(row.state_dict())
    x = torch.randn(2, 13)
    assert torch.equal(row(x), plain(x))
    assert isinstance(qkv, MergedLinear) and qkv.num_heads == 5


def test_bad_groups_and_heads_are_refused():
    with pytest.raises(ValueError, match="needs a communicator"):
        TPGroup(0, 2)
    with pytest.raises(ValueError, match="outside a group"):
        TPGroup(2, 2, object())
    with building_for(TPGroup(0, 4, object())), pytest.raises(ValueError, match="exceeds the model's 3 KV heads"):
        QKVParallelLinear(16, 4, 6, 3)
    with building_for(TPGroup(0, 2, object())), pytest.raises(ValueError, match="do not form groups"):
        QKVParallelLinear(16, 4, 5, 2)
    with building_for(TPGroup(1, 2, object())):
        assert VocabParallelEmbedding(10, 4).weight.shape == (5, 4)
    assert tp_group() is SINGLE  # the context is left as it was


def test_fused_decode_takes_row_parallel_layers_with_their_all_reduce():
    """A rank's row-parallel output projection and down projection sum partial products: the fused layer
    takes them with the group's all-reduce between its halves; one rank's layers carry none."""
    from perfxlm.model.fused_decode import fused_attention, fused_mlp
    from perfxlm.model.layers.activation import SiluAndMul
    from perfxlm.model.layers.attention import Attention

    group = TPGroup(0, 2, object())
    with building_for(group):
        qkv, o = QKVParallelLinear(16, 4, 4, 2), RowParallelLinear(16, 16, input_part=(0, 8))
        gate_up, down = MergedColumnParallelLinear(16, {"gate": 10, "up": 10}), RowParallelLinear(10, 16)
    attn = Attention(qkv.num_heads, qkv.num_kv_heads, 4, 0.5)
    fa, fm = fused_attention(qkv, o, attn), fused_mlp(gate_up, down, SiluAndMul())
    assert fa is not None and fa.reduce == group.all_reduce
    assert fm is not None and fm.reduce == group.all_reduce
    single = fused_attention(QKVParallelLinear(16, 4, 2, 1), RowParallelLinear(8, 16), Attention(2, 1, 4, 0.5))
    assert single is not None and single.reduce is None


def test_unsupported_family_is_refused_by_name(monkeypatch):
    from perfxlm.model.loader import check_tensor_parallel
    from perfxlm.model.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
    from perfxlm.model.models.gpt_oss import GptOssForCausalLM
    from perfxlm.model.models.opt import OPTForCausalLM
    from perfxlm.model.models.qwen3 import Qwen3ForCausalLM

    for cls in (Qwen3ForCausalLM, GptOssForCausalLM, DeepseekV2ForCausalLM, DeepseekV3ForCausalLM, OPTForCausalLM):
        check_tensor_parallel(cls, None)
    # every causal family splits now: a family without parallel layers is refused by its name
    monkeypatch.setattr(OPTForCausalLM, "supports_tensor_parallel", False)
    with pytest.raises(ValueError, match="not supported for OPTForCausalLM"):
        check_tensor_parallel(OPTForCausalLM, None)


def test_mla_needs_a_head_per_rank():
    """MLA splits its query heads (its one latent KV head is replicated): more ranks than heads is refused
    by name; 3 heads over 2 ranks are 2 + 1, o_proj's columns following them."""
    from types import SimpleNamespace

    from perfxlm.model.layers.mla import MLAttention

    config = SimpleNamespace(hidden_size=16, num_attention_heads=3, qk_nope_head_dim=4, qk_rope_head_dim=2,
                             v_head_dim=5, kv_lora_rank=6, q_lora_rank=None, rope_scaling=None, rope_theta=1e4,
                             max_position_embeddings=64)  # fmt: skip
    with building_for(TPGroup(0, 4, object())), pytest.raises(ValueError, match="exceeds the model's 3 attention"):
        MLAttention(config)
    for rank, heads in ((0, 2), (1, 1)):
        with building_for(TPGroup(rank, 2, object())):
            mla = MLAttention(config)
        assert mla.num_heads == heads and mla.attn.num_heads == heads and mla.attn.num_kv_heads == 1
        assert mla.q_proj.weight.shape == (heads * 6, 16) and mla.kv_b_proj.weight.shape == (heads * 9, 6)
        assert mla.o_proj.input_part == (rank * 2 * 5, heads * 5)


@pytest.mark.parametrize("kind", ["int4_centred", "int4_mins", "int8", "stack"])
def test_quantized_weights_are_cut_in_their_own_form(kind):
    """A GGUF file's blocks reach the parallel layers quantized: rows move as rows of codes, columns as
    whole groups, padding rows are zeros; each cut dequantizes to the same cut of the dense weight."""
    from perfxlm.model.layers.rank_sharded import COLUMNS, ROWS, narrow, pad_rows, take_parts
    from perfxlm.quant.quantizers import (
        quantize_asymmetric_int4, quantize_symmetric_int4, quantize_symmetric_int8,
    )  # fmt: skip
    from perfxlm.quant.weight import QuantizedWeight

    torch.manual_seed(5)
    w = torch.randn(3, 10, 128) if kind == "stack" else torch.randn(10, 128)
    quantize = {"int4_centred": quantize_symmetric_int4, "int4_mins": quantize_asymmetric_int4,
                "int8": quantize_symmetric_int8, "stack": quantize_symmetric_int8}[kind]  # fmt: skip
    if kind == "stack":
        qw = joining.stack_experts([quantize(e, 32) for e in w])
    else:
        qw = quantize(w, 32)
    dense = qw.dense()
    torch.testing.assert_close(narrow(qw, COLUMNS, 32, 64).dense(), dense[..., 32:96], rtol=0, atol=0)
    torch.testing.assert_close(narrow(qw, ROWS, 3, 4).dense(), dense[..., 3:7, :], rtol=0, atol=0)
    if kind != "stack":
        fused = take_parts(qw, ROWS, [(0, 2), (6, 3)])
        torch.testing.assert_close(fused.dense(), torch.cat([dense[0:2], dense[6:9]]), rtol=0, atol=0)
        padded = pad_rows(narrow(qw, ROWS, 7, 3), 5)
        assert padded.shape == (5, 128) and not padded.dense()[3:].any()
    with pytest.raises(ValueError, match="group boundaries"):
        narrow(qw, COLUMNS, 16, 64)


def test_a_row_parallel_rank_takes_a_quantized_checkpoint_tensor():
    from perfxlm.quant.quantizers import quantize_symmetric_int4

    torch.manual_seed(6)
    qw = quantize_symmetric_int4(torch.randn(12, 192), 32)
    with building_for(TPGroup(1, 2, object())):
        row = RowParallelLinear(192, 12)
    part = row.rank_part("weight", qw, None, None)
    assert part.in_features == 96 and part.out_features == 12
    torch.testing.assert_close(part.dense(), qw.dense()[:, 96:], rtol=0, atol=0)


def test_a_split_off_group_boundaries_names_the_weight():
    """96 inputs over 2 ranks are 48 each: not whole groups of 32 codes. The load says which weight."""
    from perfxlm.model.models.base import CheckpointModel
    from perfxlm.quant.quantizers import quantize_symmetric_int4

    class Tiny(CheckpointModel):
        def __init__(self) -> None:
            super().__init__()
            self.proj = RowParallelLinear(96, 8)

    with building_for(TPGroup(1, 2, object())):
        model = Tiny()
    blocks = quantize_symmetric_int4(torch.randn(8, 96), 32)
    with pytest.raises(ValueError, match=r"proj\.weight: columns \[48, 96\) .* group boundaries"):
        model.load_weights([("proj.weight", blocks)])


def test_a_wrong_sized_checkpoint_tensor_is_refused_not_cut():
    """At one rank the parameter's shape check catches a checkpoint tensor of the wrong size; a rank must
    not quietly cut a shard of the wrong rows out of it."""
    with building_for(TPGroup(0, 2, object())):
        col, row = ColumnParallelLinear(10, 12, bias=True), RowParallelLinear(12, 10, bias=True)
        gate_up = MergedColumnParallelLinear(10, {"gate": 6, "up": 6})
        emb = VocabParallelEmbedding(20, 10)
        moe = FusedMoE(3, 2, 10, 8, renormalize=True)
    cases = [
        (col, "weight", torch.randn(14, 10), None), (col, "bias", torch.randn(13), None),
        (row, "weight", torch.randn(10, 16), None), (row, "bias", torch.randn(11), None),
        (gate_up, "weight", torch.randn(7, 10), "gate"), (gate_up, "weight", torch.randn(14, 10), None),
        (emb, "weight", torch.randn(22, 10), None), (moe, "down_proj", torch.randn(10, 9), "down"),
    ]  # fmt: skip
    for layer, name, tensor, shard in cases:
        with pytest.raises(ValueError, match="checkpoint shape .* the model expects"):
            layer.rank_part(name, tensor, shard, None if shard != "down" else 0)
    assert col.rank_part("weight", torch.randn(12, 10), None, None).shape == (6, 10)


@pytest.mark.parametrize("kind", ["float32", "mxfp4"])
def test_biased_interleaved_experts_split_by_intermediate_size(kind):
    """gpt-oss's experts: gate and up rows interleaved, a bias on both products. Each rank keeps its run of
    interleaved rows with their biases (MXFP4 stacks cut as codes, down's inputs on whole 32-blocks), and
    only rank 0 keeps down's bias: the ranks' partial outputs sum to the whole layer's, the bias once."""
    from perfxlm.model.layers.activation import ClampedSwiGLU
    from perfxlm.model.layers.moe import grouped_experts
    from perfxlm.quant import mxfp4

    torch.manual_seed(8)
    experts, top_k, hidden, inter = 5, 2, 64, 64  # 32 intermediate columns a rank: whole MXFP4 blocks
    gate_up, down = torch.randn(experts, 2 * inter, hidden) * 0.2, torch.randn(experts, hidden, inter) * 0.2
    biases = {"gate_up_proj_bias": torch.randn(experts, 2 * inter), "down_proj_bias": torch.randn(experts, hidden)}
    stacks: dict[str, Any] = {"gate_up_proj": gate_up, "down_proj": down}
    if kind == "mxfp4":
        stacks = {name: mxfp4.from_checkpoint(*mxfp4.quantize_reference(t), name) for name, t in stacks.items()}
    act = ClampedSwiGLU(1.702, 1.3)
    x = torch.randn(9, hidden)
    weights, ids = torch.softmax(torch.randn(9, experts), -1).topk(top_k, dim=-1)
    ref = grouped_experts(x, weights, ids, stacks["gate_up_proj"], stacks["down_proj"], act, *biases.values())
    total = torch.zeros_like(ref)
    for r in range(2):
        with building_for(TPGroup(r, 2, object())):
            moe = FusedMoE(experts, top_k, hidden, inter, renormalize=False, bias=True, act=act, interleaved=True)
        cut = {name: moe.rank_part(name, t, None, None) for name, t in {**stacks, **biases}.items()}
        assert tuple(cut["gate_up_proj"].shape) == (experts, inter, hidden) and cut["down_proj"].shape[-1] == 32
        assert cut["down_proj_bias"].any() == (r == 0)
        total += grouped_experts(x, weights, ids, cut["gate_up_proj"], cut["down_proj"], act,
                                 cut["gate_up_proj_bias"], cut["down_proj_bias"])  # fmt: skip
    torch.testing.assert_close(total, ref, atol=1e-4, rtol=1e-4)
    if kind == "mxfp4":  # 96 intermediate columns are 48 a rank: not whole blocks of 32, refused
        with building_for(TPGroup(1, 2, object())):
            moe = FusedMoE(experts, top_k, hidden, 96, renormalize=False, bias=True, act=act, interleaved=True)
        wide = mxfp4.from_checkpoint(*mxfp4.quantize_reference(torch.randn(experts, hidden, 96)), "down_proj")
        with pytest.raises(ValueError, match="group boundaries"):
            moe.rank_part("down_proj", wide, None, None)

import pytest
import torch

from perfxlm.model.layers.sampler import Sampler, SamplingMetadata, apply_min_p, apply_top_k_top_p


def meta(n, temperature=1.0, top_p=None, top_k=None, min_p=None, generators=None):
    return SamplingMetadata(
        temperature=torch.full((n,), temperature),
        all_greedy=temperature == 0,
        top_p=None if top_p is None else torch.full((n,), top_p),
        top_k=None if top_k is None else torch.full((n,), top_k, dtype=torch.int64),
        min_p=None if min_p is None else torch.full((n,), min_p),
        generators=generators or {},
    )


def test_greedy_is_argmax():
    logits = torch.randn(5, 50)
    assert torch.equal(Sampler()(logits, meta(5, temperature=0.0)).token_ids, logits.argmax(-1))


def _top_k_top_p_reference(row, k, p):
    probs = torch.softmax(row, -1)
    order = torch.argsort(row, descending=True)
    keep = set(order[:k].tolist()) if k else set(range(row.numel()))
    if p is not None:
        cum, kept = 0.0, set()
        for idx in order.tolist():
            if idx not in keep:
                continue
            kept.add(idx)
            cum += probs[idx].item()
            if cum >= p:
                break
        keep = kept
    return keep


@pytest.mark.parametrize("k,p", [(5, None), (None, 0.6), (7, 0.5), (1, None)])
def test_top_k_top_p_matches_reference(k, p):
    torch.manual_seed(0)
    logits = torch.randn(4, 37)
    kt = None if k is None else torch.full((4,), k)
    pt = None if p is None else torch.full((4,), p)
    out = apply_top_k_top_p(logits.clone(), kt, pt)
    for i in range(4):
        kept = set(torch.nonzero(out[i] > float("-inf")).flatten().tolist())
        ref = _top_k_top_p_reference(logits[i], k, None)
        if p is not None:
            # top-p over the top-k-renormalised distribution
            masked = logits[i].clone()
            masked[[j for j in range(37) if j not in ref]] = float("-inf")
            ref = _top_k_top_p_reference(masked, None, p) & ref
        assert kept == ref


def test_min_p_keeps_tokens_above_fraction_of_max():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    out = apply_min_p(logits, torch.tensor([0.25]))
    assert torch.isfinite(out[0]).tolist() == [True, True, True, False]


def test_sampling_follows_distribution():
    torch.manual_seed(0)
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().expand(20000, 3).contiguous()
    samples = Sampler()(logits, meta(20000)).token_ids
    freq = torch.bincount(samples, minlength=3).float() / 20000
    torch.testing.assert_close(freq, probs, atol=0.02, rtol=0)


def test_seeded_rows_are_reproducible_and_batch_independent():
    torch.manual_seed(0)
    logits = torch.randn(3, 100)
    a = Sampler()(logits, meta(3, generators={1: torch.Generator().manual_seed(42)})).token_ids
    b = Sampler()(logits[1:2], meta(1, generators={0: torch.Generator().manual_seed(42)})).token_ids
    assert a[1] == b[0]


def test_top_k_one_is_greedy():
    logits = torch.randn(6, 40)
    assert torch.equal(Sampler()(logits, meta(6, top_k=1)).token_ids, logits.argmax(-1))


def test_top_p_falls_back_to_full_sort_when_candidates_are_not_enough():
    # A nearly flat 5000-token distribution: the 1024 best tokens hold ~25 % of the mass, so
    # top_p=0.9 must look past them; top_p=0.01 stays within them.
    logits = torch.randn(2, 5000, generator=torch.Generator().manual_seed(0)) * 0.01
    logits[:, :10] += 3.0
    ps = [0.9, 0.01]
    out = apply_top_k_top_p(logits.clone(), None, torch.tensor(ps))
    for row, p in enumerate(ps):
        probs = logits[row].softmax(-1).sort(descending=True).values
        expected = int((probs.cumsum(0) - probs < p).sum())
        assert int(torch.isfinite(out[row]).sum()) == expected
    assert int(torch.isfinite(out[0]).sum()) > 1024


def test_rows_with_filters_off_neither_widen_top_k_nor_force_a_full_sort(monkeypatch):
    """A greedy / top_k=-1 / top_p=1.0 row sharing a step with filtering rows: the same masks as each row
    alone, and no sort of the whole vocabulary (which costs ~100x a top-k slice on CPU)."""
    from perfxlm.model.layers.sampler import apply_top_k_top_p

    torch.manual_seed(0)
    vocab = 5000
    logits = torch.randn(3, vocab)
    logits[2, :20] += 12.0  # peaked: the top-p row's mass fits in the candidate slice
    k = torch.tensor([5, vocab, vocab])
    p = torch.tensor([1.0, 1.0, 0.9])
    sorts = {"n": 0}
    original = torch.Tensor.sort

    def counting(self, *args, **kwargs):
        sorts["n"] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "sort", counting)
    together = apply_top_k_top_p(logits, k, p)
    assert sorts["n"] == 0
    monkeypatch.undo()
    for row in range(3):
        alone = apply_top_k_top_p(logits[row : row + 1], k[row : row + 1], p[row : row + 1])
        assert torch.equal(together[row : row + 1].isinf(), alone.isinf()), row
    assert int((~together[0].isinf()).sum()) == 5
    assert not together[1].isinf().any()
    assert 0 < int((~together[2].isinf()).sum()) <= 20

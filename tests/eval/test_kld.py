"""`perfxlm eval kld`: llama.cpp's KL-divergence statistics computed through the engine."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from perfxlm.eval import kld_base
from perfxlm.eval.kld import kl_divergence, save_base_logprobs
from perfxlm.eval.kld_stats import KldAccumulator, summarize, token_stats
from perfxlm.eval.perplexity import perplexity
from tests.cli_cases import run_cli_cases
from tests.conftest import default_model_or_skip, make_llama_checkpoint

CTX = 64


@pytest.fixture(scope="module")
def tiny_engine(tiny_llama):
    from perfxlm import LLM

    return LLM(tiny_llama, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=256, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def tiny_int4(tiny_llama):
    from perfxlm import LLM

    return LLM(tiny_llama, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=256,
               enable_prefix_caching=False, quantization="int4")  # fmt: skip


@pytest.fixture(scope="module")
def token_ids() -> list[int]:
    g = torch.Generator().manual_seed(11)
    return torch.randint(3, 1000, (CTX * 4 + 9,), generator=g).tolist()


@pytest.fixture(scope="module")
def base_file(tiny_engine, token_ids, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("kld") / "base.kld")
    save_base_logprobs(tiny_engine, token_ids, path, CTX)
    return path


# ---- statistics ----------------------------------------------------------------------------------------
def test_token_stats_by_hand():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(7, 13, generator=g).log_softmax(-1)
    model = torch.randn(7, 13, generator=g).log_softmax(-1)
    targets = torch.randint(0, 13, (7,), generator=g)
    s = token_stats(base, model, targets)
    p, q = base.double().exp(), model.double().exp()
    for t in range(7):
        assert s.kld[t] == pytest.approx(float((p[t] * (p[t].log() - q[t].log())).sum()), abs=1e-6)
        assert s.nll_base[t] == pytest.approx(-float(base[t, targets[t]]), abs=1e-6)
        assert s.delta_p[t] == pytest.approx(float(q[t, targets[t]] - p[t, targets[t]]), abs=1e-6)
        assert s.same_top[t] == (int(p[t].argmax()) == int(q[t].argmax()))
    with pytest.raises(ValueError, match="vocabulary"):
        token_stats(base, model[:, :12], targets)


def test_summary_formulas_by_hand():
    rng = np.random.default_rng(3)
    n = 500
    nll_b = rng.gamma(2.0, 1.0, n)
    nll_q = nll_b + rng.normal(0.05, 0.1, n)
    kld = rng.gamma(0.5, 0.01, n)
    dp = rng.normal(-0.001, 0.02, n)
    same = rng.random(n) < 0.9
    s = summarize(kld, nll_q, nll_b, dp, same)
    se = lambda v: v.std() / math.sqrt(n - 1)  # noqa: E731 - population std over n - 1: llama.cpp's estimate
    assert s.ppl_model.value == pytest.approx(math.exp(nll_q.mean()))
    assert s.ppl_model.error == pytest.approx(math.exp(nll_q.mean()) * se(nll_q))
    assert s.ln_ppl_ratio.value == pytest.approx((nll_q - nll_b).mean())
    assert s.ln_ppl_ratio.error == pytest.approx(se(nll_q - nll_b))
    assert s.ppl_ratio.value == pytest.approx(math.exp((nll_q - nll_b).mean()))
    assert s.correlation == pytest.approx(np.corrcoef(nll_q, nll_b)[0, 1])
    assert s.kld_mean.value == pytest.approx(kld.mean()) and s.kld_mean.error == pytest.approx(se(kld))
    assert s.kld_percentiles[50.0] == pytest.approx(np.median(kld)) and s.kld_max == kld.max()
    assert s.dp_rms.value == pytest.approx(math.sqrt((dp * dp).mean()))
    assert s.same_top.value == pytest.approx(same.mean())
    assert s.same_top.error == pytest.approx(math.sqrt(same.mean() * (1 - same.mean()) / (n - 1)))
    report = s.report()
    for line in ("Mean PPL(Q)/PPL(base)         :", "Mean    KLD:", "Median  KLD:", "99.9%   KLD:",
                 " 5.0%   KLD:", "RMS Δp    :", "Same top p:"):
        assert line in report, line
    assert json.dumps(s.to_dict())  # JSON-safe


def test_accumulator_refuses_nothing():
    with pytest.raises(ValueError, match="no token"):
        KldAccumulator().summary()


# ---- the base file ---------------------------------------------------------------------------------------
def test_encoding_keeps_log_probabilities_within_its_step():
    g = torch.Generator().manual_seed(1)
    lp = (torch.randn(5, 4099, generator=g) * 4).log_softmax(-1)
    back = kld_base.decode(*kld_base.encode(lp))
    kept = lp >= lp.amax(-1, keepdim=True) - kld_base.RANGE
    assert (back - lp)[kept].abs().max() < 3e-4
    assert float((lp.exp() * (lp - back)).sum(-1).abs().max()) < 1e-5  # KLD of the stored base from itself


def test_base_file_holds_the_windows(base_file, token_ids):
    base = kld_base.open_base(base_file)
    w = base.windows
    assert w.n_windows == 4 and w.n_ctx == CTX and w.tokens == token_ids[: 4 * CTX]
    assert base.vocab_size == 1000 and base.rows(3).shape == (w.scored_per_window, 1000)
    assert torch.allclose(base.rows(0).exp().sum(-1), torch.ones(w.scored_per_window), atol=1e-5)


def test_broken_base_files_are_refused(base_file, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        kld_base.open_base(str(tmp_path / "missing"))
    junk = tmp_path / "junk"
    junk.write_bytes(b"not a base file at all")
    with pytest.raises(ValueError, match="not a base log-probability file"):
        kld_base.open_base(str(junk))
    cut = tmp_path / "cut"
    cut.write_bytes(open(base_file, "rb").read()[:-100])
    with pytest.raises(ValueError, match="truncated"):
        kld_base.open_base(str(cut))
    raw = bytearray(open(base_file, "rb").read())
    at = raw.find(b'"complete":true')
    raw[at : at + 15] = b'"complete":0   '
    unfinished = tmp_path / "unfinished"
    unfinished.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="incomplete"):
        kld_base.open_base(str(unfinished))


# ---- through the engine -------------------------------------------------------------------------------
def test_a_model_against_itself_diverges_by_nothing(tiny_engine, base_file):
    s = kl_divergence(tiny_engine, base_file).summary
    assert abs(s.kld_mean.value) < 1e-6 and s.kld_max < 1e-5
    assert s.same_top.value == 1.0 and s.ppl_ratio.value == pytest.approx(1.0, abs=1e-4)
    assert s.n_tokens == 4 * (CTX - CTX // 2 - 1)
    assert s.dp_rms.value < 1e-5


def test_quantized_model_statistics_agree_with_perplexity(tiny_engine, tiny_int4, base_file, token_ids):
    result = kl_divergence(tiny_int4, base_file, score_chunk=16)
    s = result.summary
    assert s.ppl_model.value == pytest.approx(perplexity(tiny_int4, token_ids, CTX).ppl, rel=1e-4)
    assert s.ppl_base.value == pytest.approx(perplexity(tiny_engine, token_ids, CTX).ppl, rel=1e-3)
    assert 0.0 < s.kld_mean.value < 2.0 and s.same_top.value < 1.0
    assert s.kld_percentiles[50.0] <= s.kld_percentiles[99.0] <= s.kld_max
    assert len(result.window_lines) == 4 and result.window_lines[-1].strip().startswith("4")
    for llm in (tiny_engine, tiny_int4):
        counts = llm.llm_engine.check_invariants()
        assert counts["used"] == 0 and not llm.llm_engine.has_unfinished_requests()


def test_a_model_with_another_vocabulary_is_refused(base_file, tmp_path):
    from perfxlm import LLM

    other = LLM(make_llama_checkpoint(str(tmp_path / "v1200"), vocab_size=1200), skip_tokenizer_init=True,
                dtype="float32", num_kv_blocks=64, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="vocabulary of 1000 tokens and this model 1200"):
        kl_divergence(other, base_file)


def test_short_text_is_refused(tiny_engine, tmp_path):
    with pytest.raises(ValueError, match="too short"):
        save_base_logprobs(tiny_engine, list(range(3, 40)), str(tmp_path / "b"), CTX)


# ---- the command line, on the default model ---------------------------------------------------------------
TEXT = (
    "The history of the city begins with a small settlement on the river. Over the centuries it grew into a "
    "market town, then a centre of trade and learning, with a university, a cathedral and a busy port. "
    "Merchants brought goods from distant lands, and scholars came to study in its libraries. "
) * 8


def test_cli_end_to_end_on_the_default_model(tmp_path):
    model = default_model_or_skip()
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    base = tmp_path / "base.kld"
    out = tmp_path / "kld.json"
    other = tmp_path / "other.txt"
    other.write_text("A different text entirely. " * 80)
    common = ("-c", "128", "--max-num-batched-tokens", "256", "--threads", "2")
    # The three command lines in one process, in order (tests/cli_cases.py): each one's exit status and
    # output are its own; a process per line spent ~3 s of CPU each importing torch and the engine.
    made, reused, foreign = run_cli_cases(
        # a float32 base; bfloat16 models under test, as stored and dequantized
        ["eval", "kld", "--base", model, "--base-dtype", "float32", "--dtype", "bfloat16", "-q", "gguf,none",
         "-f", str(text), "--base-logits", str(base), "--output-json", str(out), *common],
        # the saved base is reused without --base; --json prints only JSON; the base's own setup diverges by 0
        ["eval", "kld", "--model", model, "--dtype", "float32", "--base-logits", str(base), "--json", "-f",
         str(text), *common],
        # another text than the base's is named as such
        ["eval", "kld", "--model", model, "--base-logits", str(base), "-f", str(other), *common],
        timeout=1800)  # fmt: skip
    r = made
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [d["label"] for d in data] == ["gguf", "none"]
    for d in data:
        s = d["statistics"]
        assert 0 < s["kld_mean"]["value"] < 0.05 and 0.8 < s["same_top"]["value"] <= 1.0, s
    assert "Mean    KLD:" in r.stdout and "Same top p:" in r.stdout
    assert (tmp_path / "kld.png").stat().st_size > 10_000  # several models: the plot beside the JSON
    r = reused
    assert r.returncode == 0, r.stderr[-3000:]
    again = json.loads(r.stdout)[0]["statistics"]
    assert abs(again["kld_mean"]["value"]) < 1e-5 and again["same_top"]["value"] == 1.0
    r = foreign
    assert r.returncode == 2 and "differs from the one the base file was made from" in r.stderr


def test_cli_bad_input(tmp_path):
    model = default_model_or_skip()
    no_base, no_file, missing, bad_kv, first = run_cli_cases(
        ["eval", "kld", "--model", model], ["eval", "kld", "--base", model],
        ["eval", "kld", "--base-logits", str(tmp_path / "missing.kld"), "--model", model],
        ["eval", "kld", "--base-logits", str(tmp_path / "x"), "--model", model, "--kv-cache-dtypes", "int3"],
        # the base file is checked before any model loads: a model that is not there is never reached
        ["eval", "kld", "--base-logits", str(tmp_path / "missing.kld"), "--model",
         str(tmp_path / "no-model")])
    assert no_base.returncode == 2 and "--base" in no_base.stderr
    assert no_file.returncode == 2 and "-f" in no_file.stderr
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    assert bad_kv.returncode == 2 and "int3" in bad_kv.stderr
    assert first.returncode == 2 and "missing.kld' does not exist" in first.stderr

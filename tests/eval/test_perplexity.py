"""`perfxlm eval perplexity`: llama.cpp's perplexity computed through the engine's forward path."""

from __future__ import annotations

import json
import math

import pytest
import torch

from perfxlm.eval import final_estimate, perplexity
from perfxlm.eval.stats import NllAccumulator, format_chunk_estimates, format_final
from perfxlm.eval.windows import make_windows
from tests.cli_cases import run_cli_cases
from tests.conftest import default_model_or_skip

CTX = 64


@pytest.fixture(scope="module")
def tiny_engine(tiny_llama):
    from perfxlm import LLM

    return LLM(tiny_llama, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=256,
               enable_prefix_caching=False)


@pytest.fixture(scope="module")
def token_ids() -> list[int]:
    g = torch.Generator().manual_seed(7)
    return torch.randint(3, 1000, (CTX * 5 + 17,), generator=g).tolist()  # 5 windows and a dropped tail


def reference_nlls(path: str, tokens: list[int], n_ctx: int, bos: int | None) -> list[list[float]]:
    """The same windows scored by transformers directly, float32."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    first, out = n_ctx // 2, []
    for w in range(len(tokens) // n_ctx):
        window = list(tokens[w * n_ctx : (w + 1) * n_ctx])
        if bos is not None:
            window[0] = bos
        with torch.no_grad():
            logits = model(torch.tensor([window])).logits[0].double()
        logp = logits.log_softmax(-1)
        out.append([-float(logp[j, window[j + 1]]) for j in range(first, n_ctx - 1)])
    return out


def ppl_of(nlls: list[list[float]]) -> float:
    flat = [v for w in nlls for v in w]
    return math.exp(sum(flat) / len(flat))


@pytest.mark.parametrize("add_bos", [False, True])
def test_matches_transformers_on_the_same_windows(tiny_engine, tiny_llama, token_ids, add_bos):
    result = perplexity(tiny_engine, token_ids, ctx_size=CTX, add_bos=add_bos)
    ref = reference_nlls(tiny_llama, token_ids, CTX, bos=1 if add_bos else None)
    assert result.n_chunks == 5 and result.n_tokens == 5 * (CTX - CTX // 2 - 1)
    assert result.add_bos is add_bos and result.text_tokens == len(token_ids)
    assert result.ppl == pytest.approx(ppl_of(ref), rel=1e-4)
    # the running estimate after each window, as llama.cpp prints it
    for i, estimate in enumerate(result.chunk_estimates, 1):
        assert estimate == pytest.approx(ppl_of(ref[:i]), rel=1e-4)
    flat = [v for w in ref for v in w]
    mean = sum(flat) / len(flat)
    var = sum(v * v for v in flat) / len(flat) - mean * mean
    assert result.stderr == pytest.approx(math.sqrt(var / (len(flat) - 1)) * math.exp(mean), rel=1e-3)
    assert_pool_whole(tiny_engine)


def assert_pool_whole(llm) -> None:
    counts = llm.llm_engine.check_invariants()
    assert not llm.llm_engine.has_unfinished_requests() and counts["used"] == 0, counts


def test_bos_replaces_the_first_token_of_every_window(token_ids):
    w = make_windows(token_ids, CTX, None, bos_token_id=1)
    assert all(w.window(i)[0] == 1 and w.window(i)[1:] == token_ids[i * CTX + 1 : (i + 1) * CTX]
               for i in range(w.n_windows))
    assert w.targets(0) == token_ids[CTX // 2 + 1 : CTX] and len(w.targets(0)) == w.scored_per_window
    assert make_windows(token_ids, CTX, None, None).window(2) == token_ids[2 * CTX : 3 * CTX]
    assert make_windows(token_ids, CTX, 2, None).n_windows == 2
    assert make_windows(token_ids, CTX, 99, None).n_windows == 5


def test_stderr_formula_by_hand():
    nlls = [0.5, 1.5, 2.0, 3.0, 1.0]
    n = len(nlls)
    mean = sum(nlls) / n  # 1.6
    var = sum(v * v for v in nlls) / n - mean**2  # 3.3 - 2.56 = 0.74
    expect_ppl = math.exp(1.6)
    expect_err = math.sqrt(0.74 / 4) * expect_ppl
    acc = NllAccumulator()
    acc.add(nlls[:2])
    assert acc.ppl() == pytest.approx(math.exp(1.0))
    acc.add(nlls[2:])
    assert mean == pytest.approx(1.6) and var == pytest.approx(0.74)
    assert acc.final() == pytest.approx((expect_ppl, expect_err))
    assert final_estimate(8.0, 16.5, 5) == pytest.approx((expect_ppl, expect_err))
    assert format_final(expect_ppl, expect_err) == f"Final estimate: PPL = {expect_ppl:.4f} +/- {expect_err:.5f}"
    assert format_chunk_estimates([12.34567, 3.0]) == "[1]12.3457,[2]3.0000,"
    assert math.isnan(final_estimate(2.0, 2.0, 2)[1])  # two NLLs of 1.0: no spread, llama.cpp prints none


def test_chunked_scoring_reads_context_from_the_cache_and_gives_the_same_ppl(tiny_engine, token_ids):
    whole = perplexity(tiny_engine, token_ids, ctx_size=CTX)
    chunked = perplexity(tiny_engine, token_ids, ctx_size=CTX, score_chunk=8, batch_size=2)
    assert chunked.score_chunk == 8 and chunked.n_tokens == whole.n_tokens
    assert chunked.ppl == pytest.approx(whole.ppl, rel=1e-5)
    assert chunked.chunk_estimates == pytest.approx(whole.chunk_estimates, rel=1e-5)
    # the engine's own step budget is restored afterwards
    assert tiny_engine.llm_engine.scheduler.max_num_batched_tokens == tiny_engine.llm_engine.config.max_num_batched_tokens
    assert_pool_whole(tiny_engine)


def test_prefill_is_chunked_when_score_chunk_is_set(tiny_engine, token_ids, monkeypatch):
    sizes = []
    runner = tiny_engine.llm_engine.core.runner
    real = runner.execute

    def spy(so):
        sizes.extend(len(s.token_ids) for s in so.scheduled)
        return real(so)

    monkeypatch.setattr(runner, "execute", spy)
    perplexity(tiny_engine, token_ids, ctx_size=CTX, n_chunks=1, score_chunk=16)
    assert sizes == [16] * (CTX // 16)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(ctx_size=1), "ctx_size"),
        (dict(ctx_size=2), "ctx_size"),
        (dict(ctx_size=4096), "max_model_len"),
        (dict(ctx_size=CTX, n_chunks=0), "chunks"),
        (dict(ctx_size=CTX, batch_size=0), "batch_size"),
        (dict(ctx_size=CTX, score_chunk=0), "score_chunk"),
    ],
)
def test_bad_arguments_are_named(tiny_engine, token_ids, kwargs, words):
    with pytest.raises(ValueError, match=words):
        perplexity(tiny_engine, token_ids, **kwargs)
    assert_pool_whole(tiny_engine)


def test_short_or_empty_input_is_refused(tiny_engine):
    with pytest.raises(ValueError, match=r"too short: it tokenizes to 10 tokens.*ctx_size 64"):
        perplexity(tiny_engine, list(range(3, 13)), ctx_size=CTX)
    with pytest.raises(ValueError, match="empty"):
        perplexity(tiny_engine, [], ctx_size=CTX)
    with pytest.raises(ValueError, match="tokenizer"):  # a text needs one; this engine has none
        perplexity(tiny_engine, "some text", ctx_size=CTX)


# ---- the command line, on the default model ---------------------------------------------------------
TEXT = (
    "The history of the city begins with a small settlement on the river. Over the centuries it grew into a "
    "market town, then a centre of trade and learning, with a university, a cathedral and a busy port. "
    "Merchants brought goods from distant lands, and scholars came to study in its libraries. "
) * 12


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    """This file's command lines in one fresh process (tests/cli_cases.py), each with its own exit status
    and output, as in a process of its own: the end-to-end run, then the refusals (a second process spent
    ~2.5 s of CPU starting Python and importing torch and the engine)."""
    model = default_model_or_skip()
    tmp = tmp_path_factory.mktemp("ppl_cli")
    text, empty, short = tmp / "text.txt", tmp / "empty.txt", tmp / "short.txt"
    text.write_text(TEXT)
    empty.write_text("  \n")
    short.write_text("A short text.")
    out_json = tmp / "ppl.json"
    cmd = ("eval", "perplexity", model, "-f")
    runs = run_cli_cases(
        [*cmd, str(text), "-c", "128", "--dtype", "float32", "--threads", "2",
         "--max-num-batched-tokens", "256", "--output-json", str(out_json)],
        [*cmd, str(empty)], [*cmd, str(tmp / "missing.txt")],
        [*cmd, str(short), "-c", "128", "--dtype", "float32"],
        [*cmd, str(short), "-c", "1", "--dtype", "float32"],
        [*cmd, str(short), "-c", "600", "--max-model-len", "512", "--dtype", "float32"],
        # a ctx_size no model takes is refused before the model loads: one that is not there is never reached
        ["eval", "perplexity", str(tmp / "no-model"), "-f", str(short), "-c", "1"], timeout=600)  # fmt: skip
    return runs, out_json


def test_cli_end_to_end_on_the_default_model(cli_runs):
    (r, *_), out_json = cli_runs
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    for key in ("model:", "dtype: float32", "compute_dtype: float32", "cpu_plan: isa="):
        assert any(line.startswith(key) for line in lines), (key, r.stdout)
    data = json.loads(out_json.read_text())
    res = data["result"]
    n = res["n_chunks"]
    assert n >= 3 and res["n_tokens"] == n * (128 - 64 - 1) and not res["add_bos"]  # SmolLM2 adds no BOS
    assert format_chunk_estimates(res["chunk_estimates"]) in r.stdout
    assert lines[-1] == f"Final estimate: PPL = {res['ppl']:.4f} +/- {res['stderr']:.5f}"
    assert 1.0 < res["ppl"] < 20.0  # a repeated English paragraph is easy to predict
    assert data["config"]["dtype"] == "float32" and "layout=" in data["config"]["cpu_plan"]


def test_cli_reports_bad_input(cli_runs):
    (_, empty_r, missing, too_short, tiny_ctx, over_len, first), _ = cli_runs
    assert empty_r.returncode == 2 and "empty" in empty_r.stderr
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    assert too_short.returncode == 2 and "too short" in too_short.stderr
    assert "ctx_size 128" in too_short.stderr
    assert tiny_ctx.returncode == 2 and "ctx_size" in tiny_ctx.stderr
    assert over_len.returncode == 2 and "max_model_len" in over_len.stderr
    assert first.returncode == 2 and "ctx_size must be an integer" in first.stderr

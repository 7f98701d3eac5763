"""bench latency / sweep / throughput end to end on a tiny random-weight Llama (no tokenizer)."""

from __future__ import annotations

import csv
import json
import math

import pytest

from perfxlm.bench.latency import markdown_table, measure_batch, parse_batch_sizes, run_latency
from perfxlm.entrypoints.cli import main
from tests.conftest import make_llama_checkpoint


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama):
    from perfxlm import LLM

    return LLM(tiny_llama, skip_tokenizer_init=True, enable_prefix_caching=False, num_kv_blocks=64,
               max_num_batched_tokens=256)


def test_measure_batch_splits_prefill_and_decode(tiny_llm):
    from perfxlm import SamplingParams

    prompts = [{"prompt_token_ids": [5 + i] * 20} for i in range(3)]
    r = measure_batch(tiny_llm.llm_engine, prompts, SamplingParams(max_tokens=6, ignore_eos=True), tag="t")
    assert r["prefill_steps"] == 1  # 3 x 20 prompt tokens fit one step
    assert r["decode_steps"] == 5  # then one step per further token
    assert r["generated_tokens"] == 18
    assert 0 < r["prefill_s"] < r["latency_s"]
    assert r["latency_s"] == pytest.approx(r["prefill_s"] + 5 * r["decode_step_s"])
    assert r["throughput_tok_s"] == pytest.approx(18 / r["latency_s"])
    assert r["decode_tok_s"] == pytest.approx(3 / r["decode_step_s"])
    assert not tiny_llm.llm_engine.has_unfinished_requests()


def test_chunked_prefill_counts_until_every_first_token(tiny_llm):
    from perfxlm import SamplingParams

    prompts = [{"prompt_token_ids": [7] * 200} for _ in range(3)]  # 600 tokens > 256 per step
    r = measure_batch(tiny_llm.llm_engine, prompts, SamplingParams(max_tokens=4, ignore_eos=True), tag="c")
    assert r["prefill_steps"] >= 3
    assert r["generated_tokens"] == 12


def test_run_latency(tiny_llm):
    lines = []
    r = run_latency(tiny_llm, batch_size=2, input_len=8, output_len=4, num_iters=2, num_iters_warmup=1, log=lines.append)
    assert len(lines) == 3 and lines[0].startswith("warm-up")
    assert r["num_iters"] == 2 and len(r["latencies"]) == 2 and len(r["iterations"]) == 2
    assert r["avg_latency"] == pytest.approx(sum(r["latencies"]) / 2)
    assert set(r["percentiles"]) == {"10", "25", "50", "75", "90", "99"}
    for key in ("mean_prefill_ms", "median_prefill_ms", "p99_prefill_ms", "mean_decode_step_ms",
                "median_throughput_tok_s", "p90_e2e_latency_s", "peak_memory_gib"):
        assert r[key] > 0, key
    assert all(it["generated_tokens"] == 8 for it in r["iterations"])
    with pytest.raises(ValueError):
        run_latency(tiny_llm, 1, 1020, 10)  # over max_model_len (1024)


def test_cli_latency(tiny_llama, tmp_path, capsys):
    out = tmp_path / "latency.json"
    assert main(["bench", "latency", tiny_llama, "--batch-size", "2", "--input-len", "8", "--output-len", "4",
                 "--num-iters", "2", "--num-iters-warmup", "0", "--threads", "1", "--dtype", "float32",
                 "--output-json", str(out)]) == 0
    text = capsys.readouterr().out
    for label in ("engine_version", "cpu_model", "torch_threads", "dtype", "prefill (ms)", "decode step (ms)",
                  "generated tokens/s", "peak resident memory (GiB)", "Avg latency"):
        assert label in text, label
    data = json.loads(out.read_text())
    cfg = data["config"]
    assert cfg["engine"] == "perfxlm" and cfg["model"] == tiny_llama and cfg["dtype"] == "float32"
    assert cfg["torch_threads"] == 1 and cfg["batch_size"] == 2 and cfg["enable_prefix_caching"] is False
    assert cfg["num_kv_blocks"] == 2 * (1 + 1)  # the pool is sized for the batch: 12 tokens = 1 block each, + 1
    assert data["batch_size"] == 2 and data["median_prefill_ms"] > 0 and data["avg_latency"] > 0


def test_cli_sweep_in_process(tiny_llama, tmp_path, capsys):
    out = tmp_path / "sweep.json"
    assert main(["bench", "sweep", tiny_llama, "--batch-sizes", "1,3", "--input-len", "8", "--output-len", "4",
                 "--num-iters", "1", "--num-iters-warmup", "0", "--no-isolate", "--dtype", "float32",
                 "--output-json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| model | size | dtype | batch | input len | output len | prefill (ms) | decode (ms) | " \
           "throughput (tok/s) | memory (GiB) |" in text
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [r["batch_size"] for r in rows] == [1, 3]
    assert all(r["input_len"] == 8 and r["output_len"] == 4 and r["dtype"] == "float32" for r in rows)
    assert all(r["prefill_ms"] > 0 and r["decode_ms"] > 0 and r["throughput_tok_s"] > 0 for r in rows)
    assert data["config"]["model_size"] == rows[0]["model_size"] != "?"
    with open(tmp_path / "sweep.csv") as f:
        assert [int(r["batch_size"]) for r in csv.DictReader(f)] == [1, 3]
    with open(tmp_path / "sweep.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_markdown_table_and_batch_sizes():
    row = dict(model="m", model_size="1M", dtype="bfloat16", batch_size=4, input_len=128, output_len=128,
               prefill_ms=12.345, decode_ms=math.nan, throughput_tok_s=99.94, memory_gib=1.234)
    table = markdown_table([row]).splitlines()
    assert len(table) == 3 and table[2] == "| m | 1M | bfloat16 | 4 | 128 | 128 | 12.3 | - | 99.9 | 1.23 |"
    assert parse_batch_sizes("1,2, 4,64") == [1, 2, 4, 64]
    for bad in ("", "a,b", "0,1"):
        with pytest.raises(ValueError):
            parse_batch_sizes(bad)


def test_cli_throughput_random(tiny_llama, tmp_path, capsys):
    out = tmp_path / "throughput.json"
    assert main(["bench", "throughput", tiny_llama, "--dataset", "random", "--num-prompts", "6",
                 "--input-len", "10", "--output-len", "5", "--disable-tqdm", "--output-json", str(out)]) == 0
    assert "Throughput:" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["num_requests"] == 6
    assert data["total_input_tokens"] == 60 and data["total_output_tokens"] == 30 and data["total_num_tokens"] == 90
    assert data["requests_per_second"] == pytest.approx(6 / data["elapsed_time"])
    assert data["tokens_per_second"] == pytest.approx(90 / data["elapsed_time"])
    assert data["output_throughput"] == pytest.approx(30 / data["elapsed_time"])
    assert data["config"]["dataset"] == "random" and data["config"]["num_prompts"] == 6


def test_cli_throughput_sharegpt(sharegpt_samples, smol_tokenizer, smol_tokenizer_dir, tmp_path, capsys):
    """ShareGPT prompts through the engine: a tiny model with the default tokenizer's vocabulary."""
    model = make_llama_checkpoint(str(tmp_path / "tiny_smolvocab"), vocab_size=49152, hidden_size=32,
                                  intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                  num_key_value_heads=1, max_position_embeddings=2048)
    out = tmp_path / "throughput.json"
    assert main(["bench", "throughput", model, "--tokenizer", smol_tokenizer_dir, "--dataset", "sharegpt",
                 sharegpt_samples, "--num-prompts", "4", "--output-len", "3", "--disable-tqdm",
                 "--output-json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["num_requests"] == 4 and data["total_output_tokens"] == 12
    assert data["config"]["dataset"] == "sharegpt" and data["config"]["dataset_path"] == sharegpt_samples
    from perfxlm.bench.datasets import sample_sharegpt

    expected = sample_sharegpt(sharegpt_samples, 4, smol_tokenizer, seed=0, fixed_output_len=3)
    assert data["total_input_tokens"] == sum(r.prompt_len for r in expected)


def test_cli_errors(tiny_llama, capsys):
    assert main(["bench", "latency", tiny_llama, "--batch-size", "0"]) == 2
    assert "error:" in capsys.readouterr().err
    assert main(["bench", "throughput", tiny_llama, "--dataset", "sharegpt", "missing.json"]) == 2


def test_model_summary_counts_parameters(tiny_llm):
    from transformers import LlamaConfig, LlamaForCausalLM

    from perfxlm.bench.env import estimate_llama_params, model_summary

    hf = tiny_llm.llm_engine.config.hf_config
    reference = sum(p.numel() for p in LlamaForCausalLM(LlamaConfig(**hf.to_dict())).parameters())
    assert model_summary(tiny_llm)["num_params"] == reference
    assert estimate_llama_params(hf) == reference

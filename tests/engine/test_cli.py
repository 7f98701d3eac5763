"""The command line: generate and the interactive chat, as a user runs them."""

import subprocess
import sys

from tests.cli_cases import run_cli_cases
from tests.conftest import default_model_or_skip


def run_cli(*args, stdin=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "perfxlm.entrypoints.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout, env={"TQDM_DISABLE": "1", **__import__("os").environ})


def test_generate_prints_a_completion():
    default_model_or_skip()
    r = run_cli("generate", "The capital of France is", "--max-tokens", "8", "--dtype", "float32")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Paris" in r.stdout


def test_generate_reports_bad_input_clearly(tmp_path):
    default_model_or_skip()
    # the second is refused before any model loads: a model that is not there is never reached
    for r in run_cli_cases(["generate", "hi", "--max-tokens", "0"],
                           ["generate", "hi", "--max-tokens", "0", "--model", str(tmp_path / "no-model")]):
        assert r.returncode == 2 and "max_tokens" in r.stderr


def test_interactive_chat_streams_replies():
    default_model_or_skip()
    r = run_cli("chat", "--dtype", "float32", "--temperature", "0", "--max-tokens", "20",
                stdin="What is the capital of France?\n\n")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Paris" in r.stdout


def test_chat_api_with_several_conversations(smollm_fp32):
    from perfxlm import SamplingParams

    convs = [[{"role": "user", "content": "What is the capital of France?"}],
             [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Color of the sky?"}]]
    outs = smollm_fp32.chat(convs, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert len(outs) == 2 and "Paris" in outs[0].outputs[0].text
    custom = "{% for m in messages %}{{ m['content'] }}{% endfor %} Answer:"
    out = smollm_fp32.chat(convs[0], SamplingParams(temperature=0, max_tokens=4), chat_template=custom,
                           use_tqdm=False)[0]
    assert out.prompt == "What is the capital of France? Answer:"

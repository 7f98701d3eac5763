"""The command line: generate and the interactive chat, as a user runs them."""

import pytest

from tests.cli_cases import run_cli_cases
from tests.conftest import default_model_or_skip

# The command lines of this file's tests in one fresh process (tests/cli_cases.py): each one's exit status
# and output are its own, as in a process of its own; a process each spent ~2.5 s of CPU more apiece
# starting Python and importing torch and the engine. The second refusal is refused before any model
# loads: a model that is not there is never reached.
_GENERATE, _CHAT, _BAD, _BAD_NO_MODEL = range(4)


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    default_model_or_skip()
    missing = str(tmp_path_factory.mktemp("cli") / "no-model")
    return run_cli_cases(
        ["generate", "The capital of France is", "--max-tokens", "8", "--dtype", "float32"],
        ["chat", "--dtype", "float32", "--temperature", "0", "--max-tokens", "20"],
        ["generate", "hi", "--max-tokens", "0"],
        ["generate", "hi", "--max-tokens", "0", "--model", missing],
        stdin={_CHAT: "What is the capital of France?\n\n"}, timeout=600)  # fmt: skip


def test_generate_prints_a_completion(cli_runs):
    r = cli_runs[_GENERATE]
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Paris" in r.stdout


def test_generate_reports_bad_input_clearly(cli_runs):
    for r in (cli_runs[_BAD], cli_runs[_BAD_NO_MODEL]):
        assert r.returncode == 2 and "max_tokens" in r.stderr


def test_interactive_chat_streams_replies(cli_runs):
    r = cli_runs[_CHAT]
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

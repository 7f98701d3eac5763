"""vLLM's stop-string and streaming semantics at the edges: the last token, min_tokens, n > 1 deltas."""

from perfxlm import SamplingParams
from perfxlm.engine.messages import EngineCoreOutput
from perfxlm.engine.output_processor import OutputProcessor
from perfxlm.sampling_params import RequestOutputKind

PROMPT = "The capital of France is"


def _greedy(llm, max_tokens, **kw):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)
    return llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]


def test_stop_string_completed_by_the_length_capped_token_is_cut(smollm_fp32):
    full = _greedy(smollm_fp32, 8)
    tok = smollm_fp32.get_tokenizer()
    last_piece = tok.decode(full.token_ids[-1:])
    # A stop string that only the last token completes: its last char comes from that token.
    stop = full.text[-(len(last_piece) + 2):].strip() or full.text[-3:]
    assert full.text.endswith(stop) and stop not in tok.decode(full.token_ids[:-1])
    out = _greedy(smollm_fp32, 8, stop=[stop])
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert stop not in out.text and full.text.startswith(out.text)


def test_stop_strings_wait_for_min_tokens(smollm_fp32):
    full = _greedy(smollm_fp32, 16)
    tok = smollm_fp32.get_tokenizer()
    early = tok.decode(full.token_ids[:3]).strip().split()[-1]  # a word the first 3 tokens complete
    assert _greedy(smollm_fp32, 16, stop=[early]).token_ids != full.token_ids  # it does stop without min_tokens
    out = _greedy(smollm_fp32, 16, stop=[early], min_tokens=10)
    assert len(out.token_ids) >= 10  # the early match is ignored


class _Pr:
    """The parts of a ProcessedRequest the output processor reads."""

    def __init__(self, rid, n):
        params = SamplingParams(n=n, max_tokens=4, output_kind=RequestOutputKind.DELTA, detokenize=False)
        self.child_ids = [f"{rid}.{i}" for i in range(n)]
        self.child_params = [params.clone() for _ in range(n)]
        self.prompt, self.params = None, params
        self.request = type("R", (), {"prompt_token_ids": [1, 2, 3], "lora": None})()


def test_delta_stream_sends_a_siblings_final_chunk_once():
    op = OutputProcessor(tokenizer=None)
    op.add_request("r", _Pr("r", 2), 0.0)
    chunks = []
    for outs in ([EngineCoreOutput("r.0", [5], "length"), EngineCoreOutput("r.1", [6])],
                 [EngineCoreOutput("r.1", [7])],
                 [EngineCoreOutput("r.1", [8], "length")]):
        results, _ = op.process(outs)
        chunks += [(c.index, c.token_ids, c.finish_reason) for r in results for c in r.outputs]
    finals = [c for c in chunks if c[2] is not None]
    assert finals == [(0, [5], "length"), (1, [8], "length")]
    assert not op.states

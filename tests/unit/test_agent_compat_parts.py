"""Tool-call and reasoning parsers, generation-config defaults, vLLM argument handling."""

from __future__ import annotations

import json

import pytest
import torch

from perfxlm.entrypoints.openai.reasoning_parsers import get_reasoning_parser
from perfxlm.entrypoints.openai.tool_parsers import get_tool_parser, parse_required, required_schema


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes():
    p = get_tool_parser("hermes")
    text = ('Let me check. <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
            '<tool_call>{"name": "g", "arguments": "{\\"b\\": 2}"}</tool_call>')
    content, calls = p.parse(text)
    assert content == "Let me check." and _calls(calls) == [("f", {"a": 1}), ("g", {"b": 2})]
    assert p.parse("no call here") == ("no call here", [])
    assert p.parse("<tool_call>{broken</tool_call>")[1] == []  # unparsable: left as content
    # streaming holds back from the marker, or a prefix of it, on
    assert p.stream_split("hello <tool") == len("hello ")
    assert p.stream_split("hello <tool_call>{") == len("hello ")
    assert p.stream_split("a < b") == len("a < b")


def test_llama3_json_and_mistral():
    p = get_tool_parser("llama3_json")
    content, calls = p.parse('<|python_tag|>{"name": "f", "parameters": {"x": 2}}; {"name": "g", "parameters": {}}')
    assert content is None and _calls(calls) == [("f", {"x": 2}), ("g", {})]
    assert p.parse("Hello {not a call}")[1] == []
    assert p.stream_split('{"na') == 0 and p.stream_split("Hello") == 5
    m = get_tool_parser("mistral")
    content, calls = m.parse('Sure[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]')
    assert content == "Sure" and _calls(calls) == [("f", {"x": 1}), ("g", {})]
    assert _calls(m.parse('[TOOL_CALLS]f[ARGS]{"x": 1}')[1]) == [("f", {"x": 1})]
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("nope")


def test_required_schema_round_trip():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "g"}}]
    schema = required_schema(tools, parallel=False)
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    assert _calls(parse_required('[{"name": "f", "parameters": {"k": 1}}]')) == [("f", {"k": 1})]


def test_reasoning_parsers():
    q = get_reasoning_parser("qwen3")
    assert q.split("<think>\nplan\n</think>\n\nanswer") == ("\nplan\n", "answer")
    assert q.split("just an answer") == (None, "just an answer")  # thinking switched off
    assert q.split("<think>pla", final=False) == ("pla", "")
    assert q.split("<thi", final=False) == (None, "")  # maybe the tag: held back
    assert q.split("<think>plan</th", final=False) == ("plan", "")
    assert q.split("plan, still", opened=True) == ("plan, still", "")  # the template opened <think>
    assert q.split("plan</think>answer", opened=True) == ("plan", "answer")
    d = get_reasoning_parser("deepseek_r1")
    assert d.split("plan</think>answer") == ("plan", "answer")
    assert d.split("cut short") == ("cut short", "")


def test_generation_config_defaults(tmp_path, tiny_llama):
    from perfxlm import LLM
    from perfxlm.generation_defaults import load_generation_defaults

    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1, "do_sample": True, "eos_token_id": 2}))
    assert load_generation_defaults(str(tmp_path)) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20,
                                                       "repetition_penalty": 1.1}
    assert load_generation_defaults(str(tmp_path), "vllm") == {}
    assert load_generation_defaults("/nowhere/model.gguf", str(tmp_path))["top_k"] == 20
    with pytest.raises(ValueError, match="generation_config"):
        load_generation_defaults(str(tmp_path), "bogus")
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_k": 20}))
    llm = LLM(str(model), dtype="float32", num_kv_blocks=16, skip_tokenizer_init=True)
    p = llm.get_default_sampling_params()
    assert (p.temperature, p.top_k, p.top_p) == (0.6, 20, 1.0)
    p = LLM(str(model), dtype="float32", num_kv_blocks=16, skip_tokenizer_init=True,
            generation_config="vllm").get_default_sampling_params()
    assert (p.temperature, p.top_k) == (1.0, -1)


def test_server_request_defaults():
    from perfxlm.entrypoints.openai.protocol import ChatCompletionRequest
    from perfxlm.entrypoints.openai.serving_base import to_sampling_params

    defaults = {"temperature": 0.6, "top_k": 20, "repetition_penalty": 1.1}
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], temperature=0.2)
    p = to_sampling_params(req, 8, None, defaults=defaults)
    assert (p.temperature, p.top_k, p.repetition_penalty) == (0.2, 20, 1.1)  # the request wins where it speaks


def test_vllm_arguments(monkeypatch):
    from perfxlm.compat import split_vllm_kwargs
    from perfxlm.entrypoints.openai.api_server import parse_allowed_origins

    rest, settings = split_vllm_kwargs({"gpu_memory_utilization": 0.9, "enforce_eager": True, "max_model_len": 64,
                                        "kv_cache_memory_bytes": 1 << 29, "trust_remote_code": True})
    assert rest == {"max_model_len": 64} and settings == {"kv_cache_gib": 0.5, "gpu_memory_utilization": 0.9}
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    assert split_vllm_kwargs({})[1] == {"kv_cache_gib": 2.0}
    assert split_vllm_kwargs({"kv_cache_gib": 1.0})[1] == {}
    assert split_vllm_kwargs({"revision": "abc", "download_dir": "/x"})[0] == {"revision": "abc",
                                                                               "download_dir": "/x"}  # engine fields
    assert split_vllm_kwargs({"device": "cpu", "max_model_len": 8})[0] == {"device": "cpu", "max_model_len": 8}
    rest, settings = split_vllm_kwargs({"gpu_memory_utilization": None})  # the CLI's absent flag
    assert rest == {} and "gpu_memory_utilization" not in settings
    bad_cases = [({"tokenizer_mode": "mistral"}, "fast tokenizer"), ({"tokenizer_revision": "v2"}, "revision"),
                 ({"device": "tpu"}, "one of auto, cpu, cuda"), ({"gpu_memory_utilization": 1.5}, r"in \(0, 1\]")]
    if not torch.cuda.is_available():
        bad_cases.append(({"device": "cuda"}, "torch sees no CUDA device"))
    for bad, words in bad_cases:
        with pytest.raises(ValueError, match=words):
            split_vllm_kwargs(bad)
    assert parse_allowed_origins(['["*"]']) == ["*"]
    assert parse_allowed_origins(["http://a", "http://b"]) == ["http://a", "http://b"]


def test_llm_call_arguments(smollm_fp32):
    from perfxlm import SamplingParams

    with pytest.raises(ValueError, match="LoRA"):
        smollm_fp32.generate("x", lora_request=object())
    with pytest.raises(ValueError, match="first come"):
        smollm_fp32.generate("x", priority=[1])
    with pytest.raises(TypeError, match="not support: bogus"):
        smollm_fp32.chat([{"role": "user", "content": "x"}], bogus=1)
    msgs = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hello! My name"}]
    out = smollm_fp32.chat(msgs, SamplingParams(temperature=0, max_tokens=2), continue_final_message=True,
                           chat_template_kwargs={"unused_flag": True}, use_tqdm=False)[0]
    assert out.prompt.endswith("Hello! My name")  # no new assistant turn opened
    assert SamplingParams(seed=-1).seed is None


def test_model_ids_through_the_hf_cache(tmp_path, tiny_llama, monkeypatch):
    import shutil

    from perfxlm import LLM, AsyncEngineArgs, AsyncLLM, EngineArgs, TextPrompt, TokensPrompt  # noqa: F401
    from perfxlm.entrypoints.openai.api_server import served_name
    from perfxlm.hub import resolve_model

    SHA = "0123456789abcdef0123456789abcdef01234567"
    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny"
    shutil.copytree(tiny_llama, repo / "snapshots" / SHA)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SHA)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snap = str(repo / "snapshots" / SHA)
    assert resolve_model("acme/tiny") == snap
    assert resolve_model("acme/tiny", revision=SHA) == snap
    (repo / "snapshots" / SHA / "tiny.Q8_0.gguf").write_bytes(b"GGUF")
    assert resolve_model("acme/tiny/tiny.Q8_0.gguf") == f"{snap}/tiny.Q8_0.gguf"  # one file of a GGUF repository
    with pytest.raises(ValueError, match=f"not in the Hugging Face cache at {cache}.*HF_HUB_OFFLINE"):
        resolve_model("acme/missing")
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model("/no/such/folder")
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # HF_HOME/hub
    assert resolve_model("acme/tiny") == snap
    assert resolve_model("acme/tiny", download_dir=str(cache)) == snap
    llm = LLM.from_engine_args(EngineArgs(model="acme/tiny", skip_tokenizer_init=True, num_kv_blocks=16,
                                          dtype="float32", gpu_memory_utilization=0.5))
    assert llm.llm_engine.config.model == snap
    prompt: TokensPrompt = {"prompt_token_ids": [1, 5, 9]}
    from perfxlm import SamplingParams

    assert len(llm.generate(prompt, SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
               .outputs[0].token_ids) == 3
    assert served_name("acme/tiny", None) == "acme/tiny"
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model="acme/tiny", skip_tokenizer_init=True, num_kv_blocks=16,
                                                       dtype="float32", swap_space=4))
    try:
        assert engine.engine.config.model == snap
    finally:
        engine.shutdown()


def test_stream_pieces_add_up_wherever_the_output_is_cut():
    from perfxlm.entrypoints.openai.serving_base import ServerContext
    from perfxlm.entrypoints.openai.serving_chat import _ChoiceParser

    ctx = ServerContext(None, "m", 1, None, tool_parser=get_tool_parser("hermes"),
                        reasoning_parser=get_reasoning_parser("qwen3"))
    full = '<think>\nhm\n</think>\n\nSure, <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    for cuts in [(), (5,), (30,), (len(full) - 1,), tuple(range(1, len(full)))]:
        parser = _ChoiceParser(ctx, "auto", None, True)
        reasoning = content = ""
        last = 0
        for cut in cuts:
            r, c = parser.stream(full[last:cut])
            reasoning, content, last = reasoning + r, content + c, cut
        r, c, calls = parser.stream_end(full[last:], "stop")
        assert (reasoning + r, content + c) == ("\nhm\n", "Sure, "), cuts
        assert _calls(calls) == [("f", {"a": 1})]

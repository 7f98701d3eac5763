"""`perfxlm` command line: generate, serve, chat, bench, eval, export (more subcommands join as they are built)."""

from __future__ import annotations

import argparse
import sys


def add_engine_args(parser: argparse.ArgumentParser, positional_model: bool = True) -> None:
    model_help = ("Hugging Face model folder, .gguf file or model id (org/name, through the Hugging Face cache; "
                  "default: the embedded SmolLM2-135M-Instruct)")
    if positional_model:
        parser.add_argument("model", nargs="?", default=None, help=model_help)
        parser.add_argument("--model", dest="model_opt", default=None, help="same as the positional MODEL")
    else:
        parser.add_argument("--model", dest="model_opt", default=None, help=model_help)
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder, if not the model's")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="weights and activations dtype; auto = bfloat16 where the CPU has native bf16 (on "
                             "CUDA: the checkpoint's dtype, float32 checkpoints as bfloat16); float16: CUDA only")
    parser.add_argument("--device", default="auto",
                        help="auto | cpu | cuda | cuda:N (vLLM's flag; auto = CUDA where torch sees a GPU)")
    parser.add_argument("--load-format", default="auto",
                        choices=["auto", "safetensors", "gguf", "dummy", "onnx"],
                        help="dummy = random weights of the right shapes (benchmarks); onnx = a folder "
                             "`perfxlm export onnx` wrote, run by ONNX Runtime (auto detects it)")
    parser.add_argument("--max-model-len", type=int, default=None, help="context length (prompt + output)")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="most requests in one batch")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="most tokens in one step")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    parser.add_argument("--kv-cache-gib", type=float, default=None, help="KV cache size in GiB")
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="exact number of KV cache blocks")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2"],
                        help="KV cache storage: auto = the model's dtype; int8 / fp8 with group scales; "
                             "fp8 = fp8_e4m3")
    parser.add_argument("--kv-cache-group-size", type=int, default=None,
                        help="int8 / fp8 KV cache: values per scale (default: the head size)")
    parser.add_argument("--quantization", "-q", default=None,
                        help="weights stored quantized: int8 | int4 | nf4 | w8a8 quantize a float checkpoint at "
                             "load; gguf keeps a GGUF file's quantized tensors (the default for .gguf), none "
                             "dequantizes them; awq | gptq | compressed-tensors name a pre-quantized checkpoint's "
                             "own format (kept packed, as by default); or JSON {\"method\", \"group_size\", "
                             "\"symmetric\"}")
    parser.add_argument("--quantization-group-size", type=int, default=None,
                        help="weights per scale (-1: one per output channel; default: 64 for int8 (per channel "
                             "where 64 does not divide an input size) and nf4, per channel for w8a8, 32 for int4)")
    parser.add_argument("--quantization-symmetric", action=argparse.BooleanOptionalAction, default=None,
                        help="symmetric codes (the default) or, with --no-quantization-symmetric, a zero point "
                             "per group (int8, int4)")
    parser.add_argument("--quant-activations", default="auto", choices=["auto", "int8", "float32"],
                        help="what products with quantized weights do to the activations: auto = int8 blocks "
                             "of 32 for GGUF tensors and int4 of a bfloat16 model (llama.cpp's scheme), float32 "
                             "for int8 and nf4, int8 for w8a8; int8 = int8 blocks for every format; float32 = "
                             "weight-only (not with w8a8)")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse the KV cache of shared prompt prefixes")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.add_argument("--max-logprobs", type=int, default=20,
                        help="most logprobs / prompt_logprobs a request may ask for (-1: no limit)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="worker processes holding 1/N of the model each, one per NUMA node "
                             "(cores: PERFXLM_CPU_OMP_THREADS_BIND, e.g. '0-31|32-63')")
    parser.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                        help="whole engine replicas, one process each on its own NUMA node or cores, each "
                             "request sent to the replica with the fewest in flight")
    parser.add_argument("--revision", default=None,
                        help="commit, branch or tag of a Hugging Face model id (MODEL as org/name)")
    parser.add_argument("--download-dir", default=None,
                        help="Hugging Face cache to read model ids from and download into "
                             "(default: HF_HUB_CACHE, else HF_HOME/hub)")
    parser.add_argument("--speculative-config", default=None,
                        help="speculative decoding, vLLM's JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": 5, "
                             "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2} (prompt lookup) or {\"model\": "
                             "DRAFT, \"num_speculative_tokens\": 4} (a draft model of the same vocabulary)")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                        help="KV cache size in bytes (vLLM's name; VLLM_CPU_KVCACHE_SPACE=GiB works too)")
    parser.add_argument("--runner", default="auto", choices=["auto", "generate", "pooling"],
                        help="generate (text) or pooling (embeddings, scores, classes); auto = pooling for an "
                             "encoder (BERT, XLM-RoBERTa), else generate")
    parser.add_argument("--convert", default="auto", choices=["auto", "none", "embed", "classify", "reward"],
                        help="what a pooling model is used as (embed: a causal LM as a last-token embedder)")
    parser.add_argument("--task", default=None,
                        help="vLLM's older spelling: generate | embed | classify | score | reward")
    parser.add_argument("--pooler-config", default=None,
                        help='how a pooling model pools, as JSON: {"pooling_type": "CLS|MEAN|LAST|ALL", '
                             '"normalize": true}')
    parser.add_argument("--hf-overrides", default=None,
                        help="config.json attributes laid over the checkpoint's, as JSON (vLLM's), e.g. "
                             '\'{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": '
                             '["no", "yes"], "is_original_qwen3_reranker": true}\' for Qwen3-Reranker')
    parser.add_argument("--generation-config", default="auto",
                        help="sampling defaults: auto = the model's generation_config.json, vllm = none, "
                             "or a folder holding a generation_config.json")
    parser.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters over the model")
    parser.add_argument("--max-loras", type=int, default=1, help="distinct LoRA adapters in one step")
    parser.add_argument("--max-lora-rank", type=int, default=16, help="largest LoRA rank accepted")
    parser.add_argument("--max-cpu-loras", type=int, default=None,
                        help="LoRA adapters kept loaded (default: --max-loras)")
    parser.add_argument("--lora-dtype", default="auto", choices=["auto", "float32", "bfloat16", "int8"],
                        help="what LoRA A and B are stored in (auto: float32 beside float32 weights, "
                        "bfloat16 beside bf16 ones, int8 beside quantized ones; int8: codes and scales)")
    # vLLM's GPU-only flags: accepted so launch lines run unchanged, with a notice of their effect here
    for flag, kind in (("--gpu-memory-utilization", float), ("--swap-space", float), ("--cpu-offload-gb", float)):
        parser.add_argument(flag, type=kind, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--enforce-eager", action="store_true", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--trust-remote-code", action="store_true", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--disable-log-stats", action="store_true", default=None, help=argparse.SUPPRESS)


_GPU_FLAG_NOTICES = {
    "swap_space": "--swap-space has no effect: preempted requests are recomputed, never swapped",
    "cpu_offload_gb": "--cpu-offload-gb has no effect: the weights already live in CPU memory",
    "enforce_eager": "--enforce-eager has no effect: perfxlm always runs eagerly on CPU",
    "trust_remote_code": "--trust-remote-code has no effect: perfxlm runs its own model code, never a model's",
    "disable_log_stats": "--disable-log-stats: perfxlm logs no periodic stats",
}


def _kv_cache_gib(args: argparse.Namespace) -> float | None:
    """--kv-cache-gib, else --kv-cache-memory-bytes, else VLLM_CPU_KVCACHE_SPACE (GiB, vLLM's CPU setting)."""
    import os

    if args.kv_cache_gib is not None:
        return args.kv_cache_gib
    if getattr(args, "kv_cache_memory_bytes", None) is not None:
        return args.kv_cache_memory_bytes / 2**30
    space = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    if space:
        try:
            gib = float(space)
        except ValueError:
            raise SystemExit(f"VLLM_CPU_KVCACHE_SPACE must be a number of GiB, got {space!r}.") from None
        return gib if gib > 0 else None  # vLLM: 0 means the default size
    return None


def _pooling_kwargs(args: argparse.Namespace) -> dict:
    """--runner / --convert, or vLLM's --task standing for them; --pooler-config and --hf-overrides as JSON."""
    import json

    from perfxlm.pooling.runner_kind import task_settings

    kwargs = {"runner": getattr(args, "runner", "auto"), "convert": getattr(args, "convert", "auto")}
    try:
        if getattr(args, "task", None):
            kwargs.update(task_settings(args.task))
        if getattr(args, "pooler_config", None):
            kwargs["pooler_config"] = json.loads(args.pooler_config)
        if getattr(args, "hf_overrides", None):
            from perfxlm.model.hf_overrides import parse_hf_overrides

            kwargs["hf_overrides"] = parse_hf_overrides(args.hf_overrides)
    except (ValueError, json.JSONDecodeError) as exc:
        raise SystemExit(f"perfxlm: {exc}") from None
    return kwargs


def engine_kwargs(args: argparse.Namespace) -> dict:
    from perfxlm.compat import check_device

    try:
        device = check_device(getattr(args, "device", "auto"))
    except ValueError as exc:
        raise SystemExit(f"perfxlm: {exc}") from None
    gpu_share = getattr(args, "gpu_memory_utilization", None)
    if gpu_share is not None and device == "cpu":
        print("perfxlm: --gpu-memory-utilization has no effect on CPU: size the KV cache with --kv-cache-gib, "
              "--kv-cache-memory-bytes or VLLM_CPU_KVCACHE_SPACE.", file=sys.stderr)
    for name, notice in _GPU_FLAG_NOTICES.items():
        if getattr(args, name, None) is not None and not (name == "enforce_eager" and device != "cpu"):
            print(f"perfxlm: {notice}.", file=sys.stderr)
    pooling = _pooling_kwargs(args)
    return dict(
        **pooling,
        model=args.model_opt or getattr(args, "model", None),
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        load_format=args.load_format,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        kv_cache_gib=_kv_cache_gib(args),
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
        kv_cache_group_size=getattr(args, "kv_cache_group_size", None),
        quantization=getattr(args, "quantization", None),
        quantization_group_size=getattr(args, "quantization_group_size", None),
        quantization_symmetric=getattr(args, "quantization_symmetric", None),
        quant_activations=getattr(args, "quant_activations", "auto"),
        enable_prefix_caching=args.enable_prefix_caching,
        seed=args.seed,
        max_logprobs=args.max_logprobs,
        revision=getattr(args, "revision", None),
        download_dir=getattr(args, "download_dir", None),
        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
        data_parallel_size=getattr(args, "data_parallel_size", 1),
        enable_lora=getattr(args, "enable_lora", False),
        max_loras=getattr(args, "max_loras", 1),
        max_lora_rank=getattr(args, "max_lora_rank", 16),
        max_cpu_loras=getattr(args, "max_cpu_loras", None),
        lora_dtype=getattr(args, "lora_dtype", "auto"),
        speculative_config=getattr(args, "speculative_config", None),
        device=getattr(args, "device", "auto"),
        gpu_memory_utilization=gpu_share if device != "cpu" else None,
        enforce_eager=bool(getattr(args, "enforce_eager", None)),
    )


def _generate(args: argparse.Namespace) -> int:
    from perfxlm import LLM, SamplingParams

    # the sampling options first: a bad one is refused before seconds of model loading
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens,
        seed=args.sampling_seed,
    )
    kwargs = engine_kwargs(args)
    model = kwargs.pop("model")
    llm = LLM(model, **kwargs)
    if args.chat:
        outputs = llm.chat([{"role": "user", "content": p} for p in args.prompt][:1], params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    for out in outputs:
        if len(outputs) > 1 or args.chat:
            print(f"### {out.prompt!r}" if not args.chat else f"### {args.prompt[0]!r}")
        print((out.prompt or "") + out.outputs[0].text if args.echo else out.outputs[0].text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="perfxlm", description="perfxlm: a vLLM-compatible LLM engine for CPUs")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one or more prompts and print the result")
    gen.add_argument("prompt", nargs="+", help="prompt text (several prompts are batched)")
    add_engine_args(gen, positional_model=False)
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--chat", action="store_true", help="wrap the (first) prompt in the model's chat template")
    gen.add_argument("--echo", action="store_true", help="print the prompt before the completion")
    gen.set_defaults(func=_generate)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server (with a chat page at /)")
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    serve.add_argument("--served-model-name", default=None, help="model name clients use (default: from the path)")
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on every route but /health and / "
                            "(or set PERFXLM_API_KEY)")
    serve.add_argument("--allowed-origins", nargs="*", default=None,
                       help="CORS origins allowed to call the API (none by default); separate arguments or "
                            "one JSON list as vLLM takes it ('[\"*\"]')")
    serve.add_argument("--max-queued-requests", type=int, default=256,
                       help="requests allowed to wait for a seat; past it the server answers 503")
    serve.add_argument("--max-request-body-bytes", type=int, default=4 << 20,
                       help="largest request body accepted (413 beyond)")
    serve.add_argument("--max-stored-responses", type=int, default=1000,
                       help="/v1/responses kept in memory for GET /v1/responses/{id} and previous_response_id; "
                            "the least recently used go first (0: keep none)")
    serve.add_argument("--trust-request-chat-template", action="store_true",
                       help="render chat templates sent with requests (in a bounded sandbox); refused by default")
    serve.add_argument("--chat-template", default=None,
                       help="chat template (a file, or the template text) to use instead of the model's")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='let the model choose to call tools (tool_choice "auto"); needs --tool-call-parser')
    serve.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json", "mistral"],
                       help="format of the model's tool calls: hermes (Qwen2.5/Qwen3/Hermes), llama3_json, mistral")
    serve.add_argument("--reasoning-parser", default=None, choices=["qwen3", "deepseek_r1"],
                       help="split <think>...</think> out of the reply into reasoning_content")
    serve.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                       help="LoRA adapters served by name (with --enable-lora): name=path, or vLLM's JSON "
                            "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'; a request's model "
                            "field picks one")
    serve.add_argument("--uvicorn-log-level", default=None,
                       choices=["critical", "error", "warning", "info", "debug", "trace"],
                       help="HTTP server log level (default warning)")
    serve.add_argument("--disable-log-requests", action="store_true",
                       help="accepted for vLLM's launch lines: perfxlm does not log requests")
    serve.add_argument("--enable-log-requests", action="store_true", help=argparse.SUPPRESS)
    serve.set_defaults(func=_serve)

    chat = sub.add_parser("chat", help="interactive chat in the terminal, streaming the replies")
    add_engine_args(chat)
    chat.add_argument("--max-tokens", type=int, default=512, help="most tokens per reply")
    chat.add_argument("--temperature", type=float, default=0.7)
    chat.add_argument("--system", default=None, help="system prompt")
    chat.set_defaults(func=_chat)

    add_bench_parser(sub)
    from perfxlm.eval.command import add_eval_parser

    add_eval_parser(sub, add_engine_args, engine_kwargs)
    from perfxlm.export.command import add_export_parser

    add_export_parser(sub)
    return parser


def _serve(args: argparse.Namespace) -> int:
    from perfxlm.entrypoints.openai.api_server import run_server

    return run_server(args, engine_kwargs(args))


def _chat(args: argparse.Namespace) -> int:
    from perfxlm import Engine, SamplingParams
    from perfxlm.entrypoints.openai.chat_render import ChatRenderer

    engine = Engine(**engine_kwargs(args))
    renderer = ChatRenderer(engine.engine.tokenizer, max_workers=1)
    history = [{"role": "system", "content": args.system}] if args.system else []
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    print("perfxlm chat: type a message; an empty line or Ctrl-D quits, Ctrl-C stops a reply.")
    try:
        while True:
            try:
                text = input("> ").strip()
            except EOFError:
                break
            if not text:
                break
            history.append({"role": "user", "content": text})
            prompt = renderer.render_sync(history)
            handle = engine.start_request(prompt, params)
            reply = ""
            try:
                while True:
                    update = handle.queue.get()
                    if update.error is not None:
                        print(f"\nerror: {update.error}", file=sys.stderr)
                        return 1
                    print(update.new_text, end="", flush=True)
                    reply += update.new_text
                    if update.finished:
                        break
            except KeyboardInterrupt:
                handle.stop()
            print()
            history.append({"role": "assistant", "content": reply})
    finally:
        engine.shutdown()
    return 0


# ---- bench: argument wiring only; the benchmarks live in perfxlm.bench ----------------------------
def _bench_common_args(p: argparse.ArgumentParser, engine: bool = True) -> None:
    p.add_argument("--output-json", default=None, metavar="PATH", help="save the configuration and the results")
    if engine:
        p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
        p.add_argument("--skip-tokenizer-init", action="store_true",
                       help="do not load the tokenizer (token-id prompts, no detokenization)")
        p.add_argument("--disable-detokenize", action="store_true", help="do not detokenize the outputs")
        p.add_argument("--machine-peaks", action="store_true",
                       help="also measure the machine's copy bandwidth and matmul rate (about a second)")


def _dataset_args(p: argparse.ArgumentParser, input_len: int) -> None:
    p.add_argument("--dataset", nargs="+", default=["random"], metavar=("NAME", "PATH"),
                   help="'random' or 'sharegpt PATH' (a ShareGPT JSON file)")
    p.add_argument("--dataset-path", default=None, help="the ShareGPT file, as vLLM's --dataset-path")
    p.add_argument("--num-prompts", type=int, default=None, help="number of requests")
    p.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=input_len,
                   help="random prompts: prompt tokens per request")
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="random prompts: draw lengths from [len*(1-r), len*(1+r)]")


def _run_latency(args: argparse.Namespace) -> int:
    from perfxlm.bench.latency import cmd_latency

    return cmd_latency(args, engine_kwargs(args))


def _run_sweep(args: argparse.Namespace) -> int:
    from perfxlm.bench.latency import cmd_sweep

    return cmd_sweep(args, engine_kwargs(args))


def _run_throughput(args: argparse.Namespace) -> int:
    from perfxlm.bench.throughput import cmd_throughput

    return cmd_throughput(args, engine_kwargs(args))


def _run_embed(args: argparse.Namespace) -> int:
    from perfxlm.bench.embed import cmd_embed

    return cmd_embed(args, engine_kwargs(args))


def _run_serve(args: argparse.Namespace) -> int:
    from perfxlm.bench.serve import cmd_serve

    return cmd_serve(args)


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks: latency, sweep, throughput, embed, serve")
    bsub = bench.add_subparsers(dest="bench_command", required=True)

    lat = bsub.add_parser("latency", help="one batch: prefill time, decode step time, tokens/s, memory")
    add_engine_args(lat)
    lat.add_argument("--batch-size", type=int, default=8, help="requests in the batch")
    lat.add_argument("--input-len", type=int, default=32, help="random prompt tokens per request")
    lat.add_argument("--output-len", type=int, default=128, help="generated tokens per request (ignore_eos)")
    lat.add_argument("--num-iters", type=int, default=3, help="timed iterations")
    lat.add_argument("--num-iters-warmup", type=int, default=1, help="untimed iterations first")
    lat.add_argument("--quiet", action="store_true", help="no line per iteration")
    _bench_common_args(lat)
    lat.set_defaults(func=_run_latency, enable_prefix_caching=False)

    sweep = bsub.add_parser("sweep", help="the latency benchmark over batch sizes: Markdown, CSV, JSON, PNG")
    add_engine_args(sweep)
    sweep.add_argument("--batch-sizes", default="1,2,4,8,16,32,64", help="comma-separated batch sizes")
    sweep.add_argument("--input-len", type=int, default=128, help="random prompt tokens per request")
    sweep.add_argument("--output-len", type=int, default=128, help="generated tokens per request (ignore_eos)")
    sweep.add_argument("--num-iters", type=int, default=3, help="timed iterations per batch size")
    sweep.add_argument("--num-iters-warmup", type=int, default=1, help="untimed iterations per batch size")
    sweep.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=True,
                       help="one fresh process per batch size, so that memory is that batch's peak")
    sweep.add_argument("--output-csv", default=None, metavar="PATH", help="the table as CSV (default: beside the JSON)")
    sweep.add_argument("--output-png", default=None, metavar="PATH", help="the plot (default: beside the JSON)")
    _bench_common_args(sweep)
    sweep.set_defaults(func=_run_sweep, enable_prefix_caching=False)

    thr = bsub.add_parser("throughput", help="offline throughput: every request submitted at once")
    add_engine_args(thr)
    _dataset_args(thr, input_len=128)
    thr.add_argument("--output-len", type=int, default=None,
                     help="generated tokens per request (random: default 128; ShareGPT: default the reply's length)")
    thr.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    _bench_common_args(thr)
    thr.set_defaults(func=_run_throughput, num_prompts=1000)

    emb = bsub.add_parser("embed", help="embedding throughput on the pooling runner: texts/s and tokens/s")
    add_engine_args(emb)
    _dataset_args(emb, input_len=128)
    emb.add_argument("--max-tokens", type=int, default=256, help="texts cut to this many tokens (and the window)")
    emb.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    _bench_common_args(emb)
    emb.set_defaults(func=_run_embed, num_prompts=1024)

    srv = bsub.add_parser("serve", help="benchmark an OpenAI-compatible server (streaming /v1/completions)")
    srv.add_argument("--base-url", default=None, help="server URL, e.g. http://127.0.0.1:8000 (default: --host/--port)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--endpoint", default="/v1/completions", help="API path")
    srv.add_argument("--model", default=None, help="model name sent to the server (default: the first of /v1/models)")
    srv.add_argument("--tokenizer", default=None,
                     help="tokenizer folder or .gguf to count tokens (default: --model if a path, else the default model's)")
    _dataset_args(srv, input_len=128)
    srv.add_argument("--output-len", "--random-output-len", dest="output_len", type=int, default=128,
                     help="random prompts: max_tokens per request")
    srv.add_argument("--sharegpt-output-len", type=int, default=None,
                     help="ShareGPT: max_tokens for every request instead of the reply's length")
    srv.add_argument("--request-rate", type=float, default=float("inf"),
                     help="requests per second (inf: all at once); gaps are Poisson / gamma distributed")
    srv.add_argument("--burstiness", type=float, default=1.0,
                     help="gamma shape of the gaps: 1 = Poisson, < 1 burstier, > 1 more regular")
    srv.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    srv.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                     help="SLOs for goodput, e.g. ttft:500 tpot:50 (names: ttft, tpot, e2el)")
    srv.add_argument("--metric-percentiles", default="90,99", help="comma-separated percentiles to report")
    srv.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el", help="metrics to summarise")
    srv.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM / llama-server extension)")
    srv.add_argument("--extra-body", default=None, metavar="JSON", help="extra fields for every request body")
    srv.add_argument("--seed", type=int, default=0, help="seed for sampling prompts and arrival times")
    srv.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    srv.add_argument("--skip-initial-test", action="store_true", help="do not send the single test request first")
    srv.add_argument("--save-detailed", action="store_true", help="also save the generated texts in the JSON")
    srv.add_argument("--output-png", default=None, metavar="PATH",
                     help="latency CDF plot (default: beside the JSON)")
    _bench_common_args(srv, engine=False)
    srv.set_defaults(func=_run_serve, num_prompts=200)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from perfxlm.engine.engine_core import freeze_gc_at_engine_start

    freeze_gc_at_engine_start()  # this process is ours: engines built below may freeze the GC
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

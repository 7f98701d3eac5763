"""`perfxlm bench throughput`: offline throughput, every request submitted at once (vLLM's
benchmark_throughput). Each request generates its expected output length (ignore_eos, temperature 1).

requests/s = requests / elapsed; total tokens/s = (prompt + generated tokens) / elapsed;
output tokens/s = generated tokens / elapsed, with the token counts taken from the outputs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from perfxlm.bench import env as benv
from perfxlm.bench.common import make_llm, write_json
from perfxlm.bench.datasets import SampleRequest, check_dataset_path, load_requests, parse_dataset_arg
from perfxlm.bench.metrics import offline_throughput


def run_throughput(llm: Any, requests: Sequence[SampleRequest], use_tqdm: bool = True,
                   disable_detokenize: bool = False) -> dict[str, Any]:
    from perfxlm import SamplingParams

    if not requests:
        raise ValueError("no request to run.")
    prompts = [r.engine_prompt() for r in requests]
    params = [SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=r.expected_output_len,
                             detokenize=not disable_detokenize) for r in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(o.prompt_token_ids or ()) for o in outputs)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = offline_throughput(elapsed, len(outputs), prompt_tokens, output_tokens)
    result["peak_memory_gib"] = benv.peak_rss_gib()
    return result


def format_throughput(result: dict[str, Any]) -> str:
    return (f"Throughput: {result['requests_per_second']:.2f} requests/s, "
            f"{result['tokens_per_second']:.2f} total tokens/s, "
            f"{result['output_tokens_per_second']:.2f} output tokens/s\n"
            f"Total num prompt tokens:  {result['total_input_tokens']}\n"
            f"Total num output tokens:  {result['total_output_tokens']}\n"
            f"Elapsed time (s):         {result['elapsed_time']:.3f}\n"
            f"Peak resident memory (GiB): {result['peak_memory_gib']:.3f}")


def fit_to_model(requests: list[SampleRequest], max_model_len: int, log=print) -> list[SampleRequest]:
    """Drop the requests that can never run on this model (prompt + output > max_model_len)."""
    kept = [r for r in requests if r.prompt_len + r.expected_output_len <= max_model_len]
    if len(kept) < len(requests) and log is not None:
        log(f"note: {len(requests) - len(kept)} requests exceed max_model_len ({max_model_len}) and are left out.")
    if not kept:
        raise ValueError(f"no request fits max_model_len ({max_model_len}).")
    return kept


def cmd_throughput(args: Any, engine_kwargs: dict[str, Any]) -> int:
    benv.set_threads(args.threads)
    name, path = parse_dataset_arg(args.dataset, args.dataset_path)
    check_dataset_path(name, path)
    llm = make_llm(engine_kwargs, skip_tokenizer_init=args.skip_tokenizer_init)
    config = llm.llm_engine.config
    tokenizer = llm.get_tokenizer()
    if name == "sharegpt" and tokenizer is None:
        raise ValueError("--dataset sharegpt counts tokens with the model's tokenizer: this model has none "
                         "(pass --tokenizer PATH).")
    output_len = args.output_len
    requests = load_requests(
        name, path, args.num_prompts, tokenizer=tokenizer, vocab_size=int(config.hf_config.vocab_size),
        input_len=args.input_len, output_len=output_len if output_len is not None else 128, seed=args.seed,
        range_ratio=args.random_range_ratio, sharegpt_output_len=output_len, token_ids=name == "random",
    )
    requests = fit_to_model(requests, llm.llm_engine.resolved.max_model_len)
    env = benv.collect_env(llm, command="bench throughput", dataset=name, dataset_path=path,
                           num_prompts=len(requests), input_len=args.input_len if name == "random" else None,
                           output_len=output_len if output_len is not None else (128 if name == "random" else None),
                           random_range_ratio=args.random_range_ratio if name == "random" else None,
                           seed=args.seed, detokenize=not args.disable_detokenize and tokenizer is not None)
    if args.machine_peaks:
        env.update(benv.machine_peaks(env.get("compute_dtype", env["dtype"])))
    print(benv.format_env(env))
    result = run_throughput(llm, requests, use_tqdm=not args.disable_tqdm, disable_detokenize=args.disable_detokenize)
    print(format_throughput(result))
    if args.output_json:
        write_json(args.output_json, {"config": env, **result})
        print(f"saved {args.output_json}")
    return 0

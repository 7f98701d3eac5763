"""How many long requests a fixed KV-cache budget serves at once, per `kv_cache_dtype`.

For each cache dtype a `perfxlm serve` process starts with the same `--kv-cache-gib`; `perfxlm bench serve`'s
client then sends N requests of `--input-len` tokens at once (request rate inf) while a poller reads the
server's /metrics every 50 ms. Reported per dtype: the KV pool's tokens (from the start log), the most
requests running at once, preemptions, and the requests' throughput. With the same budget a cache that
stores fewer bytes per token admits proportionally more of the waiting requests.

    python benchmarks/kv_capacity.py --kv-cache-gib 0.1 --input-len 1024 --output-len 16 --num-prompts 24

Not a test: it starts servers and runs for a minute or more.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx

from perfxlm.bench.datasets import sample_random
from perfxlm.bench.serve import fetch_model_name, run_serve_benchmark
from perfxlm.config import default_model_path
from perfxlm.tokenizer import get_tokenizer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}(?:_total)?(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    return float(match.group(1)) if match else math.nan


class Server:
    def __init__(self, model: str, args: list[str]) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "perfxlm.entrypoints.cli", "serve", model, "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=dict(os.environ, TQDM_DISABLE="1"))
        deadline = time.time() + 600
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.log_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("server did not start")

    def log_text(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=5).text

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def measure(model: str, kv_dtype: str, args: argparse.Namespace, requests) -> dict:
    server = Server(model, ["--kv-cache-gib", str(args.kv_cache_gib), "--kv-cache-dtype", kv_dtype,
                            "--max-num-seqs", str(args.num_prompts), "--no-enable-prefix-caching",
                            *args.server_arg])
    try:
        pool = re.search(r"KV cache: .*?(\d[\d ]*) tokens", server.log_text())
        peak = {"running": 0}
        stop = threading.Event()

        def poll() -> None:
            while not stop.is_set():
                try:
                    peak["running"] = max(peak["running"], _metric(server.metrics(), "perfxlm:num_requests_running"))
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)

        poller = threading.Thread(target=poll, daemon=True)
        before = _metric(server.metrics(), "perfxlm:num_preemptions")
        poller.start()
        result, records = run_serve_benchmark(server.url, fetch_model_name(server.url), requests, ignore_eos=True,
                                              initial_test=False)
        stop.set()
        poller.join()
        preemptions = _metric(server.metrics(), "perfxlm:num_preemptions") - before
        failed = [r.error for r in records if not r.success]
        if failed:
            print(f"{kv_dtype}: {len(failed)} requests failed, e.g. {failed[0][:300]}", file=sys.stderr)
        return {"kv_cache_dtype": kv_dtype, "pool_tokens": pool.group(1).replace(" ", "") if pool else "?",
                "max_running": int(peak["running"]), "preemptions": int(preemptions),
                "completed": result["completed"], "request_throughput": result["request_throughput"],
                "output_throughput": result["output_throughput"]}
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded model")
    parser.add_argument("--kv-cache-gib", type=float, default=0.1)
    parser.add_argument("--dtypes", default="auto,int8,fp8")
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--server-arg", action="append", default=[], help="extra `perfxlm serve` argument")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    model = args.model or default_model_path()
    tokenizer = get_tokenizer(model)
    requests = sample_random(args.num_prompts, args.input_len, args.output_len, len(tokenizer), tokenizer=tokenizer)
    rows = [measure(model, d, args, requests) for d in args.dtypes.split(",")]
    base = rows[0]["max_running"] or 1
    print(f"\n{args.num_prompts} requests of {args.input_len} + {args.output_len} tokens at once, "
          f"kv_cache_gib={args.kv_cache_gib}\n")
    print("| kv_cache_dtype | pool tokens | most running at once | vs first | preemptions | completed | req/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['kv_cache_dtype']} | {r['pool_tokens']} | {r['max_running']} | {r['max_running'] / base:.2f}x | "
              f"{r['preemptions']} | {r['completed']} | {r['request_throughput']:.2f} |")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

"""A real `perfxlm serve` process per configuration, on a free loopback port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.conftest import default_model_or_skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, *extra: str, model: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        model = model or default_model_or_skip()
        cmd = [sys.executable, "-m", "perfxlm.entrypoints.cli", "serve", model, "--port", str(self.port),
               "--dtype", "float32", "--kv-cache-gib", "0.25", "--max-model-len", "2048", *extra,
               # e.g. "--tensor-parallel-size 2": the whole server suite against worker processes
               *os.environ.get("PERFXLM_TEST_SERVER_ARGS", "").split()]
        env = {**os.environ, "TQDM_DISABLE": "1"}
        self.log_path = f"/tmp/perfxlm-test-server-{self.port}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + 180
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early: {open(self.log_path).read()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("server did not start")

    def metric(self, name: str, headers: dict | None = None) -> float:
        text = httpx.get(self.url + "/metrics", headers=headers, timeout=10).text
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def wait_idle(self, timeout: float = 30, headers: dict | None = None) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if (self.metric("perfxlm:num_requests_running", headers) == 0
                    and self.metric("perfxlm:kv_cache_used_blocks", headers) == 0
                    and self.metric("perfxlm:num_requests_inflight", headers) == 0):
                return
            time.sleep(0.1)
        raise AssertionError("server did not go idle: requests or KV blocks still held")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


@pytest.fixture(scope="session")
def server():
    s = ServerProcess("--max-num-seqs", "64")
    yield s
    s.stop()

"""Fuzz the server's OpenAPI schema (valid and invalid inputs): never a 5xx, the server stays
healthy, and the KV pool is whole afterwards.

The cases are drawn from a fixed seed, so a failure replays; PERFXLM_FUZZ_SEED=N draws others."""

import json
import os

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, seed, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis.generation import GenerationMode  # noqa: E402

EXAMPLES_PER_OPERATION = 15
SEED = int(os.environ.get("PERFXLM_FUZZ_SEED", "0"))


def _shape(case) -> str:
    """What was sent, short enough for a failure message."""
    try:
        body = json.dumps(case.body, ensure_ascii=True)
    except (TypeError, ValueError):
        body = repr(case.body)
    return f"{case.method} {case.formatted_path} {body[:200]}"


def test_fuzzed_requests_never_get_5xx(server, tmp_path):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    failures = []
    statuses: dict[int, int] = {}
    sent: list[tuple[str, str]] = []  # (status or why there is none, request shape), in order
    for result in schema.get_all_operations():
        op = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @seed(SEED)
            @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case):
                try:
                    # Short timeout: a generated request may ask for thousands of tokens; hanging up
                    # also exercises abort-on-disconnect.
                    response = case.call(base_url=server.url, timeout=2)
                except Exception as exc:  # timeouts and refused encodings are the client's business
                    sent.append((type(exc).__name__, _shape(case)))
                    return
                sent.append((str(response.status_code), _shape(case)))
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                if response.status_code >= 500:
                    failures.append((op.label, response.status_code, response.text[:300]))

            try:
                run()
            except Unsatisfiable:  # e.g. no invalid input exists for an operation without parameters
                pass
    log = tmp_path / "fuzzed_requests.txt"
    log.write_text("".join(f"{status} {shape}\n" for status, shape in sent))
    replay = f"seed {SEED} (PERFXLM_FUZZ_SEED replays it); every request sent is in {log}"
    assert not failures, (failures[:5], replay)
    assert sum(statuses.values()) > 30 and statuses.get(400, 0) > 5, (statuses, replay)
    assert httpx.get(server.url + "/health").status_code == 200
    try:
        # the abandoned requests' aborts are applied between engine steps: a long prefill step holds
        # its blocks until it ends, nothing should hold them longer
        server.wait_idle(timeout=60)
    except AssertionError as exc:
        abandoned = [shape for status, shape in sent if not status.isdigit()]
        raise AssertionError(f"{exc}; {replay}; the requests whose client hung up: {abandoned[:8]}") from None

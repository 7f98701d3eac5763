"""Fuzz the server's OpenAPI schema (valid and invalid inputs): never a 5xx, the server stays
healthy, and the KV pool is whole afterwards."""

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis.generation import GenerationMode  # noqa: E402

EXAMPLES_PER_OPERATION = 15


@pytest.mark.skip(reason="quarantined: a fuzzed request can leave KV blocks held (server never idle), which then fails the server tests sharing this server; under investigation")
def test_fuzzed_requests_never_get_5xx(server):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    failures = []
    statuses: dict[int, int] = {}
    for result in schema.get_all_operations():
        op = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case):
                try:
                    # Short timeout: a generated request may ask for thousands of tokens; hanging up
                    # also exercises abort-on-disconnect.
                    response = case.call(base_url=server.url, timeout=2)
                except Exception:  # timeouts and refused encodings are the client's business
                    return
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                if response.status_code >= 500:
                    failures.append((op.label, response.status_code, response.text[:300]))

            try:
                run()
            except Unsatisfiable:  # e.g. no invalid input exists for an operation without parameters
                pass
    assert not failures, failures[:5]
    assert sum(statuses.values()) > 30 and statuses.get(400, 0) > 5, statuses
    assert httpx.get(server.url + "/health").status_code == 200
    server.wait_idle(timeout=60)

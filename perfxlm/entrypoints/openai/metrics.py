"""Prometheus metrics of the server: request gauges read from the engine at scrape time, token
counters, and latency histograms (TTFT, inter-token latency, end-to-end)."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from perfxlm.outputs import RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                    80.0)


class _EngineCollector:
    def __init__(self, server: "ServerMetrics") -> None:
        self.server = server

    def collect(self):
        engine = self.server.engine
        stats = engine.stats
        kv = engine.core.kv_cache_manager
        running = GaugeMetricFamily("perfxlm:num_requests_running", "Sequences running in the engine")
        running.add_metric([], stats["num_running"])
        waiting = GaugeMetricFamily("perfxlm:num_requests_waiting", "Requests admitted but not running yet")
        waiting.add_metric([], self.server.num_waiting())
        usage = GaugeMetricFamily("perfxlm:kv_cache_usage_perc", "Fraction of KV blocks in use (0 when idle)")
        usage.add_metric([], stats["kv_usage"])
        used = GaugeMetricFamily("perfxlm:kv_cache_used_blocks", "KV blocks held by requests")
        used.add_metric([], kv.num_blocks - kv.num_free_blocks)
        inflight = GaugeMetricFamily("perfxlm:num_requests_inflight", "HTTP requests being served")
        inflight.add_metric([], self.server.inflight)
        preempt = CounterMetricFamily("perfxlm:num_preemptions", "Preemptions (recompute)")
        preempt.add_metric([], stats["num_preemptions"])
        queries = CounterMetricFamily("perfxlm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        queries.add_metric([], kv.prefix_queries)
        hits = CounterMetricFamily("perfxlm:prefix_cache_hits", "Prompt tokens found in the prefix cache")
        hits.add_metric([], kv.prefix_hits)
        yield from (running, waiting, usage, used, inflight, preempt, queries, hits)
        yield from _spec_decode_metrics(engine.core.scheduler.spec_stats)
        replicas = getattr(engine.core, "replica_stats", None)  # data parallel: the sums above, and each replica
        if replicas is not None:
            names = (("num_requests_inflight", "inflight", "Requests routed to the replica and not ended"),
                     ("num_requests_running", "num_running", "Sequences running in the replica"),
                     ("num_requests_waiting", "num_waiting", "Sequences waiting in the replica"),
                     ("kv_cache_used_blocks", None, "KV blocks held by the replica's requests"))
            stats = replicas()
            for name, key, text in names:
                g = GaugeMetricFamily(f"perfxlm:dp_{name}", text, labels=["replica"])
                for i, s in enumerate(stats):
                    value = s.get(key, 0) if key else s.get("num_blocks", 0) - s.get("num_free_blocks", 0)
                    g.add_metric([str(i)], value)
                yield g


def _spec_decode_metrics(stats):
    """vLLM's speculative-decoding counters (zero without speculation)."""
    drafts = CounterMetricFamily("perfxlm:spec_decode_num_drafts", "Verifications of draft tokens")
    drafts.add_metric([], stats.num_drafts)
    tokens = CounterMetricFamily("perfxlm:spec_decode_num_draft_tokens", "Draft tokens proposed and verified")
    tokens.add_metric([], stats.num_draft_tokens)
    accepted = CounterMetricFamily("perfxlm:spec_decode_num_accepted_tokens", "Draft tokens accepted")
    accepted.add_metric([], stats.num_accepted_tokens)
    per_pos = CounterMetricFamily("perfxlm:spec_decode_num_accepted_tokens_per_pos",
                                  "Draft tokens accepted, by position in the draft", labels=["position"])
    for position, n in enumerate(list(stats.accepted_per_position)):
        per_pos.add_metric([str(position)], n)
    return drafts, tokens, accepted, per_pos


class ServerMetrics:
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.inflight = 0
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(self))
        self.prompt_tokens = Counter("perfxlm:prompt_tokens", "Prompt tokens processed", registry=self.registry)
        self.generation_tokens = Counter("perfxlm:generation_tokens", "Tokens generated", registry=self.registry)
        self.requests = Counter("perfxlm:request_success", "Finished requests", ["finished_reason"],
                                registry=self.registry)
        self.ttft = Histogram("perfxlm:time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("perfxlm:inter_token_latency_seconds", "Time between streamed outputs",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("perfxlm:time_per_output_token_seconds", "Mean time per output token of a request",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("perfxlm:e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self._last_output: dict[str, tuple[float, int]] = {}  # request -> (time, tokens so far)

    def num_waiting(self) -> int:
        return max(0, self.inflight - self.engine.stats["num_running"])

    def on_output(self, out: RequestOutput) -> None:
        """Called for every output the server sends (DELTA when streaming, FINAL_ONLY otherwise: either
        way the token counts of the outputs add up to what was generated)."""
        now = time.time()
        rid, m = out.request_id, out.metrics
        new_tokens = sum(len(c.token_ids) for c in out.outputs)
        self.generation_tokens.inc(new_tokens)
        last = self._last_output.get(rid)
        if last is None:
            if m is not None and m.first_token_time is not None:
                self.ttft.observe(m.first_token_time - m.arrival_time)
        else:
            self.itl.observe(now - last[0])
        total = (last[1] if last else 0) + new_tokens
        self._last_output[rid] = (now, total)
        if not out.finished:
            return
        self._last_output.pop(rid, None)
        self.prompt_tokens.inc(len(out.prompt_token_ids or ()))
        for c in out.outputs:
            self.requests.labels(finished_reason=c.finish_reason or "unknown").inc()
        if m is not None and m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
            if m.first_token_time is not None and total > 1:
                self.tpot.observe((m.last_token_time - m.first_token_time) / (total - 1))

    def forget(self, request_id: str) -> None:
        """The request's stream is over, finished or not (a client that went away never sees its end)."""
        self._last_output.pop(request_id, None)

    def render(self) -> bytes:
        return generate_latest(self.registry)

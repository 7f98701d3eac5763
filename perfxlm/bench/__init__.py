"""Benchmarks: `perfxlm bench latency | sweep | throughput | serve`.

- datasets: random token-id prompts and ShareGPT sampling (vLLM's filtering rules).
- metrics: serving metrics from per-request records, with vLLM's definitions and JSON names.
- latency: one batch, prefill time and decode step time measured apart; the batch-size sweep.
- throughput: offline, every request submitted at once.
- serve: an OpenAI-API streaming client for any OpenAI-compatible server.
- plots: PNG figures (matplotlib, Agg backend).
- env: the configuration block every command prints and saves.
"""

"""Evaluation: perplexity as llama.cpp computes it, run through the engine's own forward path."""

from perfxlm.eval.perplexity import PerplexityResult, perplexity
from perfxlm.eval.stats import final_estimate

__all__ = ["PerplexityResult", "final_estimate", "perplexity"]

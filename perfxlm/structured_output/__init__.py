"""Structured outputs: a request's StructuredOutputsParams compiled once into a grammar (xgrammar), and
per-request matchers that turn the tokens generated so far into a token bitmask for the next one.

- Compiling happens where input is validated (InputProcessor, the caller's thread): a schema, regex or
  grammar the engine cannot compile is a ValueError naming the problem, and no other request sees it.
- Matchers live in the model runner, keyed by request id like the seeded generators. Each step a
  guided row's matcher first accepts the output tokens it has not seen (normally the one sampled last
  step; after a preemption nothing is lost, the output is still there; a new matcher replays all of it),
  then fills its row of the bitmask. The sampler applies the rows' masks to those rows only.
- Speculative decoding: a guided request's verification rows (one per draft token and one after the
  last) are each masked as the grammar stands there: the matcher advances through the drafts while it
  fills them, stops at a draft the grammar rejects (verification rejects it at the row before), and is
  rolled back, so next step it catches up with what was accepted like any output.
- n > 1: every sibling has its own request id and so its own matcher, all from one compiled grammar.

xgrammar was chosen over llguidance on this engine's default tokenizer (SmolLM2, 49152 tokens):
mean per-token mask fill of a nested JSON schema 3-5 us (llguidance 13-20 us), any JSON 5 us (18 us),
a regex 1.3 us (50 us); applying one row's mask to float32 logits ~20 us.
"""

from perfxlm.structured_output.backend import GrammarBackend, GrammarMatchers

__all__ = ["GrammarBackend", "GrammarMatchers"]

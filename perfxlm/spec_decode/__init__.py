"""Speculative decoding: proposers guess the next tokens cheaply, the target model scores every guess in
one forward pass (extra decode rows of the step's batch), and the rejection sampler keeps the prefix the
target agrees with, so outputs are those of decoding without speculation (greedy: the same tokens;
random: the same distribution).

- `config.py`: vLLM's `speculative_config`, validated before any weights are read.
- `proposer.py`: the `Proposer` seam (token ids in, draft token ids out); `factory.py` builds the one a
  config names.
- `ngram.py`: prompt lookup (the longest recent n-gram's earlier continuation, as many tokens as its
  match makes likely).
- `draft_model.py`: a small model of the same vocabulary, with its own paged KV cache.
- `mtp.py`: the checkpoint's own multi-token-prediction layer (DeepSeek-V3), fed the target's hidden
  states every step (`Proposer.observe`), with its own paged KV cache; `mtp_loading.py` reads its weights.
- `draft_budget.py`: how many guesses each request carries next step, from its last verification (for
  proposers that do not bound their own).
- `stats.py`: vLLM's counters (drafts, draft tokens, accepted tokens, acceptance per position).
"""

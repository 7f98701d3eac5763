"""Benchmark requests: random token-id prompts, and ShareGPT conversations sampled the way vLLM's
benchmarks sample them, so that the same file, seed and tokenizer give the same requests.

ShareGPT (vLLM's `sample_sharegpt_requests` / `ShareGPTDataset`):
- conversations with fewer than 2 turns are dropped; each remaining one gives one (prompt, reply)
  pair: its first human turn and the turn after it (the first two turns, for the usual data that
  opens with the human);
- the pairs are shuffled with `random.Random(seed)` (the same permutation as vLLM's
  `random.seed(seed); random.shuffle(...)`) and walked in that order;
- prompt_len = tokens of the prompt, output_len = tokens of the reply (or a fixed output length);
  the tokenizer is called as vLLM calls it, with its default special tokens;
- a pair is skipped if prompt_len < 4, output_len < 4 (unless the output length is fixed),
  prompt_len > 1024 or prompt_len + output_len > 2048;
- sampling stops at num_requests accepted pairs (fewer if the file runs out).
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048

_HUMAN = ("human", "user")


@dataclass
class SampleRequest:
    """One benchmark request: a text prompt or token ids, and how many tokens to generate."""

    prompt: str | None
    prompt_len: int
    expected_output_len: int
    prompt_token_ids: list[int] | None = field(default=None, repr=False)

    def engine_prompt(self) -> str | dict[str, Any]:
        """The prompt in the form LLM.generate() / LLMEngine.add_request() take."""
        if self.prompt_token_ids is not None and self.prompt is None:
            return {"prompt_token_ids": list(self.prompt_token_ids)}
        return self.prompt  # text: the engine tokenizes it, as it would for a user


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of `text` as vLLM counts them: `tokenizer(text).input_ids` (special tokens included)."""
    if hasattr(tokenizer, "encode"):
        return list(tokenizer.encode(text))
    out = tokenizer(text)
    ids = getattr(out, "input_ids", None)
    if ids is None and isinstance(out, dict):
        ids = out["input_ids"]
    return list(out if ids is None else ids)


# ---- random ---------------------------------------------------------------------------------
def random_token_ids(
    num: int, length: int, vocab_size: int, seed: int = 0, exclude: Sequence[int] = ()
) -> list[list[int]]:
    """`num` prompts of `length` token ids drawn uniformly from [0, vocab_size) minus `exclude`."""
    if length < 1:
        raise ValueError(f"input length must be >= 1, got {length}.")
    allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(list(exclude), dtype=np.int64))
    if allowed.size == 0:
        raise ValueError("no token id left to draw from.")
    rng = np.random.default_rng(seed)
    return [allowed[rng.integers(0, allowed.size, size=length)].tolist() for _ in range(num)]


def sample_random(
    num_requests: int,
    input_len: int,
    output_len: int,
    vocab_size: int,
    seed: int = 0,
    range_ratio: float = 0.0,
    tokenizer: Any = None,
) -> list[SampleRequest]:
    """Random prompts. Lengths are drawn from [len*(1-range_ratio), len*(1+range_ratio)] (vLLM's
    --random-range-ratio); 0 gives exactly input_len / output_len.

    Without a tokenizer the prompts are token ids (engine benchmarks). With one, they are the text
    those ids decode to (for an HTTP server), and prompt_len is the length of that text re-encoded,
    which is what the server will see."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}.")
    rng = np.random.default_rng(seed)

    def lengths(n: int) -> list[int]:
        lo, hi = max(1, int(n * (1 - range_ratio))), max(1, int(n * (1 + range_ratio)))
        return rng.integers(lo, hi + 1, size=num_requests).tolist()

    in_lens, out_lens = lengths(input_len), lengths(output_len)
    exclude: list[int] = []
    if tokenizer is not None:
        exclude = list(getattr(tokenizer, "all_special_ids", None) or [])
    requests = []
    for i, (n_in, n_out) in enumerate(zip(in_lens, out_lens)):
        ids = random_token_ids(1, n_in, vocab_size, seed=seed * 1_000_003 + i, exclude=exclude)[0]
        if tokenizer is None:
            requests.append(SampleRequest(None, n_in, n_out, ids))
        else:
            text, n_text = _text_of_length(tokenizer, ids, n_in, vocab_size, exclude, seed * 1_000_003 + i)
            requests.append(SampleRequest(text, n_text, n_out))
    return requests


def _encode_plain(tokenizer: Any, text: str) -> list[int]:
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))
    except TypeError:
        return encode(tokenizer, text)


def _text_of_length(tokenizer: Any, ids: list[int], target: int, vocab_size: int, exclude: Sequence[int],
                    seed: int, max_rounds: int = 10) -> tuple[str, int]:
    """Text that re-encodes to `target` tokens, starting from `ids` (a few decode/encode rounds)."""
    text, n = tokenizer.decode(ids), len(ids)
    for round_ in range(max_rounds):
        text = tokenizer.decode(ids)
        again = _encode_plain(tokenizer, text)
        n = len(again)
        if n == target:
            break
        if n > target:
            ids = again[:target]
        else:
            ids = again + random_token_ids(1, target - n, vocab_size, seed=seed + 7 * (round_ + 1), exclude=exclude)[0]
    return text, n


# ---- ShareGPT -------------------------------------------------------------------------------
def load_sharegpt_pairs(path: str) -> list[tuple[str, str]]:
    """(first human turn, the reply to it) of every conversation with at least two turns, in file order."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of {{'conversations': [...]}} entries.")
    pairs: list[tuple[str, str]] = []
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        start = 0  # vLLM takes turns 0 and 1; start at the first human turn when the data opens otherwise
        for i, turn in enumerate(turns[:-1]):
            if isinstance(turn, dict) and turn.get("from") in _HUMAN:
                start = i
                break
        prompt, reply = turns[start], turns[start + 1]
        if not (isinstance(prompt, dict) and isinstance(reply, dict)):
            continue
        pairs.append((str(prompt.get("value", "")), str(reply.get("value", ""))))
    return pairs


def is_valid_sequence(
    prompt_len: int,
    output_len: int,
    min_len: int = SHAREGPT_MIN_LEN,
    max_prompt_len: int = SHAREGPT_MAX_PROMPT_LEN,
    max_total_len: int = SHAREGPT_MAX_TOTAL_LEN,
    skip_min_output_len_check: bool = False,
) -> bool:
    """vLLM's filter: prune too short prompts/replies and too long prompts/conversations."""
    if prompt_len < min_len:
        return False
    if not skip_min_output_len_check and output_len < min_len:
        return False
    return prompt_len <= max_prompt_len and prompt_len + output_len <= max_total_len


def sample_sharegpt(
    path: str,
    num_requests: int,
    tokenizer: Any,
    seed: int = 0,
    fixed_output_len: int | None = None,
    token_ids: bool = False,
) -> list[SampleRequest]:
    """Up to num_requests ShareGPT requests (see the module docstring for the rules).

    `tokenizer` is a Hugging Face tokenizer or anything with `encode(text) -> ids`. With token_ids=True
    the requests also carry the prompt's token ids."""
    if fixed_output_len is not None and fixed_output_len < 1:
        raise ValueError(f"output length must be >= 1, got {fixed_output_len}.")
    pairs = load_sharegpt_pairs(path)
    random.Random(seed).shuffle(pairs)
    requests: list[SampleRequest] = []
    for prompt, reply in pairs:
        if len(requests) >= num_requests:
            break
        prompt_ids = encode(tokenizer, prompt)
        output_len = len(encode(tokenizer, reply)) if fixed_output_len is None else fixed_output_len
        if not is_valid_sequence(len(prompt_ids), output_len, skip_min_output_len_check=fixed_output_len is not None):
            continue
        requests.append(SampleRequest(prompt, len(prompt_ids), output_len, prompt_ids if token_ids else None))
    return requests


# ---- the --dataset flag -----------------------------------------------------------------------
def parse_dataset_arg(values: Sequence[str] | None, path: str | None = None) -> tuple[str, str | None]:
    """`--dataset random`, `--dataset sharegpt PATH`, or `--dataset PATH` -> (name, path)."""
    values = list(values or ["random"])
    name = values[0].lower()
    if len(values) > 2:
        raise ValueError(f"--dataset takes a name and at most one path, got {values}.")
    if len(values) == 2:
        path = values[1]
    elif name not in ("random", "sharegpt"):
        name, path = "sharegpt", values[0]  # a bare file name
    if name not in ("random", "sharegpt"):
        raise ValueError(f"--dataset must be 'random' or 'sharegpt PATH', got {values[0]!r}.")
    if name == "sharegpt" and not path:
        raise ValueError("--dataset sharegpt needs the file: --dataset sharegpt PATH.")
    if name == "random" and len(values) == 2:
        raise ValueError("--dataset random takes no path.")
    return name, path


def check_dataset_path(name: str, path: str | None) -> None:
    if name == "sharegpt" and not (path and os.path.isfile(os.path.expanduser(path))):
        raise ValueError(f"the ShareGPT file {path!r} does not exist.")


def load_requests(
    name: str,
    path: str | None,
    num_requests: int,
    *,
    tokenizer: Any = None,
    vocab_size: int | None = None,
    input_len: int = 128,
    output_len: int | None = 128,
    seed: int = 0,
    range_ratio: float = 0.0,
    sharegpt_output_len: int | None = None,
    token_ids: bool = False,
    log: Callable[[str], None] | None = print,
) -> list[SampleRequest]:
    if num_requests < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_requests}.")
    if name == "sharegpt":
        check_dataset_path(name, path)
        path = os.path.expanduser(path)
        if tokenizer is None:
            raise ValueError("ShareGPT sampling counts tokens: it needs a tokenizer (pass --tokenizer PATH).")
        requests = sample_sharegpt(path, num_requests, tokenizer, seed, sharegpt_output_len, token_ids)
        if len(requests) < num_requests and log is not None:
            log(f"note: only {len(requests)} of the {num_requests} requested ShareGPT prompts pass the filter.")
        if not requests:
            raise ValueError(f"{path}: no conversation passes the ShareGPT filter.")
        return requests
    if vocab_size is None:
        vocab_size = len(tokenizer) if tokenizer is not None else None
    if vocab_size is None:
        raise ValueError("random prompts need the vocabulary size.")
    return sample_random(num_requests, input_len, output_len or 128, vocab_size, seed, range_ratio,
                         None if token_ids else tokenizer)

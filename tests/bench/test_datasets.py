"""ShareGPT sampling and filtering as vLLM does it; random prompts; the --dataset flag."""

from __future__ import annotations

import json
import random

import pytest

from perfxlm.bench.datasets import (
    is_valid_sequence,
    load_requests,
    load_sharegpt_pairs,
    parse_dataset_arg,
    random_token_ids,
    sample_random,
    sample_sharegpt,
)


class WordTokenizer:
    """One token per whitespace-separated word: lengths are easy to build by hand."""

    def encode(self, text, add_special_tokens=True):
        return [len(w) for w in text.split()]


def words(n: int, tag: str = "w") -> str:
    return " ".join([tag] * n)


def conv(prompt: str, reply: str, first: str = "human") -> dict:
    return {"id": "x", "conversations": [{"from": first, "value": prompt}, {"from": "gpt", "value": reply}]}


@pytest.fixture
def sharegpt_file(tmp_path):
    entries = [
        conv(words(10, "keep0"), words(20)),        # kept
        conv(words(3), words(20)),                  # prompt < 4
        conv(words(10), words(3)),                  # reply < 4
        conv(words(1025), words(10)),               # prompt > 1024
        conv(words(1000), words(1049)),             # prompt + reply = 2049 > 2048
        conv(words(1000, "keep1"), words(1048)),    # 2048: kept
        conv(words(4, "keep2"), words(4)),          # the minimum: kept
        {"id": "short", "conversations": [{"from": "human", "value": words(10)}]},  # one turn: dropped
        {"id": "sys", "conversations": [{"from": "system", "value": words(50)},
                                        {"from": "human", "value": words(6, "keep3")},
                                        {"from": "gpt", "value": words(7)}]},  # first human turn + its reply
        conv(words(1024, "keep4"), words(5)),       # prompt = 1024: kept
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(entries))
    return str(path)


def test_filter_rules():
    assert is_valid_sequence(4, 4)
    assert not is_valid_sequence(3, 100)
    assert not is_valid_sequence(100, 3)
    assert is_valid_sequence(100, 3, skip_min_output_len_check=True)
    assert is_valid_sequence(1024, 1024) and not is_valid_sequence(1025, 10)
    assert not is_valid_sequence(1000, 1049)


def test_sharegpt_filtering(sharegpt_file):
    reqs = sample_sharegpt(sharegpt_file, 100, WordTokenizer(), seed=0)
    kept = sorted((r.prompt.split()[0], r.prompt_len, r.expected_output_len) for r in reqs)
    assert kept == [("keep0", 10, 20), ("keep1", 1000, 1048), ("keep2", 4, 4), ("keep3", 6, 7), ("keep4", 1024, 5)]
    assert all(r.prompt_token_ids is None for r in reqs)


def test_sharegpt_pairs_take_first_human_turn(sharegpt_file):
    pairs = load_sharegpt_pairs(sharegpt_file)
    assert len(pairs) == 9  # the one-turn conversation is dropped
    assert pairs[7] == (words(6, "keep3"), words(7))


def test_sharegpt_fixed_output_len(sharegpt_file):
    reqs = sample_sharegpt(sharegpt_file, 100, WordTokenizer(), seed=0, fixed_output_len=2)
    # the reply's length no longer matters (the 3-token and the 1049-token replies come in); the prompt rules still do
    assert len(reqs) == 7 and all(r.expected_output_len == 2 for r in reqs)


def test_sharegpt_seeded_sampling_matches_vllm_order(sharegpt_file):
    """The subset is the first valid pairs of the list shuffled as vLLM shuffles it."""
    tok = WordTokenizer()
    pairs = load_sharegpt_pairs(sharegpt_file)
    random.seed(5)
    random.shuffle(pairs)  # vLLM: random.seed(seed); random.shuffle(dataset)
    expected = [p for p, r in pairs if is_valid_sequence(len(tok.encode(p)), len(tok.encode(r)))][:3]
    got = sample_sharegpt(sharegpt_file, 3, tok, seed=5)
    assert [r.prompt for r in got] == expected
    assert [r.prompt for r in sample_sharegpt(sharegpt_file, 3, tok, seed=5)] == expected
    orders = {tuple(r.prompt for r in sample_sharegpt(sharegpt_file, 5, tok, seed=s)) for s in range(6)}
    assert len(orders) > 1


def test_real_sharegpt_sample(sharegpt_samples, smol_tokenizer):
    reqs = sample_sharegpt(sharegpt_samples, 200, smol_tokenizer, seed=0, token_ids=True)
    assert len(reqs) == 200
    for r in reqs:
        assert r.prompt_len == len(smol_tokenizer(r.prompt).input_ids) == len(r.prompt_token_ids)
        assert is_valid_sequence(r.prompt_len, r.expected_output_len)
    assert len({r.prompt for r in reqs}) == 200
    assert [r.prompt for r in sample_sharegpt(sharegpt_samples, 20, smol_tokenizer, seed=0)] == \
        [r.prompt for r in reqs[:20]]


def test_random_token_ids():
    a = random_token_ids(3, 50, 100, seed=1, exclude=[0, 1, 2])
    assert len(a) == 3 and all(len(p) == 50 for p in a)
    assert all(3 <= t < 100 for p in a for t in p)
    assert a == random_token_ids(3, 50, 100, seed=1, exclude=[0, 1, 2])
    assert a != random_token_ids(3, 50, 100, seed=2, exclude=[0, 1, 2])
    with pytest.raises(ValueError):
        random_token_ids(1, 0, 100)


def test_sample_random_lengths():
    reqs = sample_random(20, 16, 8, vocab_size=1000, seed=0)
    assert all(r.prompt_len == 16 and r.expected_output_len == 8 and len(r.prompt_token_ids) == 16 for r in reqs)
    assert reqs[0].engine_prompt() == {"prompt_token_ids": reqs[0].prompt_token_ids}
    spread = sample_random(200, 100, 50, vocab_size=1000, seed=0, range_ratio=0.5)
    assert min(r.prompt_len for r in spread) >= 50 and max(r.prompt_len for r in spread) <= 150
    assert len({r.prompt_len for r in spread}) > 10
    assert all(25 <= r.expected_output_len <= 75 for r in spread)


def test_random_text_prompts(smol_tokenizer):
    reqs = sample_random(10, 32, 4, vocab_size=len(smol_tokenizer), seed=0, tokenizer=smol_tokenizer)
    for r in reqs:
        assert isinstance(r.prompt, str) and r.prompt_token_ids is None
        assert r.prompt_len == len(smol_tokenizer.encode(r.prompt, add_special_tokens=False))
    # decoded random ids re-encode to other lengths: the text is brought back to 32 tokens
    assert sum(r.prompt_len == 32 for r in reqs) >= 9


def test_parse_dataset_arg(tmp_path):
    assert parse_dataset_arg(None) == ("random", None)
    assert parse_dataset_arg(["random"]) == ("random", None)
    assert parse_dataset_arg(["sharegpt", "a.json"]) == ("sharegpt", "a.json")
    assert parse_dataset_arg(["a.json"]) == ("sharegpt", "a.json")
    assert parse_dataset_arg(["sharegpt"], "b.json") == ("sharegpt", "b.json")
    for bad in (["sharegpt"], ["random", "x.json"], ["foo", "x.json"], ["sharegpt", "a", "b"]):
        with pytest.raises(ValueError):
            parse_dataset_arg(bad)


def test_load_requests_errors(sharegpt_file):
    with pytest.raises(ValueError, match="tokenizer"):
        load_requests("sharegpt", sharegpt_file, 3)
    with pytest.raises(ValueError, match="num-prompts"):
        load_requests("random", None, 0, vocab_size=10)
    notes = []
    reqs = load_requests("sharegpt", sharegpt_file, 50, tokenizer=WordTokenizer(), log=notes.append)
    assert len(reqs) == 5 and "only 5 of the 50" in notes[0]

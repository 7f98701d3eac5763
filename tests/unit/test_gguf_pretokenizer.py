"""A GGUF file's BPE vocabulary splits text as llama.cpp does: hand-checked pieces per regex alternative,
and (where llama-cpp-python is installed) token ids equal to llama.cpp's, on the default model and on
small vocabularies written under every `tokenizer.ggml.pre` type."""

from __future__ import annotations

import importlib.util
import logging
import random

import pytest

from perfxlm.model.loader import gguf_pretokenizer as gp
from tests.conftest import default_model_or_skip

# ---------------------------------------------------------------------------------------------------------
# Text that meets every rule: digits after every kind of whitespace, contractions in both cases,
# punctuation runs, letters and numbers beyond ASCII, marks, emoji, CJK, long and odd whitespace runs
# ---------------------------------------------------------------------------------------------------------

VARIED = (
    "The 3 quick foxes jumped over 12 lazy dogs in 2024, at 10:45 pm.\n\n  0. First item\n\n1. Second\n"
    "   42 leading spaces;\t7 after a tab;\n\n\n  \n 99 mixed; x  5 y   66 z\u00a03 w\u3000 8.\n"
    "I'm sure you'll see they're we've he'd it's, IT'S, WE'LL, THEY'RE, 'S 'T 'quoted'.\n"
    "Runs: !!! ??? ... --- *** ((( ))) [[]] {{}} <<<>>> $$$ +++ ~~~ ||| ^^^ ``` @@@ ### %%% &&&.\n"
    "def f(x):\n    return x**2 + 3*x - 1  # comment\r\n\tif x >= 10:\n\t\tprint(f\"{x:04d}\")\n"
    "int main() { int a[3] = {1, 22, 333}; return a[0]+a[1]*a[2]; }  // 12345678901\n"
    "Caf\u00e9 na\u00efve E\u0301cole \u00c9COLE \u00c9cole stra\u00dfe \u0130stanbul "
    "\u0391\u03b8\u03ae\u03bd\u03b1 \u041c\u043e\u0441\u043a\u0432\u0430 "
    "2\u00b3 \u00bd \u2167 \u0663\u0664\u0665 \uff11\uff12\uff13 "
    "\u0939\u093f\u0928\u094d\u0926\u0940 \u0627\u0644\u0639\u0631\u0628\u064a\u0629\n"
    "Emoji: \U0001F600\U0001F680 \U0001F44D\U0001F3FD "
    "\U0001F468\u200D\U0001F469\u200D\U0001F467 \U0001F1FA\U0001F1F8!\n"
    "\u4e2d\u6587\u6587\u672c\uff0c\u5305\u542b\u6807\u70b9\u3002"
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8"
    "\u3001\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8 123\u5e74\n"
    "Long:" + " " * 37 + "end\t\t\t\t\tx" + "\n" * 6 + "  \r\n\r\n" + " " * 9
    + "\n\u2003\u2003y\u2028z\u0085w\n"
    "Numbers: 1 12 123 1234 12345 1,234,567.89 -0.5e-10 0x1F v2.0.1 #1 (2) [3] 4th 5'6\"\n"
    "Mixed: abc123def 456ghi jkl_789 MNO-012 pQ3rS x86_64 camelCase PascalCase ALLCAPS\n"
    "trailing   \n\n\n   \t \n9"
)

# single characters and short strings that meet at random, so that odd neighbours meet
_ATOMS = [
    *" \t\n\r\x0b\x0c\x1c\x85\xa0\u1680\u2000\u2028\u202f\u3000",
    *"aZ'sStTlLdD09!$+<=>^~|`_-./\\\"#()[]{}",
    "\u00e9", "\u00c9", "\u0301", "\u4e2d", "\u9fa6", "\u3042", "\u30a2", "\ud55c", "\u3131", "\u3105",
    "\U0001F600", "\u0663", "\uff11", "\u00b2", "\u2167", "\u2019", "\uff0c", "\u3002", "\u3001", "\u2026",
    "\u0964", "\u0939\u093f", "\u200d", "\u0800", "\u1e00", "\u212a", "\uff21", "\u00b5", "\u01bb", "\u0394",
    "\u03b4", "\u0436", "\ufe30", "\ue000", "<sentinel:", ">", "IMGIMG", "ABZ", "    ", "\n\n  0.",
]


def mixed_strings(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(_ATOMS) for _ in range(rng.randint(1, 14))) for _ in range(n)]


# ---------------------------------------------------------------------------------------------------------
# Hand-checked splits (no llama.cpp needed)
# ---------------------------------------------------------------------------------------------------------


def pieces(pre_type: str, text: str) -> list[str]:
    return [p for p, _ in gp.build_splitter(gp.PRE_TYPE_REGEXES[pre_type]).pre_tokenize_str(text)]


SMOLLM_CASES = [
    # digits are cut out first, so the whitespace before one ends its piece and stays whole
    ("\n\n  0.", ["\n\n  ", "0", "."]),
    (" 42", [" ", "4", "2"]),
    ("x  5", ["x", "  ", "5"]),
    ("abc123def", ["abc", "1", "2", "3", "def"]),
    ("\u0663\u0664 \u00b2", ["\u0663", "\u0664", " ", "\u00b2"]),  # every \p{N}, not only 0-9
    # contractions, case-sensitive
    ("I'm they're we'll it'd", ["I", "'m", " they", "'re", " we", "'ll", " it", "'d"]),
    ("IT'S", ["IT", "'", "S"]),
    # letters with one optional leading space
    (" caf\u00e9 \u0391\u03b8", [" caf\u00e9", " \u0391\u03b8"]),
    # other characters with one optional leading space
    ("a !!! ...?", ["a", " !!!", " ...?"]),
    ("(x)", ["(", "x", ")"]),
    # whitespace before a non-space keeps its last character for the next piece
    ("a   b", ["a", "  ", " b"]),
    ("a\n\nb", ["a", "\n", "\n", "b"]),
    ("a \t\nb", ["a", " \t", "\n", "b"]),
    # whitespace at the end is one piece
    ("a  ", ["a", "  "]),
]

LLAMA3_CASES = [
    # no digit pre-split: the whitespace run gives its last space to nothing and splits one by one
    ("\n\n  0.", ["\n\n", " ", " ", "0", "."]),
    # contractions, either case
    ("IT'S we'LL", ["IT", "'S", " we", "'LL"]),
    # letters after one optional non-letter, non-digit, non-newline character
    ("(hello \tworld", ["(hello", " ", "\tworld"]),
    ("\nx", ["\n", "x"]),
    # up to three digits
    ("12345", ["123", "45"]),
    (" 7", [" ", "7"]),
    # other characters with one optional space, taking the newlines after them
    ("a ...\n\nb", ["a", " ...\n\n", "b"]),
    # whitespace up to its last newline
    ("a  \n\n  b", ["a", "  \n\n", " ", " b"]),
    # whitespace before a non-space keeps its last character; at the end it is whole
    ("a   1", ["a", "  ", " ", "1"]),
    ("a \t ", ["a", " \t "]),
]


@pytest.mark.parametrize("text, expected", SMOLLM_CASES)
def test_smollm_splits(text, expected):
    assert gp.PRE_TOKENIZER_RULES["smollm"] == gp.PreTokenizerRule("starcoder")
    assert pieces("starcoder", text) == expected


@pytest.mark.parametrize("text, expected", LLAMA3_CASES)
def test_llama3_splits(text, expected):
    assert gp.PRE_TOKENIZER_RULES["llama-bpe"] == gp.PreTokenizerRule("llama3", ignore_merges=True)
    assert pieces("llama3", text) == expected


def test_llamacpp_engine_quirks_are_kept():
    # U+3000 is whitespace to llama.cpp, never part of the CJK range that spans it
    assert pieces("deepseek-coder", "\u4e2d\u3000\u4e2d") == ["\u4e2d", "\u3000", "\u4e2d"]
    # a non-ASCII letter counts as both cases: "aÉb" is one lower-case word, and "ÉCOLE" starts with one
    assert pieces("gpt4o", "a\u00c9b \u00c9COLE") == ["a\u00c9b", " \u00c9", "COLE"]


def test_every_name_has_a_type_and_every_type_builds():
    assert set(r.pre_type for r in gp.PRE_TOKENIZER_RULES.values()) == set(gp.PRE_TYPE_REGEXES)
    for pre_type in gp.PRE_TYPE_REGEXES:
        pre = gp.build_pre_tokenizer(pre_type)
        assert "".join(p for p, _ in pre.pre_tokenize_str(VARIED))  # compiles and splits


def test_rule_for_the_file_metadata(caplog):
    assert gp.rule_for({"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default"}) is None
    assert gp.rule_for({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2"}).pre_type == "qwen2"
    with caplog.at_level(logging.WARNING, logger=gp.__name__):
        assert gp.rule_for({"tokenizer.ggml.model": "gpt2"}, "x.gguf").pre_type == "default"
        for _ in range(2):
            assert gp.rule_for({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "no-such-pre"}) is None
    unknown = [r.getMessage() for r in caplog.records if "no-such-pre" in r.getMessage()]
    assert len(unknown) == 1  # once per name


# ---------------------------------------------------------------------------------------------------------
# The default model's tokenizer (no llama.cpp needed)
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_tok():
    from perfxlm.tokenizer import get_tokenizer

    return get_tokenizer(default_model_or_skip())


def test_default_model_splits_as_smollm(gguf_tok):
    # llama.cpp's tokens for this string, hand-checked: "\n\n  " is one vocabulary entry
    ids = gguf_tok.encode("\n\n  0.", add_special_tokens=False)
    assert gguf_tok.convert_ids_to_tokens(ids) == ["\u010a\u010a\u0120\u0120", "0", "."]
    assert gguf_tok.decode(gguf_tok.encode(VARIED, add_special_tokens=False)) == VARIED


def test_a_hugging_face_folder_keeps_its_own_tokenizer(tmp_path, gguf_tok):
    from tokenizers import pre_tokenizers

    from perfxlm.tokenizer import get_tokenizer

    # a folder's tokenizer.json is used as written, even one whose splitting differs from llama.cpp's
    gguf_tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    try:
        gguf_tok.save_pretrained(tmp_path)
    finally:
        gguf_tok.backend_tokenizer.pre_tokenizer = gp.build_pre_tokenizer("starcoder")
    folder_tok = get_tokenizer(str(tmp_path))
    assert folder_tok.tokenize("\n\n  0.") == ["\u010a\u010a\u0120", "\u0120", "0", "."]


# ---------------------------------------------------------------------------------------------------------
# Against llama.cpp itself
# ---------------------------------------------------------------------------------------------------------

needs_llama_cpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None,
    reason="comparing tokens with llama.cpp needs llama-cpp-python (pip install llama-cpp-python)",
)


def llamacpp_vocab(path: str):
    from llama_cpp import Llama

    return Llama(path, vocab_only=True, verbose=False)


def assert_same_ids(ours, llama, texts: list[str]) -> None:
    for text in texts:
        got = ours(text)
        want = llama.tokenize(text.encode(), add_bos=False, special=False)
        assert got == want, f"{text!r}: {got} != llama.cpp's {want}"


@needs_llama_cpp
def test_default_model_ids_equal_llamacpp(gguf_tok):
    llama = llamacpp_vocab(default_model_or_skip())
    texts = [VARIED, *mixed_strings(300)]
    assert_same_ids(lambda t: gguf_tok.encode(t, add_special_tokens=False), llama, texts)


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte value, the alphabet of a byte-level vocabulary."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    table = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    return [table[b] for b in range(256)]


def write_pair_vocab_gguf(path: str, pre: str, texts: list[str], extra: dict[str, list[str]] | None = None):
    """A GGUF with only a BPE vocabulary: every byte, and a merge (in shuffled order) for every pair of
    bytes the texts use, so a piece cut in a different place almost always gives different tokens."""
    import gguf

    chars = _byte_chars()
    used = sorted({chars[b] for text in texts for b in text.encode()})
    pairs = [(a, b) for a in used for b in used]
    random.Random(0).shuffle(pairs)
    extra = extra or {}
    tokens = chars + [a + b for a, b in pairs] + extra.get("tokens", [])
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(16)
    writer.add_block_count(1)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    writer.add_token_merges([f"{a} {b}" for a, b in pairs] + extra.get("merges", []))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def first_name(pre_type: str) -> str:
    return next(name for name, rule in gp.PRE_TOKENIZER_RULES.items() if rule.pre_type == pre_type)


@needs_llama_cpp
@pytest.mark.parametrize("pre_type", sorted(gp.PRE_TYPE_REGEXES))
def test_every_pre_type_ids_equal_llamacpp(tmp_path, pre_type):
    from tokenizers import Tokenizer, models

    from perfxlm.model.loader.gguf_reader import GGUFFile

    texts = [VARIED, *mixed_strings(300, seed=1)]
    path = str(tmp_path / "vocab.gguf")
    write_pair_vocab_gguf(path, first_name(pre_type), texts)
    meta = GGUFFile(path).metadata
    tokens = list(meta["tokenizer.ggml.tokens"])
    rule = gp.rule_for(meta, path)
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    vocab = {t: i for i, t in enumerate(tokens)}
    bpe = Tokenizer(models.BPE(vocab, merges, ignore_merges=rule.ignore_merges))
    bpe.pre_tokenizer = gp.build_pre_tokenizer(rule.pre_type)
    assert_same_ids(lambda t: bpe.encode(t, add_special_tokens=False).ids, llamacpp_vocab(path), texts)


@needs_llama_cpp
@pytest.mark.parametrize("pre, whole", [("llama-bpe", True), ("dbrx", False)])
def test_ignore_merges_through_the_loader(tmp_path, pre, whole):
    from perfxlm.model.loader.gguf_tokenizer import load_gguf_tokenizer

    # "Ġhello" is in the vocabulary but no merge leads to it: llama3 files take it whole, dbrx files don't
    texts = ["say hello, world!", " hello", "hellohello"]
    path = str(tmp_path / f"{pre}.gguf")
    write_pair_vocab_gguf(path, pre, texts, {"tokens": ["\u0120hello"], "merges": []})
    llama = llamacpp_vocab(path)
    for _ in range(2):  # converted, then read back from the cache
        tok = load_gguf_tokenizer(path, cache_dir=str(tmp_path / "cache"))
        assert ("\u0120hello" in tok.tokenize(" hello")) == whole
        assert_same_ids(lambda t: tok.encode(t, add_special_tokens=False), llama, texts)

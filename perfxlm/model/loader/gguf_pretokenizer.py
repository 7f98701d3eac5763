"""llama.cpp's pre-tokenization of a GGUF file's BPE ("gpt2") vocabulary, rebuilt from `tokenizers` parts.

llama.cpp picks its split rules by the file's `tokenizer.ggml.pre` name: a list of regexes applied one
after another, each one splitting the pieces the previous one left, never looking across a piece's edge
(a whitespace run cut short by an isolated digit is at the end of its piece, so `\\s+(?!\\S)` takes all
of it). A `tokenizers` Sequence of isolating Splits does the same, so each list becomes one Split per
regex, then a ByteLevel that only maps bytes to the vocabulary's characters.

The regexes are written for `tokenizers`' engine (Oniguruma, Ruby syntax) and say what llama.cpp's
engines do with its own spelling of them, which is not always what the spelling says elsewhere:

- A regex with a Unicode category runs on a copy of the text where each non-ASCII code point is one
  byte per category (letter, number, punctuation, mark, symbol, whitespace, other), so `\\p{Lu}`,
  `\\p{Ll}`, ... all mean "any letter" there, and a non-ASCII letter is both upper and lower case.
- A regex without one runs on the code points, but with every non-ASCII whitespace replaced by a
  vertical tab first: a literal range such as U+0800-U+4E00 never matches U+3000, only `\\s` does.
- `$` means the end of the piece there (ECMAScript); in Ruby syntax it is any line end, so `\\z`.
- The splitters llama.cpp hand-codes for the gpt2, llama3, qwen2 and qwen3.5 regexes split exactly as
  the regexes do (the gpt2 one also takes a lone whitespace run, as `|\\s+`, which the regex leaves
  unmatched as its own piece anyway).

Categories come from each engine's Unicode tables, so code points assigned in a newer Unicode version
than llama.cpp's table may split differently.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------------------
# llama.cpp's regexes, per pre-tokenizer type
# ---------------------------------------------------------------------------------------------------------

_CONTRACTIONS = r"'s|'t|'re|'ve|'m|'ll|'d"
# case-insensitive, spelled out: llama.cpp's engine has no (?i:...)
_CONTRACTIONS_ANY_CASE = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = _CONTRACTIONS + r"| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_WS_TAIL = r"|\s*[\r\n]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    _CONTRACTIONS_ANY_CASE + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*" + _WS_TAIL
)
_QWEN2 = _CONTRACTIONS_ANY_CASE + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*" + _WS_TAIL
# an upper-case letter is "a letter other than a-z" and a lower-case one "a letter other than A-Z", as
# llama.cpp spells them; with its collapsed categories that is all it can tell apart
_UPPER = r"(?:(?=\p{L})[^a-z])"
_LOWER = r"(?:(?=\p{L})[^A-Z])"
_UPPER_OR_MARK = r"(?:(?=[\p{L}\p{M}])[^a-z])"
_LOWER_OR_MARK = r"(?:(?=[\p{L}\p{M}])[^A-Z])"
_CASED_WORDS = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS_ANY_CASE}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS_ANY_CASE}?"
)
# a piece of deepseek-v3's and its kin's main regex: a word after one ASCII punctuation mark, etc.
_DEEPSEEK3_WORDS = (
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
)
_CJK_KANA = r"[\x{4E00}-\x{9FA5}\x{3040}-\x{309F}\x{30A0}-\x{30FF}]+"
# the literal range U+0800-U+4E00 holds whitespace, which llama.cpp's engine never sees here (see above)
_CJK_HANGUL = r"[\x{4E00}-\x{9FA5}\x{800}-\x{4E00}\x{AC00}-\x{D7FF}&&\S]+"
_LATIN_GREEK_CYRILLIC_LETTERS = (
    r"[A-Za-z\x{B5}\x{C0}-\x{D6}\x{D8}-\x{F6}\x{F8}-\x{1BA}\x{1BC}-\x{1BF}\x{1C4}-\x{293}\x{295}-\x{2AF}"
    r"\x{370}-\x{373}\x{376}\x{377}\x{37B}-\x{37D}\x{37F}\x{386}\x{388}-\x{38A}\x{38C}\x{38E}-\x{3A1}"
    r"\x{3A3}-\x{3F5}\x{3F7}-\x{481}\x{48A}-\x{52F}\x{531}-\x{556}\x{10A0}-\x{10C5}\x{13A0}-\x{13F5}"
    r"\x{13F8}-\x{13FD}\x{1C90}-\x{1CBA}\x{1CBD}-\x{1CBF}\x{1D00}-\x{1D2B}\x{1D6B}-\x{1D77}\x{1D79}-\x{1D9A}"
    r"\x{1E00}-\x{1F15}\x{1F18}-\x{1F1D}\x{1F20}-\x{1F45}\x{1F48}-\x{1F4D}\x{1F50}-\x{1F57}\x{1F59}\x{1F5B}"
    r"\x{1F5D}\x{1F5F}-\x{1F7D}\x{1F80}-\x{1FB4}\x{1FB6}-\x{1FBC}\x{1FBE}\x{1FC2}-\x{1FC4}\x{1FC6}-\x{1FCC}"
    r"\x{1FD0}-\x{1FD3}\x{1FD6}-\x{1FDB}\x{1FE0}-\x{1FEC}\x{1FF2}-\x{1FF4}\x{1FF6}-\x{1FFC}\x{2102}\x{2107}"
    r"\x{210A}-\x{2113}\x{2115}\x{2119}-\x{211D}\x{2124}\x{2126}\x{2128}\x{212A}-\x{212D}\x{212F}-\x{2134}"
    r"\x{2139}\x{213C}-\x{213F}\x{2145}-\x{2149}\x{214E}\x{2183}\x{2184}\x{2C00}-\x{2C7B}\x{2C7E}-\x{2CE4}"
    r"\x{2CEB}-\x{2CEE}\x{2CF2}\x{2CF3}\x{A640}-\x{A66D}\x{A680}-\x{A69B}\x{A722}-\x{A76F}\x{A771}-\x{A787}"
    r"\x{A78B}-\x{A78E}\x{AB70}-\x{ABBF}\x{FB00}-\x{FB06}\x{FB13}-\x{FB17}\x{FF21}-\x{FF3A}\x{FF41}-\x{FF5A}"
    r"\x{10400}-\x{1044F}\x{104B0}-\x{104D3}\x{104D8}-\x{104FB}\x{10C80}-\x{10CB2}\x{10CC0}-\x{10CF2}"
    r"\x{118A0}-\x{118DF}\x{1E900}-\x{1E943}]+"
)
_BLOOM = r" ?[^(\s|.,!?\x{2026}\x{3002}\x{FF0C}\x{3001}\x{964}\x{6D4}\x{60C})]+"
_NEWLINE_RUNS = r"[^\n]+|[\n]+"

# the regexes llama.cpp applies in order, per pre-tokenizer type (LLAMA_VOCAB_PRE_TYPE_*)
PRE_TYPE_REGEXES: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "gpt2": (_GPT2,),
    "starcoder": (r"\p{N}", _GPT2),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"),
    "llama3": (_LLAMA3,),
    "qwen2": (_QWEN2,),
    "qwen35": (
        _CONTRACTIONS_ANY_CASE
        + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
        + _WS_TAIL,
    ),
    "jais2": (
        _CONTRACTIONS_ANY_CASE
        + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
        + "".join(rf"|\s{{{n}}}(?!\S)" for n in (512, 256, 128, 64, 32, 16, 8, 4))
        + r"|\s{1,2}(?!\S)|\s{1}",
    ),
    "deepseek-llm": (
        r"[\r\n]",
        r"\s?" + _LATIN_GREEK_CYRILLIC_LETTERS,
        # U+3000 is left out of the last range: llama.cpp's engine sees it as whitespace only
        r"\s?[!-/:-~\x{FF01}-\x{FF0F}\x{FF1A}-\x{FF5E}\x{2018}-\x{201F}\x{3001}-\x{3002}]+",
        r"\s+\z",
        _CJK_HANGUL,
        r"\p{N}+",
    ),
    "deepseek-coder": (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}"),
    "deepseek-v3": (
        r"\p{N}{1,3}",
        _CJK_KANA,
        _DEEPSEEK3_WORDS + r"| ?[\p{P}\p{S}]+[\r\n]*" + _WS_TAIL,
    ),
    "spark2_5": (
        r"\p{N}{1,3}",
        _CJK_KANA,
        _DEEPSEEK3_WORDS + r"| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+",
        r"\p{N}",
    ),
    "bloom": (_BLOOM,),
    "viking": (_BLOOM, r"\p{N}"),
    "chatglm4": (_LLAMA3,),
    "tekken": (
        rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
        r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*" + _WS_TAIL,
    ),
    "chameleon": (
        r"<sentinel:[0-9]+>",
        r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
        r"([\t\n]|    |  )",
        r"\p{N}",
        r"[\p{P}!-/:-@\[-`{-~]",
        _GPT2,
    ),
    "gpt4o": (_CASED_WORDS + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*" + _WS_TAIL,),
    "granite-emb-multi": (
        rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER_OR_MARK}*{_LOWER_OR_MARK}+{_CONTRACTIONS_ANY_CASE}?"
        rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER_OR_MARK}+{_LOWER_OR_MARK}*{_CONTRACTIONS_ANY_CASE}?"
        r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*" + _WS_TAIL,
    ),
    "youtu": (
        r"[\x{AC00}-\x{D7A3}\x{3131}-\x{318E}]+|[\x{FF01}\x{2026}\x{201C}\x{201D}\x{2018}\x{2019}\x{2014}"
        r"\x{FF1A}\x{FF1B}\x{FF0C}\x{3001}-\x{303F}\x{FE30}-\x{FE4F}]+|[\x{3105}-\x{312F}]+|" + _CJK_KANA,
        # \p{Lu}, \p{Ll}, ... collapse to "any letter" in llama.cpp's engine (see above)
        rf"[^\r\n\p{{L}}\p{{N}}]?[\p{{L}}\p{{M}}]*[\p{{L}}\p{{M}}]+{_CONTRACTIONS_ANY_CASE}?"
        rf"|[^\r\n\p{{L}}\p{{N}}]?[\p{{L}}\p{{M}}]+[\p{{L}}\p{{M}}]*{_CONTRACTIONS_ANY_CASE}?"
        r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*" + _WS_TAIL,
    ),
    "bailingmoe": (
        r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    ),
    "seed-coder": (
        _CONTRACTIONS_ANY_CASE
        + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+"
        + _WS_TAIL,
    ),
    "ufakzeka": (r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*" + _WS_TAIL,),
    "laguna": (_NEWLINE_RUNS, _QWEN2),
    "exaone-moe": (
        _CONTRACTIONS_ANY_CASE
        + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?"
        r"|\s*[\r\n]|\s+(?!\S)|\s+",
    ),
    "minicpm5": (
        r"\p{N}{1,3}",
        _CONTRACTIONS_ANY_CASE + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*" + _WS_TAIL,
    ),
}


@dataclass(frozen=True)
class PreTokenizerRule:
    """What llama.cpp does with one `tokenizer.ggml.pre` name."""

    pre_type: str  # a key of PRE_TYPE_REGEXES
    # a word found whole in the vocabulary is one token, whatever the merges would make of it
    ignore_merges: bool = False


def _names(pre_type: str, names: str, ignore_merges: bool = False) -> dict[str, PreTokenizerRule]:
    return {name: PreTokenizerRule(pre_type, ignore_merges) for name in names.split()}


# llama.cpp's `tokenizer.ggml.pre` names, each with its type and its ignore_merges flag. Left out, so
# kept as transformers converts them: the types llama.cpp splits with hand-written code that follows no
# regex (kimi-k2, afmoe, tiny_aya's digit groups, superbpe's empty matches) and the ones without byte
# encoding (gemma4, sarvam-moe, whitespace).
PRE_TOKENIZER_RULES: dict[str, PreTokenizerRule] = {
    **_names("default", "default"),
    **_names("gpt2", "gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert"
             " jina-v1-en jina-v2-code roberta-bpe exaone4 mpt olmo jais trillion granite-docling"),
    **_names("starcoder", "starcoder refact command-r smollm codeshell exaone minerva-7b mellum2"),
    **_names("falcon", "falcon"),
    **_names("llama3", "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano",
             ignore_merges=True),
    **_names("llama3", "dbrx smaug-bpe"),
    **_names("qwen2", "qwen2 deepseek-r1-qwen kormo f2llmv2 megrez stablelm2 hunyuan solar-open grok-2"),
    **_names("qwen35", "qwen35"),
    **_names("jais2", "jais-2"),
    **_names("deepseek-llm", "deepseek-llm"),
    **_names("deepseek-coder", "deepseek-coder"),
    **_names("deepseek-v3", "deepseek-v3 hunyuan-dense joyai-llm hy_v4"),
    **_names("spark2_5", "spark2_5"),
    **_names("bloom", "poro-chat bloom gpt3-finnish"),
    **_names("viking", "viking"),
    **_names("chatglm4", "chatglm-bpe"),
    **_names("chatglm4", "glm4 glm5", ignore_merges=True),
    **_names("tekken", "tekken", ignore_merges=True),
    **_names("chameleon", "chameleon"),
    **_names("gpt4o", "gpt-4o llama4 kanana2 talkie minimax-m2"),
    **_names("granite-emb-multi", "granite-embed-multi-97m", ignore_merges=True),
    **_names("youtu", "youtu", ignore_merges=True),
    **_names("bailingmoe", "bailingmoe bailingmoe2 llada-moe"),
    **_names("seed-coder", "seed-coder"),
    **_names("ufakzeka", "ufakzeka"),
    **_names("laguna", "laguna"),
    **_names("exaone-moe", "exaone-moe"),
    **_names("minicpm5", "minicpm5", ignore_merges=True),
}

# ---------------------------------------------------------------------------------------------------------
# Building and applying
# ---------------------------------------------------------------------------------------------------------


def build_splitter(regexes: tuple[str, ...]):
    """The pieces llama.cpp's regexes cut, as plain text (before the byte mapping)."""
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes])


def build_pre_tokenizer(pre_type: str):
    """The whole pre-tokenizer for a BPE vocabulary: llama.cpp's splits, then the byte mapping."""
    from tokenizers import Regex, pre_tokenizers

    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TYPE_REGEXES[pre_type]]
    # use_regex=False: ByteLevel's own GPT-2 split would cut the pieces again
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return pre_tokenizers.Sequence([*splits, byte_level])


_warned: set[str] = set()


def _warn_once(name: str, message: str) -> None:
    if name not in _warned:
        _warned.add(name)
        logger.warning(message)


def rule_for(metadata: Mapping[str, Any], path: str = "") -> PreTokenizerRule | None:
    """llama.cpp's rule for a GGUF file's BPE vocabulary, or None to keep transformers' conversion."""
    if metadata.get("tokenizer.ggml.model") != "gpt2":
        return None  # sentencepiece and other vocabularies: the conversion already matches
    name = metadata.get("tokenizer.ggml.pre")
    if not name:
        # llama.cpp falls back to its default regexes too (and warns that quality suffers)
        _warn_once("", f"{path or 'A GGUF file'} names no tokenizer.ggml.pre; splitting as llama.cpp's "
                       "'default'. Regenerate the file with a current llama.cpp converter to fix this.")
        return PRE_TOKENIZER_RULES["default"]
    rule = PRE_TOKENIZER_RULES.get(name)
    if rule is None:
        _warn_once(name, f"GGUF pre-tokenizer {name!r} is not one perfxlm reproduces; its text is split as "
                         "transformers' GGUF conversion does, which may differ from llama.cpp's tokens.")
    return rule


def apply_rule(tok, rule: PreTokenizerRule) -> None:
    """Give a converted transformers fast tokenizer llama.cpp's pre-tokenizer and merge rule, in place."""
    backend = tok.backend_tokenizer
    backend.pre_tokenizer = build_pre_tokenizer(rule.pre_type)
    backend.model.ignore_merges = rule.ignore_merges

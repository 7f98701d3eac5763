"""A GGUF file's tokenizer in Hugging Face terms: converted by transformers once, with llama.cpp's
pre-tokenizer for a BPE vocabulary (`gguf_pretokenizer`), then cached on disk (keyed by the file, its size
and mtime, and the transformers version)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from typing import Any

from perfxlm.model.loader.gguf_pretokenizer import apply_rule, rule_for
from perfxlm.model.loader.gguf_reader import file_key, open_gguf

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------------------

# bump when the cached layout or the conversion changes, so stale caches are not reused
_TOKENIZER_CACHE_VERSION = 2  # 2: llama.cpp's pre-tokenizers for BPE vocabularies
_TOKENIZER_FLAGS_FILE = "perfxlm_gguf_tokenizer.json"


def _tokenizer_cache_dir(path: str, cache_dir: str | None) -> str:
    import transformers

    root = cache_dir or os.path.join(
        os.environ.get("PERFXLM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "perfxlm"),
        "tokenizers",
    )
    abspath, size, mtime_ns = file_key(path)
    # the saved format is transformers' own, so a different transformers version converts afresh
    ident = f"{abspath}|{size}|{mtime_ns}|{transformers.__version__}|{_TOKENIZER_CACHE_VERSION}"
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", os.path.basename(abspath))[:64]
    return os.path.join(root, f"{stem}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}")


def _convert_tokenizer(path: str):
    tok = _transformers_tokenizer(path)
    # transformers splits most BPE vocabularies with one regex or GPT-2's, whatever the file names;
    # llama.cpp (which made the file) splits by `tokenizer.ggml.pre`, and its tokens are the reference
    rule = rule_for(open_gguf(path).metadata, path)
    if rule is not None:
        apply_rule(tok, rule)
    return tok


def _transformers_tokenizer(path: str):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    folder, name = os.path.split(os.path.abspath(path))
    try:
        # builds the same tokenizer as AutoTokenizer without AutoTokenizer's detour through the
        # model config, which parses the whole GGUF header with gguf-py and costs seconds
        return PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=name)
    except Exception as e:  # noqa: BLE001 - any failure: fall back to the canonical route
        logger.debug("Direct GGUF tokenizer conversion failed (%s); using AutoTokenizer.", e)
        return AutoTokenizer.from_pretrained(folder, gguf_file=name)


def _special_flags(tok) -> dict[str, Any]:
    flags = {k: getattr(tok, k, None) for k in ("add_bos_token", "add_eos_token")}
    return {k: v for k, v in flags.items() if isinstance(v, bool)}


def load_gguf_tokenizer(path: str, cache_dir: str | None = None, use_cache: bool = True):
    """A transformers fast tokenizer (with the file's chat template) for a GGUF file.

    The conversion from GGUF metadata is cached with `save_pretrained` under `cache_dir` (default
    `$PERFXLM_CACHE_DIR/tokenizers`, else `~/.cache/perfxlm/tokenizers`), keyed on the file's path, size
    and mtime, so later loads skip it.
    """
    from transformers import PreTrainedTokenizerFast

    if not use_cache:
        return _convert_tokenizer(path)

    target = _tokenizer_cache_dir(path, cache_dir)
    flags_file = os.path.join(target, _TOKENIZER_FLAGS_FILE)
    if os.path.isfile(flags_file):
        try:
            with open(flags_file) as fh:
                flags = json.load(fh)
            # the bos/eos flags are passed explicitly, as the GGUF conversion does, so the rebuilt
            # post-processor is the same
            tok = PreTrainedTokenizerFast.from_pretrained(target, **flags)
            tok.name_or_path = os.path.abspath(path)
            return tok
        except Exception as e:  # noqa: BLE001 - a broken cache entry is rebuilt below
            logger.warning("Rebuilding unreadable tokenizer cache %s: %s", target, e)
            shutil.rmtree(target, ignore_errors=True)

    tok = _convert_tokenizer(path)
    try:
        _save_tokenizer_cache(tok, target)
    except OSError as e:  # a read-only or full cache only costs speed
        logger.warning("Could not cache the GGUF tokenizer in %s: %s", target, e)
    return tok


def _save_tokenizer_cache(tok, target: str) -> None:
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    # written beside the target and renamed into place, so readers never see a partial entry
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
    try:
        tok.save_pretrained(tmp)
        with open(os.path.join(tmp, _TOKENIZER_FLAGS_FILE), "w") as fh:
            json.dump(_special_flags(tok), fh)
        if os.path.isfile(os.path.join(target, _TOKENIZER_FLAGS_FILE)):
            return  # a concurrent process finished the same entry first
        shutil.rmtree(target, ignore_errors=True)  # leftovers of an incomplete entry
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

"""The grammar engine behind structured outputs (xgrammar)."""

from __future__ import annotations

import json
import re
import threading
from typing import Any

import torch

from perfxlm.sampling_params import StructuredOutputsParams

# xgrammar's errors start with "[hh:mm:ss] /path/file.cc:123: "; the user needs what follows.
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\]\s+\S+:\d+:\s*")


def _clean_error(exc: BaseException) -> str:
    text = _CPP_PREFIX.sub("", str(exc).strip())
    text = text.replace("Check failed: (error.empty()) is false: ", "")
    return text.strip().splitlines()[0] if text.strip() else type(exc).__name__


def choice_grammar(choices: list[str]) -> str:
    """EBNF matching exactly one of the strings (JSON string escapes are valid EBNF literals)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _close_objects(schema: Any) -> Any:
    """disable_additional_properties: objects that do not say otherwise accept no other keys."""
    if isinstance(schema, dict):
        out = {k: _close_objects(v) for k, v in schema.items()}
        if out.get("type") == "object" and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_close_objects(v) for v in schema]
    return schema


class GrammarBackend:
    """Compiles StructuredOutputsParams for one tokenizer; built at the first guided request (the
    tokenizer's vocabulary is analysed once, ~0.15 s for 49k tokens)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._compiler = None
        self._info = None
        self._info_json: tuple[str, str] | None = None
        self._lock = threading.Lock()

    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids or None
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
                self._info = info
            return self._compiler

    def reduce(self, grammar: Any) -> tuple:
        """How a grammar this backend compiled pickles (see restore_compiled_grammar)."""
        import hashlib

        with self._lock:
            if self._info_json is None:
                text = self._info.serialize_json()
                self._info_json = (hashlib.sha256(text.encode()).hexdigest(), text)
        return restore_compiled_grammar, (grammar.serialize_json(), *self._info_json)

    def compile(self, so: StructuredOutputsParams):
        """The compiled grammar, or ValueError naming what the engine could not compile."""
        compiler = self._get_compiler()
        kind = so.kind
        try:
            if kind == "json":
                schema = so.json
                if isinstance(schema, str):
                    try:
                        schema = json.loads(schema)
                    except json.JSONDecodeError as exc:
                        raise ValueError(f"structured_outputs.json is not valid JSON: {exc}.") from None
                if not isinstance(schema, (dict, bool)):
                    raise ValueError("structured_outputs.json must be a JSON schema object.")
                if so.disable_additional_properties:
                    schema = _close_objects(schema)
                return compiler.compile_json_schema(
                    json.dumps(schema), any_whitespace=not so.disable_any_whitespace
                )
            if kind == "json_object":
                if so.disable_any_whitespace:
                    return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
                return compiler.compile_json_schema('{"type": "object"}')
            if kind == "regex":
                return compiler.compile_regex(so.regex)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(so.choice))
            return compiler.compile_grammar(so.grammar)
        except ValueError:
            raise
        except Exception as exc:  # noqa: BLE001 - the grammar engine's own errors are the caller's input
            raise ValueError(f"structured_outputs.{kind} could not be compiled: {_clean_error(exc)}") from None


# Worker processes (tensor parallelism) receive requests pickled; xgrammar's objects are not picklable,
# so a compiled grammar travels as its JSON plus its tokenizer's (serialized once per backend here,
# deserialized once per tokenizer there).
_tokenizer_infos: dict[str, Any] = {}
_serial_lock = threading.Lock()


def restore_compiled_grammar(grammar_json: str, digest: str, tokenizer_json: str) -> Any:
    import xgrammar as xgr

    with _serial_lock:
        info = _tokenizer_infos.get(digest)
        if info is None:
            info = _tokenizer_infos[digest] = xgr.TokenizerInfo.deserialize_json(tokenizer_json)
    return xgr.CompiledGrammar.deserialize_json(grammar_json, info)


class GrammarMatchers:
    """Per-request matchers of the runner. fill() brings each guided request's matcher up to date with its
    output tokens and writes its next-token bitmask (one row, or one per position of its draft tokens);
    requests whose tokens the grammar rejects are reported."""

    def __init__(self) -> None:
        self._matchers: dict[str, Any] = {}  # request id -> [matcher, tokens accepted]

    def __len__(self) -> int:
        return len(self._matchers)

    def drop(self, request_ids) -> None:
        for rid in request_ids:
            self._matchers.pop(rid, None)

    def fill(self, rows: list[tuple], num_rows: int) -> tuple[list[int], torch.Tensor | None, dict[str, str]]:
        """rows: (first batch row, request id, compiled grammar, output token ids, start token[, draft token
        ids]). A request with k draft tokens owns rows first..first + k, row j scoring the token after its
        output and drafts[:j] (speculative decoding's verification). A start token (a reasoning model's
        end-of-thinking token) leaves the rows free until it is in the output (or drafts) and constrains
        them from the next token on. Returns the rows to mask, the bitmask [num_rows, ceil(vocab / 32)]
        int32 (other rows all ones) and failures by request id."""
        import xgrammar as xgr

        # every grammar was compiled for the model's vocabulary (the logits' width)
        bitmask = xgr.allocate_token_bitmask(num_rows, rows[0][2].tokenizer_info.vocab_size)
        masked: list[int] = []
        failed: dict[str, str] = {}
        for row, rid, grammar, output, start, *rest in rows:
            drafts = rest[0] if rest else ()
            entry = self._matchers.get(rid)
            if entry is None:
                # [matcher, output tokens consumed (or scanned for the start token), started]
                entry = self._matchers[rid] = [xgr.GrammarMatcher(grammar), 0, start is None]
            matcher = entry[0]
            first = 0  # the first of the request's positions the grammar constrains
            if not entry[2]:
                try:
                    entry[1] = output.index(start, entry[1]) + 1
                    entry[2] = True
                except ValueError:
                    entry[1] = len(output)
                    if start not in drafts:
                        continue  # still thinking: unconstrained
                    first = drafts.index(start) + 1  # thinking ends inside the guesses
            try:
                while entry[1] < len(output):
                    token = output[entry[1]]
                    if matcher.is_terminated():
                        entry[1] = len(output)  # generation went on past the grammar's end (ignore_eos)
                        break
                    if not matcher.accept_token(token):
                        raise ValueError(f"the grammar rejects token {token} at output position {entry[1]} "
                                         "(no token the grammar allows had a finite logit)")
                    entry[1] += 1
                masked.extend(_fill_positions(matcher, bitmask, row, drafts, first))
            except Exception as exc:  # noqa: BLE001 - this request's state failed alone
                failed[rid] = f"structured output failed: {exc}"
                self._matchers.pop(rid, None)
        return masked, (bitmask if masked else None), failed


def _fill_positions(matcher: Any, bitmask: torch.Tensor, row: int, drafts, first: int) -> list[int]:
    """Bitmask rows row + first .. row + len(drafts): the matcher advances through the drafts, each row
    masked as it stands there, and is rolled back to where it started. Past a draft the grammar rejects
    no row is filled: verification rejects that draft at the row before, whose mask excludes it. A
    terminated grammar constrains nothing further (generation past its end: ignore_eos)."""
    masked: list[int] = []
    advanced = 0
    try:
        for j in range(first, len(drafts) + 1):
            if matcher.is_terminated():
                break
            matcher.fill_next_token_bitmask(bitmask, row + j)
            masked.append(row + j)
            if j == len(drafts) or not matcher.accept_token(drafts[j]):
                break
            advanced += 1
    finally:
        if advanced:
            matcher.rollback(advanced)
    return masked

"""benchmarks/spec_decode.py builds its prompts per kind: per listed repository file (up to eight) a code
edit renaming every `self` and a one-change edit renaming its first function (instruction before or after
the code), each quoting its (clipped) file; without a dataset only the code edits."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "spec_decode.py"


class WordTokenizer:
    def encode(self, text, add_special_tokens=False):
        return text.split(" ")

    def decode(self, ids):
        return " ".join(ids)


def _module():
    spec = importlib.util.spec_from_file_location("spec_decode_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_code_prompts_take_each_listed_file():
    module = _module()
    assert len(module._CODE_FILES) == 8 and len(set(module._CODE_FILES)) == 8
    assert all((ROOT / path).is_file() for path in module._CODE_FILES)  # a moved file would break the benchmark
    kinds = module.make_prompts(WordTokenizer(), None, 8, 40)
    code_kinds = ["code edit", "one change", "one change, code first"]
    assert list(kinds) == code_kinds and all(len(kinds[k]) == 8 for k in code_kinds)
    for i, path in enumerate(module._CODE_FILES):
        head = " ".join((ROOT / path).read_text(encoding="utf-8").split(" ")[:40])
        assert all(head in kinds[k][i] for k in code_kinds)
        name = module._first_name(head)
        assert f"`{name}` renamed to `{name}_v2`" in kinds["one change"][i]
        assert kinds["one change"][i].startswith("Rewrite") and kinds["one change, code first"][i].startswith("```")
    assert len(module.make_prompts(WordTokenizer(), None, 3, 40)["code edit"]) == 3


def test_passage_and_chat_kinds_from_the_dataset(sharegpt_samples):
    kinds = _module().make_prompts(WordTokenizer(), sharegpt_samples, 8, 60)
    assert {k: len(v) for k, v in kinds.items()} == {"code edit": 8, "one change": 8, "one change, code first": 8,
                                                     "quote": 8, "summarise": 8, "chat": 8}


def test_the_one_change_is_the_first_function():
    first = _module()._first_name
    assert first("import os\nclass Pool:\n    def take(self, n):\n") == "take"
    assert first("import os\nclass Pool:\n    x = 1\n") == "Pool"
    assert first("# only a comment") == "only" and first("") == "main"

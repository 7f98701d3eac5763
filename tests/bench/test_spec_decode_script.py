"""benchmarks/spec_decode.py builds its prompts per kind: one code edit per listed repository file, up to
eight, each quoting its (clipped) file; without a dataset only the code edits."""

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
    assert list(kinds) == ["code edit"] and len(kinds["code edit"]) == 8
    for path, prompt in zip(module._CODE_FILES, kinds["code edit"]):
        head = (ROOT / path).read_text(encoding="utf-8").split(" ")[:40]
        assert " ".join(head) in prompt
    assert len(module.make_prompts(WordTokenizer(), None, 3, 40)["code edit"]) == 3


def test_passage_and_chat_kinds_from_the_dataset(sharegpt_samples):
    kinds = _module().make_prompts(WordTokenizer(), sharegpt_samples, 8, 60)
    assert {k: len(v) for k, v in kinds.items()} == {"code edit": 8, "quote": 8, "summarise": 8, "chat": 8}

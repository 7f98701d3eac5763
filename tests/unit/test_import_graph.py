"""The package has no import cycle, counting imports inside functions too."""

from __future__ import annotations

from pathlib import Path

from perfxlm.tools.imports import cycles, import_graph, main

ROOT = Path(__file__).resolve().parents[2]


def test_no_import_cycle():
    found = cycles(import_graph(ROOT))
    assert found == [], f"import cycles: {found} (python -m perfxlm.tools.imports shows the edges)"


def test_the_checker_finds_a_cycle_closed_inside_a_function(tmp_path, capsys):
    pkg = tmp_path / "perfxlm"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from perfxlm.sub import a\n")  # a package importing its own child
    (pkg / "sub" / "a.py").write_text("from perfxlm import b\n")
    (pkg / "b.py").write_text("def f():\n    from .sub.a import x\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from perfxlm import b\n")
    (pkg / "d.py").write_text("import perfxlm.c\n")
    graph = import_graph(tmp_path)
    assert graph["perfxlm.b"] == {"perfxlm.sub.a"} and graph["perfxlm.c"] == set()
    assert graph["perfxlm.d"] == {"perfxlm.c"}
    assert cycles(graph) == [["perfxlm.b", "perfxlm.sub.a"]]
    assert main(["--root", str(tmp_path)]) == 1
    assert "perfxlm.b -> perfxlm.sub.a" in capsys.readouterr().out

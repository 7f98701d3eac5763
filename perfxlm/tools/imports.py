"""The package's import graph, and its cycles.

`python -m perfxlm.tools.imports` prints every cycle (exit status 1 if there is one) and, with `--edges`,
the imports between top-level parts. Every import counts, at module level or inside a function: a cycle
closed by a function-local import still means two modules that cannot be understood apart. Only imports
under `if TYPE_CHECKING:` are left out (they never run). Importing a submodule implies its parent
packages' `__init__`, which is not counted as an edge back.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

PACKAGE = "perfxlm"


def package_modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module under `root / PACKAGE`."""
    modules = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _type_checking_only(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return isinstance(test, ast.Name) and test.id == "TYPE_CHECKING" or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking_only(child):
                stack.extend(child.orelse)  # the else branch runs
                continue
            stack.append(child)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the package modules it imports."""
    modules = package_modules(root)

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in _imports(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    base = module.split(".") if is_package else module.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                # `from pkg import sub` imports the submodule; `from mod import name` the module
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
            for target in targets:
                if target != PACKAGE and not target.startswith(PACKAGE + "."):
                    continue
                found = resolve(target)
                if found and found != module and not module.startswith(found + "."):
                    graph[module].add(found)
    for module in modules:
        graph.setdefault(module, set())
    return dict(graph)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perfxlm.tools.imports", description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=str(Path(__file__).resolve().parents[2]), help="folder holding perfxlm/")
    parser.add_argument("--edges", action="store_true", help="also print the imports between top-level parts")
    args = parser.parse_args(argv)
    graph = import_graph(Path(args.root))
    if args.edges:
        part = lambda m: ".".join(m.split(".")[:2])  # noqa: E731
        between = sorted({(part(a), part(b)) for a, bs in graph.items() for b in bs if part(a) != part(b)})
        for a, b in between:
            print(f"{a} -> {b}")
    found = cycles(graph)
    for component in found:
        inside = set(component)
        print(f"cycle of {len(component)} modules:")
        for a in component:
            for b in sorted(graph[a] & inside):
                print(f"  {a} -> {b}")
    if not found:
        print(f"{len(graph)} modules, no import cycle")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())

"""The package's layout: no import cycles, and the core never imports a leaf subpackage.

The core (flat modules under transformer/) is what a reader holds beside the paper; parsing/,
serving/ and experiments/ are leaves that only the command line (cli.py) imports. Every import
counts, at module level or inside a function.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import transformer

PACKAGE = Path(transformer.__file__).parent
SUBPACKAGES = ("parsing", "serving", "experiments")
ENTRY_POINTS = {"transformer.cli", "transformer.__main__"}  # may import anything


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules `name` imports."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m in known and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def _is_leaf(module: str) -> bool:
    return module.split(".")[1:2] and module.split(".")[1] in SUBPACKAGES


def test_the_core_never_imports_a_subpackage():
    bad = [
        f"{m} imports {d}"
        for m, deps in _graph().items()
        if not _is_leaf(m) and m not in ENTRY_POINTS
        for d in sorted(deps)
        if _is_leaf(d)
    ]
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    graph = _graph()
    # Package __init__ modules are not edges of a cycle: `from transformer import x` names x.
    graph = {m: {d for d in deps if d not in ("transformer", *[f"transformer.{s}" for s in
                                                                  SUBPACKAGES])}
             for m, deps in graph.items()}  # fmt: skip
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []
    cycles = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                cycles.append(" -> ".join([*stack[stack.index(d) :], d]))
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "\n".join(cycles)


def test_the_check_sees_a_cycle_and_a_leaf_import(tmp_path, monkeypatch):
    # The two tests above must be able to fail: a planted cycle and a planted leaf import.
    pkg = tmp_path / "transformer"
    (pkg / "parsing").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "parsing" / "__init__.py").write_text("")
    (pkg / "parsing" / "trees.py").write_text("")
    (pkg / "a.py").write_text("from transformer import b\n")
    (pkg / "b.py").write_text("def f():\n    from transformer.a import x\n")
    (pkg / "c.py").write_text("from transformer.parsing.trees import Tree\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    graph = _graph()
    assert "transformer.b" in graph["transformer.a"] and "transformer.a" in graph["transformer.b"]
    assert "transformer.parsing.trees" in graph["transformer.c"]
    for test in (test_no_import_cycles, test_the_core_never_imports_a_subpackage):
        try:
            test()
        except AssertionError:
            continue
        raise AssertionError(f"{test.__name__} did not fail on the planted layout")

"""The house's layout holds: ``accuracy/`` imports nothing of ``sut``, ``sut/errors.py`` is a leaf, the packages of
``sut/`` import each other without cycles, and the root of ``sut/`` keeps its few modules (docs/architecture.md)."""

import ast
from collections import defaultdict
from pathlib import Path

from conftest import REPO

ROOT_MODULES = {"__init__", "__main__", "base", "cli", "constants", "errors", "exits", "http_sut", "messages",
                "registry", "scenarios", "standalone"}


def _imports(path: Path) -> set[str]:
    """Every absolute module name ``path`` imports (``from X import y`` gives X and X.y)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def _unit(module: str) -> str:
    """``sut.<package>`` for a module of a package of ``sut``, ``sut.<module>`` for a root module, ``accuracy``."""
    parts = module.split(".")
    if parts[0] == "accuracy":
        return "accuracy"
    return ".".join(parts[:2])


def _module_exists(module: str) -> bool:
    p = REPO.joinpath(*module.split("."))
    return p.with_suffix(".py").is_file() or p.is_dir()


def _graph() -> dict[str, set[str]]:
    edges = defaultdict(set)
    for pkg in ("sut", "accuracy"):
        for path in (REPO / pkg).rglob("*.py"):
            src = _unit(".".join(path.relative_to(REPO).with_suffix("").parts))
            for m in _imports(path):
                if m.split(".")[0] in ("sut", "accuracy") and _module_exists(m) and _unit(m) not in (src, "sut"):
                    edges[src].add(_unit(m))
    return edges


def _cycle(edges: dict[str, set[str]]):
    """One cycle of units as a list, else None (depth-first search)."""
    state, stack = {}, []

    def visit(u):
        state[u] = 1
        stack.append(u)
        for v in sorted(edges.get(u, ())):
            if state.get(v) == 1:
                return stack[stack.index(v):] + [v]
            if v not in state and (found := visit(v)):
                return found
        state[u] = 2
        stack.pop()
        return None

    for u in sorted(edges):
        if u not in state and (found := visit(u)):
            return found
    return None


def test_accuracy_imports_nothing_of_sut():
    bad = {str(p.relative_to(REPO)): sorted(m for m in _imports(p) if m.split(".")[0] == "sut")
           for p in (REPO / "accuracy").rglob("*.py")}
    assert not {p: ms for p, ms in bad.items() if ms}


def test_the_errors_module_is_a_leaf():
    assert not [m for m in _imports(REPO / "sut" / "errors.py") if m.split(".")[0] in ("sut", "accuracy")]


def test_the_packages_import_each_other_without_a_cycle():
    assert _cycle(_graph()) is None, _cycle(_graph())


def test_a_cycle_is_found_where_there_is_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_root_of_sut_keeps_its_few_modules():
    root = {p.stem for p in (REPO / "sut").glob("*.py")}
    assert root <= ROOT_MODULES, sorted(root - ROOT_MODULES)


def _private_imports(path: Path, package: str) -> list[str]:
    """``module.name`` for each name starting with one underscore that ``path`` imports from a module of
    ``package`` (``from accuracy.dataset import _x``)."""
    return [f"{node.module}.{a.name}" for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
            and node.module.split(".")[0] == package
            for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]


def test_the_harness_uses_only_the_public_names_of_the_gate(tmp_path):
    """``accuracy/`` is the gate that works on its own; what ``sut/`` and ``scripts/`` take from it is its public
    interface (documented), not a helper it may rename."""
    found = {str(p.relative_to(REPO)): ms for pkg in ("sut", "scripts") for p in (REPO / pkg).rglob("*.py")
             if (ms := _private_imports(p, "accuracy"))}
    assert not found, found
    probe = tmp_path / "probe.py"  # the check itself finds one
    probe.write_text("from accuracy.dataset import MAX_DATASET_BYTES, _helper\n")
    assert _private_imports(probe, "accuracy") == ["accuracy.dataset._helper"]

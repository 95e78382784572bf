"""The layout's rules, checked on the source (no imports run): no import loops, nothing in `slimwise/` imports
the experiments, and serving never loads the trainer or the evaluation. Function size and complexity are
ruff's (C901, PLR0915 in pyproject.toml).

Every import counts, module-level, inside functions (a lazy import is still a dependency: the old
generate -> distill -> generate loop was a lazy one) and in a `if __name__ == "__main__":` block (an
entry point that imports a module importing it back is a loop too), except those under `if TYPE_CHECKING:`.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "slimwise"


def module_name(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _skipped(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def imports_of(path: Path, known: set[str], root: Path = ROOT) -> set[str]:
    """The project modules `path` imports (`from a.b import c` counts a.b.c when
    that is a module, else a.b)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = module_name(path, root)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _skipped(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in known else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {m for m in found if m in known and m != here}


@functools.lru_cache(maxsize=1)
def project_graph() -> dict[str, set[str]]:
    files = [*PACKAGE.rglob("*.py"), *(ROOT / "experiments").rglob("*.py")]
    known = {module_name(f) for f in files}
    # a parent package counts as imported with its submodule (Python runs the package's __init__ first)
    return {module_name(f): imports_of(f, known) for f in files}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path [a, b, ..., a], or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = dfs(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = dfs(start)
            if cycle:
                return cycle
    return None


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_no_import_loops():
    cycle = find_cycle(project_graph())
    assert cycle is None, "import loop: " + " -> ".join(cycle)


def test_the_checker_finds_loops_and_lazy_imports(tmp_path):
    """The checker itself can fail: a lazy import closing a loop is found, and so is one in a `__main__`
    block; only `if TYPE_CHECKING:` imports are not counted."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    pkg = tmp_path / "slimwise"
    pkg.mkdir()
    src = pkg / "x.py"
    src.write_text("import os\nfrom typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                   "    import slimwise.w\n\ndef f():\n    from slimwise import y\n\n"
                   "if __name__ == '__main__':\n    import slimwise.z\n")
    known = {"slimwise.w", "slimwise.x", "slimwise.y", "slimwise.z"}
    assert imports_of(src, known, root=tmp_path) == {"slimwise.y", "slimwise.z"}


def test_the_package_never_imports_the_experiments():
    graph = project_graph()
    offenders = sorted(m for m, deps in graph.items() if m.startswith("slimwise")
                       and any(d.startswith("experiments") for d in deps))
    assert not offenders, offenders


@pytest.mark.parametrize("entry", ["slimwise.serving.plugin", "slimwise.serving.models",
                                   "slimwise.engines.vllm_engine", "slimwise.serving.server",
                                   "slimwise.export", "slimwise.engines.reference"])
def test_serving_and_the_reference_engine_never_load_the_trainer(entry):
    """vLLM workers import the plugin and the model classes; none of it may pull
    the trainer or the evaluation."""
    deps = reachable(project_graph(), entry)
    assert not {d for d in deps
                if d == "slimwise.distill" or d.startswith(("slimwise.evaluation", "experiments"))}

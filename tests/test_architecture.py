"""The layout's rules, checked on the source (no imports run): no import loops, nothing in `slimwise/` imports
the experiments, serving never loads the trainer or the evaluation, the layers (`LAYERS`: every module in one)
only import downward, serving never imports the engines, and only the vLLM integration imports vLLM. Function
size and complexity are ruff's (C901, PLR0915 in pyproject.toml).

Every import counts, module-level, inside functions (a lazy import is still a dependency: the old
generate -> distill -> generate loop was a lazy one), in a `if __name__ == "__main__":` block (an entry point
that imports a module importing it back is a loop too) and under `if TYPE_CHECKING:` (a type named from a
higher layer is a dependency on it; the module that needs it should own the type or a Protocol of it).
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


def imported_names(path: Path, known: set[str], root: Path = ROOT) -> set[str]:
    """Every module name `path` imports, anywhere in the file (module level, inside functions, under
    `if __name__ == "__main__":` and `if TYPE_CHECKING:`), relative imports resolved; `from a.b import c`
    counts a.b.c when that is a module of `known`, else a.b."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = module_name(path, root)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in known else base)
    return found


def imports_of(path: Path, known: set[str], root: Path = ROOT) -> set[str]:
    """The project modules `path` imports (`imported_names` among `known`, itself left out)."""
    here = module_name(path, root)
    return {m for m in imported_names(path, known, root) if m in known and m != here}


@functools.lru_cache(maxsize=1)
def project_graph() -> dict[str, set[str]]:
    files = [*PACKAGE.rglob("*.py"), *(ROOT / "experiments").rglob("*.py"), *(ROOT / "lab").rglob("*.py")]
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
    block or under `if TYPE_CHECKING:`."""
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
    assert imports_of(src, known, root=tmp_path) == {"slimwise.w", "slimwise.y", "slimwise.z"}


def test_the_package_never_imports_the_experiments():
    graph = project_graph()
    offenders = sorted(m for m, deps in graph.items() if m.startswith("slimwise")
                       and any(d.startswith("experiments") for d in deps))
    assert not offenders, offenders


def test_the_package_never_imports_the_lab():
    """The wheel ships slimwise/ without lab/: an import of the lab would fail in every install."""
    graph = project_graph()
    assert any(m.startswith("lab.") for m in graph)  # the scan sees the lab, so the check below can fail
    offenders = sorted(m for m, deps in graph.items() if m.startswith("slimwise")
                       and any(d == "lab" or d.startswith("lab.") for d in deps))
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


# ----- layers: each module in one, imports only downward --------------------------------------------------

#: the package's layers, lowest first; a module may import its own layer and the ones before it. An entry
#: names a module, or a package and everything under it (`pkg.*`). Placed by what each module imports, so a
#: test fails when a module reaches up (move the function to where it belongs rather than the module up).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("foundations", ("slimwise.errors", "slimwise.io", "slimwise.hooks", "slimwise.argtypes",
                     "slimwise.options", "slimwise.parent_death", "slimwise.devices", "slimwise.hardware",
                     "slimwise.embedded", "slimwise.safetensors_files")),
    ("model access", ("slimwise.adapters.*", "slimwise.models", "slimwise.quantized", "slimwise.fingerprint",
                      "slimwise.load_options", "slimwise.data", "slimwise.testbed.*")),
    ("statistics and plans", ("slimwise.stats", "slimwise.plan", "slimwise.criteria",
                              "slimwise.expert_parallel", "slimwise.baseline_plans", "slimwise.decode_gates",
                              "slimwise.gate_sidecar", "slimwise.plan_config")),
    ("decode routing", ("slimwise.decode_gate_ops", "slimwise.masking")),
    ("delta and export", ("slimwise.trainable", "slimwise.delta", "slimwise.checkpointing", "slimwise.export",
                          "slimwise.export_stream")),
    ("engines", ("slimwise.engines", "slimwise.engines.reference", "slimwise.scoring")),
    # the plugin, `slimwise serve` and the offline engine on vLLM's LLM API (which imports serving; serving
    # never imports it: `test_serving_never_imports_the_engines`)
    ("vLLM integration", ("slimwise.serving.*", "slimwise.engines.vllm_engine")),
    ("jobs", ("slimwise.calibrate", "slimwise.sequential", "slimwise.layer_budgets", "slimwise.distill",
              "slimwise.distill_config", "slimwise.footprint", "slimwise.evaluation.*", "slimwise.perf",
              "slimwise.perf.bench", "slimwise.perf.bench_config", "slimwise.perf.bench_report",
              "slimwise.perf.kernels", "slimwise.perf.mixes", "slimwise.perf.presets",
              "slimwise.perf.roofline", "slimwise.perf.timing", "slimwise.perf.vllm_traffic")),
    ("apps", ("slimwise", "slimwise.cli", "slimwise.demo", "slimwise.perf.cli")),
)

#: the modules that may import vLLM (module level, lazily or for type checking): the vLLM integration, and
#: the bench's timed runs and kernel fits
VLLM_IMPORTERS = ("slimwise.serving.*", "slimwise.engines.vllm_engine", "slimwise.perf.bench",
                  "slimwise.perf.timing", "slimwise.perf.kernels")


def _matches(module: str, entry: str) -> bool:
    return module == entry[:-2] or module.startswith(entry[:-1]) if entry.endswith(".*") else module == entry


def layer_of(module: str, layers=LAYERS) -> int | None:
    """The index of the layer whose table names `module` (None: in none)."""
    hits = [i for i, (_, entries) in enumerate(layers) for e in entries if _matches(module, e)]
    return hits[0] if len(hits) == 1 else None


def upward_imports(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    """Every import of a module from a higher layer, as 'module (layer) -> import (layer)'."""
    out = []
    for module, deps in sorted(graph.items()):
        here = layer_of(module, layers)
        for dep in sorted(deps):
            there = layer_of(dep, layers)
            if here is not None and there is not None and there > here:
                out.append(f"{module} ({layers[here][0]}) -> {dep} ({layers[there][0]})")
    return out


def _package_modules() -> list[str]:
    return sorted(m for m in project_graph() if m == "slimwise" or m.startswith("slimwise."))


def test_every_module_is_in_exactly_one_layer():
    """A new module gets a layer by name; a table entry that names no module is stale."""
    modules = _package_modules()
    assert not [m for m in modules if layer_of(m) is None], "modules in no layer (or in several)"
    stale = [e for _, entries in LAYERS for e in entries if not any(_matches(m, e) for m in modules)]
    assert not stale, stale


def test_no_module_imports_a_higher_layer():
    offenders = upward_imports({m: d for m, d in project_graph().items() if m.startswith("slimwise")})
    assert not offenders, "\n".join(offenders)


def test_serving_never_imports_the_engines():
    """The vLLM integration owns what both it and the offline engine need (hf_overrides, content keys): the
    engine imports serving, never the reverse."""
    graph = project_graph()
    offenders = sorted(f"{m} -> {d}" for m, deps in graph.items() if _matches(m, "slimwise.serving.*")
                       for d in deps if _matches(d, "slimwise.engines.*"))
    assert not offenders, offenders


def test_only_the_vllm_integration_imports_vllm():
    files = sorted(PACKAGE.rglob("*.py"))
    known = {module_name(f) for f in files}
    importers = {module_name(f) for f in files
                 if any(n == "vllm" or n.startswith("vllm.") for n in imported_names(f, known))}
    assert importers, "the scan found no vLLM import: it cannot fail"
    offenders = sorted(m for m in importers if not any(_matches(m, e) for e in VLLM_IMPORTERS))
    assert not offenders, offenders
    unused = [e for e in VLLM_IMPORTERS if not any(_matches(m, e) for m in importers)]
    assert not unused, f"allowed to import vLLM but does not: {unused}"


def test_the_layer_checks_can_fail(tmp_path):
    """An upward import, a module in no layer and a vLLM import outside the integration are all found."""
    layers = (("low", ("p.a",)), ("high", ("p.b", "p.c.*")))
    assert upward_imports({"p.a": {"p.b"}, "p.b": {"p.a"}}, layers) == ["p.a (low) -> p.b (high)"]
    assert upward_imports({"p.c.d": {"p.a", "p.c"}}, layers) == []
    assert layer_of("p.e", layers) is None and layer_of("p.c.d.e", layers) == 1
    pkg = tmp_path / "slimwise"
    pkg.mkdir()
    (pkg / "x.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                              "    from vllm.config import VllmConfig\n")
    assert "vllm.config" in imported_names(pkg / "x.py", set(), root=tmp_path)

"""The house's two halves and its layers (docs/development.md, "Code layout"): no import circle among the modules of
trnrecipes/, eval/ and recipes/ (imports inside functions and under TYPE_CHECKING counted), packages that import only
from the layers below them, and a torch-free side that never imports torch.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from conftest import REPO

# Lowest first: a package (or top-level module) imports only from those before it. "trnrecipes" is the package's
# __init__ (REPO_ROOT); "recipes" is the model zoo (its spec.py files are what config/families.py registers).
LAYERS = (
    "trnrecipes",
    "trnrecipes.schema",
    "recipes",
    "trnrecipes.config",
    "trnrecipes.plan",
    "trnrecipes.files",
    "trnrecipes.data",
    "trnrecipes.jobs",
    "trnrecipes.parallel",
    "trnrecipes.optim",
    "trnrecipes.backends",
    "trnrecipes.checkpoint",
    "trnrecipes.ops",
    "trnrecipes.models",
    "trnrecipes.train",
    "trnrecipes.convert",
    "trnrecipes.infer",
    "eval",
    "trnrecipes.cli",
    "trnrecipes.__main__",
)
TORCH_FREE = ("trnrecipes.schema", "trnrecipes.config", "trnrecipes.plan", "trnrecipes.files", "trnrecipes.jobs")
ROOTS = ("trnrecipes", "eval", "recipes")


def modules(root: Path, packages=ROOTS) -> dict[str, Path]:
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def import_graph(root: Path, packages=ROOTS) -> dict[str, set[str]]:
    """module -> the modules of `packages` it imports anywhere in its file (function bodies and TYPE_CHECKING
    blocks too). `from P import x` counts as P.x where P.x is a module, else as P."""
    known = modules(root, packages)

    def resolve(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(resolve(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.add(full if full in known else resolve(base))
        graph[name] = {t for t in targets if t and t != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def layer_of(module: str, root: Path = REPO) -> str:
    """The LAYERS entry a module belongs to: trnrecipes' subpackage, a top-level module, or eval/recipes whole."""
    parts = module.split(".")
    if parts[0] != "trnrecipes":
        return parts[0]
    if len(parts) > 1 and (root / "trnrecipes" / parts[1]).is_dir():
        return ".".join(parts[:2])
    return module


def collapsed(graph: dict[str, set[str]], group=layer_of) -> dict[str, set[str]]:
    """The graph between groups of modules (by default the layers): an edge wherever a module of one imports a module
    of another."""
    out: dict[str, set[str]] = {}
    for a, targets in graph.items():
        for b in targets:
            if group(a) != group(b):
                out.setdefault(group(a), set()).add(group(b))
    return out


def test_no_import_circle_among_modules():
    assert circles(import_graph(REPO)) == []


def test_every_package_imports_only_from_the_layers_below_it():
    graph = collapsed(import_graph(REPO))
    unplaced = sorted((set(graph) | {b for targets in graph.values() for b in targets}) - set(LAYERS))
    assert not unplaced, f"place these in LAYERS (and docs/development.md): {unplaced}"
    upward = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if LAYERS.index(b) > LAYERS.index(a))
    assert not upward, f"imports from a higher layer: {upward}"
    assert circles(graph) == []


def test_the_checks_find_a_circle_through_a_local_and_a_type_checking_import(tmp_path):
    (tmp_path / "pkg" / "low").mkdir(parents=True)
    (tmp_path / "pkg" / "high").mkdir()
    for d in ("pkg", "pkg/low", "pkg/high"):
        (tmp_path / d / "__init__.py").write_text("")
    type_only = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..high import b\n"
    (tmp_path / "pkg/low/a.py").write_text(type_only)
    (tmp_path / "pkg/high/b.py").write_text("def f():\n    from pkg.low.a import x\n")
    (tmp_path / "pkg/high/c.py").write_text("import pkg.low.d\n")
    (tmp_path / "pkg/low/d.py").write_text("from pkg.high import e\n")
    (tmp_path / "pkg/high/e.py").write_text("")
    graph = import_graph(tmp_path, ("pkg",))
    assert graph["pkg.low.a"] == {"pkg.high.b"} and graph["pkg.high.b"] == {"pkg.low.a"}
    assert circles(graph) == [["pkg.high.b", "pkg.low.a"]]
    del graph["pkg.high.b"]  # no module circle left: c -> d -> e, yet the packages low and high import each other
    assert circles(graph) == []
    assert circles(collapsed(graph, lambda m: ".".join(m.split(".")[:2]))) == [["pkg.high", "pkg.low"]]


def test_the_torch_free_half_imports_no_torch(tmp_path):
    """Every module of the torch-free packages, then the rendering verbs through the CLI, in a fresh interpreter."""
    names = sorted(m for m in modules(REPO, ("trnrecipes",)) if m.startswith(TORCH_FREE))
    assert len(names) >= 15, names  # the walk found the packages
    code = f"""
import importlib, sys
for name in {names!r}:
    importlib.import_module(name)
from trnrecipes.cli import main
assert main(["plan", "--recipe", "llama2-7b", "--nodes", "16"]) == 0  # data and storage checked: warnings
job = ["--out", {str(tmp_path / "job")!r}, "--no-data-check", "--overrides", "run_dir=/fsx/runs/n20"]
assert main(["sbatch", "--recipe", "neox20b", "--nodes", "4", *job]) == 0
print("HEAVY", sorted({{m.split(".")[0] for m in sys.modules}} & {{"torch", "numpy", "transformers", "pyarrow"}}))
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "HEAVY []" in done.stdout, done.stdout[-2000:]
    assert (tmp_path / "job" / "run.sbatch").is_file()

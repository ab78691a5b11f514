"""The import graph of waste/ (docs/ARCHITECTURE.md, "Layers"): a package imports only from tiers below its own,
and no module reaches itself through imports. Imports inside functions count: a lazy import is still an arrow."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "waste"

# Lowest first. A unit (a subpackage, or a module directly under waste/) may import units of lower tiers only;
# units of one tier do not import each other.
TIERS = [
    {"errors", "version", "kernel_cache"},
    {"units", "params", "timing", "numba_ptr", "triton_launch"},
    {"container", "quant"},
    {"layers"},
    {"runtime"},
    {"models"},
    {"text", "images"},
    {"convert"},
    {"default_model", "vision", "random_model"},
    {"hub", "chat"},
    {"engine"},
    {"serve", "chat_cli"},
    {"cli"},
    {"__init__", "__main__"},          # the package itself: waste.load(), python -m waste
]
RANK = {unit: i for i, tier in enumerate(TIERS) for unit in tier}


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(target: str) -> str:
    """The module a dotted name refers to: itself if it is a module or package, else its parent (an attribute)."""
    rel = Path(*target.split("."))
    if (ROOT.parent / rel).with_suffix(".py").is_file() or (ROOT.parent / rel / "__init__.py").is_file():
        return target
    return target.rpartition(".")[0]


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        mod = _module(path)
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        out = graph.setdefault(mod, set())
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                out |= {_resolve(a.name) for a in node.names if a.name.split(".")[0] == "waste"}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target.split(".")[0] == "waste":
                    out |= {_resolve(f"{target}.{a.name}") for a in node.names}
        out.discard(mod)
    return graph


def unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for a, targets in graph.items():
        for b in targets:
            ua, ub = unit(a), unit(b)
            if ua != ub and RANK[ub] >= RANK[ua]:
                bad.append(f"{a} imports {b} ({ub} is not below {ua})")
    return sorted(bad)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_unit_has_a_tier():
    units = {unit(m) for m in import_graph()}
    assert units - set(RANK) == set(), "place the new module or package in TIERS (and docs/ARCHITECTURE.md)"


def test_no_upward_import():
    assert upward_imports(import_graph()) == []


def test_no_cycle():
    assert cycles(import_graph()) == []


def test_the_checks_can_fail():
    """An upward arrow and a circle, made up, are both caught."""
    graph = {"waste.container.x": {"waste.models"}, "waste.models": {"waste.layers.a"},
             "waste.layers.a": {"waste.layers.b"}, "waste.layers.b": {"waste.layers.a"}}
    assert upward_imports(graph) == ["waste.container.x imports waste.models (models is not below container)"]
    assert cycles(graph) == [["waste.layers.a", "waste.layers.b"]]



QUIET = ("container", "quant", "layers", "runtime", "models", "text")   # options come in as arguments


def hidden_state(source: str) -> list[str]:
    """Reads of the environment and writes to the terminal in a module's source."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                (node.value.id, node.attr) in {("os", "environ"), ("os", "getenv"), ("sys", "stderr"), ("sys", "stdout")}:
            found.append(f"{node.value.id}.{node.attr} (line {node.lineno})")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
            found.append(f"print (line {node.lineno})")
    return found


def test_lower_tiers_read_no_environment_and_print_nothing():
    """The engine, the CLI and the server read WASTE_PRELOAD, WASTE_DUMP_DSA, OPENBLAS_NUM_THREADS and print; the
    packages below them take options as arguments and report through return values or callbacks."""
    bad = {str(p.relative_to(ROOT.parent)): found for p in sorted(ROOT.rglob("*.py"))
           if p.relative_to(ROOT).parts[0] in QUIET and (found := hidden_state(p.read_text(encoding="utf-8")))}
    assert bad == {}
    assert sorted(hidden_state("import os, sys\nx = os.environ.get('A')\nprint(x, file=sys.stderr)\n")) == \
        ["os.environ (line 2)", "print (line 3)", "sys.stderr (line 3)"]

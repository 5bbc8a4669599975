"""Imports point down the layers and never form a cycle (docs/design.md §1).

Read from the source with `ast`, nothing imported. In-function imports count too: they
exist for start-up time (a heavy third-party package loaded only by the command that needs
it), never to dodge a cycle.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pagedserve"

# Each layer and the layers it imports directly; what those import is allowed transitively.
# "pagedserve" is the package's own __init__ (no layer may need it but Python loads it).
DIRECT = {
    "paging": set(),
    "kernels": set(),
    "models": {"kernels"},
    "scheduler": {"paging"},
    # Grammars and matchers (llguidance): the scheduler's constraint and Guide types only.
    "structured": {"scheduler"},
    "engine": {"scheduler", "models", "structured"},
    "server": {"engine"},
    "bench": {"engine"},
    "cli": {"server", "bench", "engine"},
    "__main__": {"cli"},  # python -m pagedserve
    "pagedserve": set(),
}


def _allowed(layer: str) -> set[str]:
    seen, todo = set(), [layer]
    while todo:
        for dep in DIRECT[todo.pop()]:
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen | {layer, "pagedserve"}


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The pagedserve modules ``name`` imports anywhere in its source. ``from package import
    submodule`` counts as an import of the submodule (Python runs the package's __init__
    first either way, as it does for any module inside it)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                       for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:  # `import pagedserve.x.y` -> its module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "pagedserve"


def test_every_layer_is_known():
    assert {_layer(m) for m in MODULES} == set(DIRECT)


def test_imports_point_down_the_layers():
    wrong = sorted(f"{m} imports {t}" for m, targets in GRAPH.items() for t in targets
                   if _layer(t) not in _allowed(_layer(m)))
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles():
    # Tarjan's strongly connected components: any with more than one module is a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(GRAPH):
        if module not in index:
            visit(module)
    assert not cycles, cycles


def test_the_graph_sees_the_imports():
    """The checks above are only as good as the graph: spot-check a few known edges."""
    assert "pagedserve.engine.args" in GRAPH["pagedserve.server.cli"]
    assert "pagedserve.paging" in GRAPH["pagedserve.scheduler.scheduler"]
    assert "pagedserve.models.config" in GRAPH["pagedserve.models.loader"]  # relative import
    assert "pagedserve.kernels.cpu" in GRAPH["pagedserve.kernels"]  # in-function import


# The project's rule of no module over ~400 lines: one that grows past it is split by its
# jobs (scheduler/sequence.py into sampling_params.py and sequence.py, for one).
MAX_MODULE_LINES = 400


def test_no_module_is_over_the_line_limit():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, long

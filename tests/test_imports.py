"""The package's import structure, read from the source (nothing is imported):

- no backend package (kipp.reference, kipp.apple, kipp.cuda) imports another one: each depends
  only on the core and its own framework (the core reaches them by name, in kipp.chooser);
- no two kipp modules import each other, directly or through others, counting every import
  statement: module level, inside functions and under TYPE_CHECKING;
- the layers hold (LAYERS): the text and formats packages import nothing from the engine, the
  engine nothing from the API, the server or a backend package, a backend package nothing
  from the engine but its round planner; only the backend chooser (kipp.chooser) opens a
  backend package.

Each check is shown to catch a planted fault on a small package written to a temporary folder.
"""

import ast
from pathlib import Path

KIPP = Path(__file__).resolve().parent.parent / "kipp"
BACKEND_PACKAGES = ("kipp.reference", "kipp.apple", "kipp.cuda")
UPPER = ("kipp.model", "kipp.http", "kipp.cli", "kipp.doctor", "kipp.gates", "kipp.chooser")
# group -> module prefixes it must not import (a prefix names a package or a module)
LAYERS = {
    "kipp.text": ("kipp.engine", "kipp.synthetic") + UPPER + BACKEND_PACKAGES,
    "kipp.formats": ("kipp.engine",) + UPPER + BACKEND_PACKAGES,
    "kipp.synthetic": ("kipp.engine",) + UPPER + BACKEND_PACKAGES,
    "kipp.engine": UPPER + BACKEND_PACKAGES,
    "kipp.http": ("kipp.cli", "kipp.gates", "kipp.doctor", "kipp.chooser") + BACKEND_PACKAGES,
}
# A backend package reaches the core's arrays-level pieces only; its tooling modules (a kernel
# benchmark, the shard check) may use the gates and the chooser.
BACKEND_FORBIDDEN = ("kipp.engine", "kipp.text", "kipp.http", "kipp.model", "kipp.cli")
BACKEND_ALLOWED = ("kipp.engine.rounds",)
BACKEND_TOOLS = ("kipp.cuda.bench", "kipp.cuda.shard_check")


def _modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the package folder `root`."""
    modules = {}
    for path in root.rglob("*.py"):
        parts = (root.name,) + path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules `name` imports anywhere in its file. `from a import b` counts as
    importing a.b when that is a module, else a."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: climb from this module's package
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
    return {m for m in found if m in modules and m != name}


def import_graph(root: Path) -> dict[str, set[str]]:
    modules = _modules(root)
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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


def cross_backend_imports(graph: dict[str, set[str]], packages=BACKEND_PACKAGES) -> list[str]:
    def owner(module):
        return next((p for p in packages if module == p or module.startswith(p + ".")), None)

    return sorted(f"{m} imports {dep}" for m, deps in graph.items() for dep in deps
                  if owner(m) and owner(dep) and owner(m) != owner(dep))


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for module, deps in graph.items():
        for dep in deps:
            for group, forbidden in LAYERS.items():
                if _within(module, group) and any(_within(dep, f) for f in forbidden):
                    found.append(f"{module} imports {dep}")
            backend = any(_within(module, p) for p in BACKEND_PACKAGES)
            if (backend and module not in BACKEND_TOOLS
                    and any(_within(dep, f) for f in BACKEND_FORBIDDEN + UPPER)
                    and dep not in BACKEND_ALLOWED):
                found.append(f"{module} imports {dep}")
            if (not backend and module != "kipp.chooser"
                    and any(_within(dep, p) for p in BACKEND_PACKAGES)):
                found.append(f"{module} imports {dep} (only kipp.chooser opens a backend)")
    return sorted(set(found))


def test_the_layers_hold():
    assert layer_violations(import_graph(KIPP)) == []


def test_no_backend_package_imports_another():
    graph = import_graph(KIPP)
    assert {"kipp.apple.backend", "kipp.cuda.backend", "kipp.reference.backend"} <= set(graph)
    assert cross_backend_imports(graph) == []


def test_no_import_cycles():
    assert cycles(import_graph(KIPP)) == []


def test_the_checks_catch_planted_faults(tmp_path):
    pkg = tmp_path / "kipp"
    for folder in (pkg, pkg / "apple", pkg / "cuda"):
        folder.mkdir()
        (folder / "__init__.py").write_text("")
    (pkg / "apple" / "backend.py").write_text("from kipp.cuda.rounds import plan\n")
    (pkg / "cuda" / "rounds.py").write_text("def plan():\n    from kipp import model\n")
    (pkg / "model.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                  "    from kipp.session import Session\n")
    (pkg / "session.py").write_text("from . import model\n")
    graph = import_graph(pkg)
    assert cross_backend_imports(graph) == ["kipp.apple.backend imports kipp.cuda.rounds"]
    assert cycles(graph) == [["kipp.model", "kipp.session"]]


def test_the_layer_check_catches_planted_faults(tmp_path):
    pkg = tmp_path / "kipp"
    for folder in (pkg, pkg / "text", pkg / "engine", pkg / "cuda"):
        folder.mkdir()
        (folder / "__init__.py").write_text("")
    (pkg / "text" / "stops.py").write_text("from kipp.engine import blocks\n")
    (pkg / "engine" / "blocks.py").write_text("")
    (pkg / "engine" / "rounds.py").write_text("")
    (pkg / "engine" / "spec.py").write_text("import kipp.cuda.forward\n")
    (pkg / "cuda" / "forward.py").write_text("from kipp.engine import rounds, blocks\n")
    (pkg / "gates.py").write_text("def f():\n    from kipp.cuda import forward\n")
    assert layer_violations(import_graph(pkg)) == [
        "kipp.cuda.forward imports kipp.engine.blocks",
        "kipp.engine.spec imports kipp.cuda.forward",
        "kipp.engine.spec imports kipp.cuda.forward (only kipp.chooser opens a backend)",
        "kipp.gates imports kipp.cuda.forward (only kipp.chooser opens a backend)",
        "kipp.text.stops imports kipp.engine.blocks",
    ]

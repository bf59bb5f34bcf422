"""The package's layering: what each layer may import, and no import cycles.

Every import counts, module-level or inside a function, since a deferred
import is still a dependency. The rules are those of `docs/ARCHITECTURE.md`.
"""
from __future__ import annotations

import ast
import pathlib

import networkx as nx

ROOT = pathlib.Path(__file__).resolve().parent.parent / "autodist"

# Layer -> the layers it may import (besides itself).
ALLOWED = {
    "proto": set(),
    "ir": {"proto"},
    "kernels": {"ir", "proto"},
    "search": {"ir", "proto"},
    "launch": {"ir", "proto"},
    "models": {"ir"},
    "adapt": {"ir", "proto", "kernels", "search"},
    "plotting": {"ir", "proto", "search", "adapt"},
    "runtime": {"ir", "proto", "kernels", "search", "launch", "adapt", "models"},
    "api": {"ir", "proto", "kernels", "search", "launch", "adapt", "runtime", "models",
            "plotting"},
    "bench": {"ir", "proto", "kernels", "search", "launch", "adapt", "runtime", "models",
              "api", "plotting"},
    "cli": {"ir", "proto", "kernels", "search", "launch", "adapt", "runtime", "models",
            "api", "bench", "plotting"},
}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "api":
        return "api"
    return parts[1]


def _imports(path: pathlib.Path, module: str) -> set[str]:
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("autodist"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            if base.startswith("autodist"):
                # `from autodist.x import y` may name a module y or a name in x.
                for alias in node.names:
                    found.add(f"{base}.{alias.name}")
                found.add(base)
    return found


def _graph() -> nx.DiGraph:
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        for target in _imports(path, name):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                graph.add_edge(name, target)
    return graph


def test_every_layer_imports_only_what_it_may():
    wrong = [f"{a} -> {b}" for a, b in _graph().edges
             if _layer(b) != _layer(a) and _layer(b) not in ALLOWED[_layer(a)]]
    assert not wrong, "imports that cross the layering:\n" + "\n".join(sorted(wrong))


def test_no_import_cycles_between_modules():
    graph = _graph()
    # A package's __init__ importing its own submodules is not a cycle of concern.
    graph.remove_edges_from([(a, b) for a, b in list(graph.edges) if b.startswith(a + ".")])
    cycles = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    assert not cycles, f"import cycles: {cycles}"


def test_no_import_cycles_between_layers():
    layers = nx.DiGraph()
    for a, b in _graph().edges:
        if _layer(a) != _layer(b):
            layers.add_edge(_layer(a), _layer(b))
    assert nx.is_directed_acyclic_graph(layers), list(nx.simple_cycles(layers))

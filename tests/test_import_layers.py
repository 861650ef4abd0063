"""The import graph of services/: no cycles, and no module imports from a layer above its own.

Read from the source with ast (nothing is imported), so it takes well under a second. Imports under
`if TYPE_CHECKING:` and inside functions count too: a cycle through them is still a cycle to a reader.
The layers, lowest first, are in LAYERS; docs/architecture.md draws them.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (module prefix, layer): a module takes the layer of the longest prefix naming it. A module may import
# its own layer or lower ones; within one layer the graph must still have no cycle.
LAYERS = [
    ("services.errors", 0), ("services.settings", 0), ("services.token_trace", 0), ("services.rpc", 0),
    ("services.modes", 1), ("services.lifetime", 1), ("services.process_threads", 1), ("services.autogroup", 1),
    ("services.model", 2),
    ("services.kv", 3),
    ("services.engine", 4),
    ("services.prefill_gpu", 5), ("services.decode_fpga", 5),
    # the gateway's rooms, lowest first
    ("services.gateway", 6), ("services.gateway.metrics", 6),
    ("services.gateway.protocol", 7),
    ("services.gateway.output", 8),
    ("services.gateway.fleet", 9),
    ("services.gateway.routing", 10),
    ("services.gateway.dispatch", 11),
    ("services.gateway.api", 12), ("services.gateway.settings", 12),
    ("services.gateway.__main__", 13),
    # what starts the processes
    ("services.launcher", 14),
]
# layers side by side that must not import each other (the engines)
APART = [("services.prefill_gpu", "services.decode_fpga")]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the services modules it imports (a package's name only when nothing more precise is named)."""
    files = {module_name(p): p for p in (ROOT / "services").rglob("*.py")}
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                subs = {f"{source}.{a.name}" for a in node.names} & files.keys()
                deps.update(subs or {source})
        graph[name] = {d for d in deps if d in files and d != name}
    return graph


def layer(module: str) -> int:
    best = max((p for p, _ in LAYERS if module == p or module.startswith(p + ".")), key=len, default=None)
    assert best is not None, f"{module} has no layer: add it to LAYERS in tests/test_import_layers.py"
    return dict(LAYERS)[best]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan's algorithm)."""
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


def test_the_checks_see_what_they_check():
    graph = import_graph()
    # a few edges the services really have: if these vanish, the parser is what broke
    assert "services.errors" in graph["services.kv.handoff"]
    assert "services.gateway.protocol.errors" in graph["services.gateway.dispatch.dispatcher"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert layer("services.gateway.api.app") > layer("services.gateway.dispatch.dispatcher") > layer("services.engine")


def test_services_have_no_import_cycle():
    assert cycles(import_graph()) == []


def test_no_module_imports_from_a_layer_above_its_own():
    graph = import_graph()
    upward = sorted(f"{m} ({layer(m)}) imports {d} ({layer(d)})" for m, deps in graph.items() for d in deps
                    if layer(d) > layer(m))
    assert upward == []


def test_the_engines_do_not_import_each_other():
    graph = import_graph()
    crossing = sorted(f"{m} imports {d}" for a, b in APART for m, deps in graph.items() for d in deps
                      if (m.startswith(a) and d.startswith(b)) or (m.startswith(b) and d.startswith(a)))
    assert crossing == []

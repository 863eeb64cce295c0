"""No import cycle between the package's modules: the graph of module-level imports (``import``
and ``from ... import`` statements outside functions and classes, ``if TYPE_CHECKING`` blocks
left out), read with ``ast`` from the source, has no cycle.

Why module level only: those statements run when a module is first imported, so a cycle among
them makes the result depend on which module is imported first (a partially initialized module,
a name not defined yet). An import inside a function runs when the function is first called,
after every module is complete: that is how the package loads its parts lazily (Note [Lazy parts
of the package], functransforms/__init__.py; Note [Rule families load on first use],
functransforms/_core/ops.py), and it is allowed. Where two modules need each other at import time,
one of them binds its names into the other when it is imported instead (Note [The base class's
import cycles], linalg/_base.py)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# import name of each package -> its folder in the checkout (pyproject's package-dir mapping)
PACKAGES = {
    "functransforms": "functransforms",
    "functransforms.batching": "batching",
    "functransforms.autodiff": "autodiff",
    "functransforms.linalg": "linalg",
}


def _modules():
    """{module name: file} for every module of the package."""
    mods = {}
    for pkg, folder in PACKAGES.items():
        for f in sorted((ROOT / folder).rglob("*.py")):
            parts = list(f.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join([pkg, *parts])] = f
    return mods


def _module_level_imports(tree):
    """The import statements that run when the module is imported."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        todo.extend(ast.iter_child_nodes(node))


def _targets(name, is_package, node, mods):
    """The package modules an import statement of module ``name`` loads."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in mods]
    if node.level:
        base = name if is_package else name.rsplit(".", 1)[0]
        for _ in range(node.level - 1):
            base = base.rsplit(".", 1)[0]
        target = base + ("." + node.module if node.module else "")
    else:
        target = node.module or ""
    out = []
    for a in node.names:  # `from pkg import mod` loads pkg.mod; `from mod import name` loads mod
        sub = f"{target}.{a.name}"
        out.append(sub if sub in mods else target)
    return [t for t in out if t in mods and t != name]


def import_graph():
    mods = _modules()
    graph = {}
    for name, f in mods.items():
        tree = ast.parse(f.read_text(), str(f))
        is_package = f.name == "__init__.py"
        graph[name] = {
            t
            for node in _module_level_imports(tree)
            for t in _targets(name, is_package, node, mods)
        }
    return graph


def cycles(graph):
    """The strongly connected components of more than one module (Tarjan), and self-imports."""
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
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph[v]:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_the_package():
    graph = import_graph()
    assert "functransforms._core.levels" in graph and "functransforms.batching._tensor" in graph
    # an edge of each kind: relative, absolute, `from pkg import module`
    assert "functransforms._core.ops" in graph["functransforms._core.levels"]
    assert "functransforms._core.levels" in graph["functransforms.linalg._base"]
    assert "functransforms.linalg._rules" in graph["functransforms.linalg._base"]


def test_the_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_modules():
    found = cycles(import_graph())
    assert not found, (
        "import cycles between modules (module-level imports): "
        + "; ".join(" <-> ".join(c) for c in found)
        + ". Break them: move the shared piece into a module both import, or let one module bind "
        "its names into the other when it is imported (Note [The base class's import cycles])."
    )

"""The house rules, checked statically (ast, no imports run): no module over 500 lines in the production
packages, no import cycle among inferscale.* modules (kernels/, server/ and operator/ import as
inferscale.kernels, inferscale.server, inferscale.operator), imports under ``if TYPE_CHECKING:`` counted, and no
module reaching another module's private names."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"inferscale": ROOT / "inferscale", "inferscale.kernels": ROOT / "kernels",
            "inferscale.server": ROOT / "server", "inferscale.operator": ROOT / "operator"}
MAX_LINES = 500


def modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for pkg, base in PACKAGES.items():
        for path in base.rglob("*.py"):
            rel = path.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([pkg, *parts])
            if pkg == "inferscale" and parts and f"inferscale.{parts[0]}" in PACKAGES:
                continue  # never: kernels/server/operator are top-level directories
            out[name] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The inferscale modules ``name`` imports, at module level, inside a function or under ``if TYPE_CHECKING:``: a
    function-level import only defers a cycle, and a type-only one is a cycle between the two modules' concepts
    (each needs the other to be read), even though it never runs."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()

    class Visitor(ast.NodeVisitor):
        def visit_Import(self, node: ast.Import) -> None:
            out.update(a.name for a in node.names)

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            subs = {f"{base}.{a.name}" for a in node.names} & known
            out.update(subs)
            if len(subs) < len(node.names):  # some names are the package's own attributes
                out.add(base)

    Visitor().visit(tree)
    return {m for m in out if m in known and m != name}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    g: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps = imports(name, path, known)
        # Importing a submodule first imports its package (a package's __init__ importing back closes a cycle),
        # except the importer's own ancestors: they are loaded before it.
        ancestors = {name.rsplit(".", n)[0] for n in range(1, name.count(".") + 1)}
        parents = {d.rsplit(".", 1)[0] for d in deps if d.rsplit(".", 1)[0] in known} - ancestors
        g[name] = (deps | parents) - {name}
    return g


def test_no_module_over_500_lines():
    long = {str(p.relative_to(ROOT)): n for p in modules().values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_no_import_cycle_among_inferscale_modules():
    assert find_cycle(graph()) is None, f"import cycle: {' -> '.join(find_cycle(graph()) or [])}"


def test_type_only_imports_count_for_cycles(tmp_path):
    (tmp_path / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p import b\n")
    assert imports("p.a", tmp_path / "a.py", {"p.a", "p.b"}) == {"p.b"}


# Private names of libraries outside the house that production code must use (each with its reason).
LIBRARY_PRIVATES = {
    "_attn_implementation",  # transformers: a loaded model's attention backend has no public accessor
    "_version",  # torch: a tensor's in-place write counter (kernels/bf16_linear re-packs a written weight) has none
}


def own_private_names(tree: ast.AST) -> set[str]:
    """Names a module defines itself: its functions and classes, names it assigns, attributes it assigns on
    ``self``/``cls``, and keyword arguments it passes (``set_defaults(_module=...)`` names an attribute)."""
    own: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(n.name)
        elif isinstance(n, ast.keyword) and n.arg:
            own.add(n.arg)
        elif isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in n.targets if isinstance(n, ast.Assign) else [n.target]:
                for t in ast.walk(target) if isinstance(target, (ast.Tuple, ast.List)) else [target]:
                    if isinstance(t, ast.Name):
                        own.add(t.id)
                    elif isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in ("self", "cls"):
                        own.add(t.attr)
    return own


def private_reaches(path: Path) -> list[str]:
    """Where ``path`` reaches a private name (one leading underscore) it does not define: ``obj._name`` on
    anything but ``self``/``cls``, and ``from inferscale... import _name``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    own = own_private_names(tree) | LIBRARY_PRIVATES
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__"):
            if not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")) and n.attr not in own:
                out.append(f"{where}:{n.lineno}: {ast.unparse(n)}")
        elif isinstance(n, ast.ImportFrom) and (n.level or (n.module or "").startswith("inferscale")):
            out += [f"{where}:{n.lineno}: import {a.name}" for a in n.names
                    if a.name.startswith("_") and not a.name.startswith("__")]
    return out


def test_no_module_reaches_another_modules_private_names():
    found = [hit for p in modules().values() for hit in private_reaches(p)]
    assert not found, "private names reached from another module:\n" + "\n".join(found)


def test_the_private_check_sees_a_reach(tmp_path):
    (tmp_path / "m.py").write_text("class A:\n    def f(self, store):\n        self._x = 1\n"
                                   "        store._counters['n'] += self._x\n")
    assert [h.split(": ", 1)[1] for h in private_reaches(tmp_path / "m.py")] == ["store._counters"]


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_graph_sees_real_imports():
    g = graph()
    assert "inferscale.store.store" in g["inferscale.store"]  # from inferscale.store.store import ...
    assert "inferscale.memories" in g["inferscale.server.memories"]
    assert "inferscale.contract" in g["inferscale.server.memories"]

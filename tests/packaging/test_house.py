"""The house rules, checked statically (ast, no imports run): no module over 500 lines in the production
packages, and no import cycle among inferscale.* modules (kernels/, server/ and operator/ import as
inferscale.kernels, inferscale.server, inferscale.operator)."""

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
    """The inferscale modules ``name`` imports, at module level or inside a function: a function-level import
    only defers a cycle, it does not remove it. Imports under ``if TYPE_CHECKING:`` never run and do not count."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node: ast.If) -> None:
            if "TYPE_CHECKING" in ast.unparse(node.test):
                for stmt in node.orelse:
                    self.visit(stmt)
            else:
                self.generic_visit(node)

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


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_graph_sees_real_imports():
    g = graph()
    assert "inferscale.store.store" in g["inferscale.store"]  # from inferscale.store.store import ...
    assert "inferscale.memories" in g["inferscale.server.memories"]
    assert "inferscale.contract" in g["inferscale.server.memories"]

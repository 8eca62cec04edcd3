"""The imports of the product go one way: no module imports, even lazily or only for the type
checker, a module that (through others) imports it. A circle makes the import order matter and
ties the modules into one piece; the shared part goes down into a module both use."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support import ROOT

PACKAGE = ROOT / "agent_bus"  # bus/, agents/, tools/ and cli.py linked in (pyproject.toml)


def module_name(path: Path) -> str:
    parts = ["agent_bus", *path.relative_to(PACKAGE).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def product_modules() -> dict[str, Path]:
    # rglob does not enter linked folders: walk each link's target under its package name
    found = {module_name(path): path.resolve() for path in PACKAGE.glob("*.py")}
    for link in PACKAGE.iterdir():
        if link.is_dir() and link.name != "__pycache__":
            for path in link.resolve().rglob("*.py"):
                found[module_name(link / path.relative_to(link.resolve()))] = path
    return found


def imported_names(name: str, path: Path) -> list[tuple[str, list[str]]]:
    """Each import in `name`'s file (top level, functions, `if TYPE_CHECKING:`) as (module,
    names taken from it): `import a.b` is ("a.b", []), `from a import b, c` ("a", ["b", "c"]),
    relative imports resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: list[tuple[str, list[str]]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            out.append((base, [alias.name for alias in node.names]))
    return out


def project_imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules `name` imports: `from pkg import mod` is an import of `pkg.mod`, and
    of `pkg` itself only when it also takes a name that is not one of its modules."""
    out: set[str] = set()
    for module, names in imported_names(name, path):
        submodules = {f"{module}.{n}" for n in names} & known
        out |= submodules
        if len(submodules) < max(len(names), 1):
            out.add(module)
    return {m for m in out if m in known and m != name}


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle (as a path that ends where it starts), or [] when there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return []

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return []


def test_the_product_has_no_import_circle() -> None:
    modules = product_modules()
    graph = {name: project_imports(name, path, set(modules)) for name, path in modules.items()}
    # A package's __init__ re-exporting its modules is not a circle of its own making: a module
    # importing its package's __init__ is (the edge from `pkg` to `pkg.mod` is dropped).
    for name in graph:
        graph[name] = {m for m in graph[name] if not m.startswith(name + ".")}
    circle = _cycle(graph)
    assert not circle, "import circle: " + " -> ".join(circle)


def test_the_product_imports_itself_only_as_agent_bus() -> None:
    """`import bus` / `from tools import x` would load a second copy of a module (or another
    distribution's `agents`): every import of our own code names `agent_bus`."""
    modules = product_modules()
    wrong = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                     else [])
            wrong += [f"{name}: {n}" for n in names if n.split(".")[0] in ("bus", "agents", "tools", "cli", "commands")]
    assert len(modules) > 90 and not wrong, wrong

"""The package has no import cycle, counting the imports inside functions too: a cycle hidden behind a
function-local import is still a cycle (the modules cannot be understood, tested or moved apart)."""

import ast
from pathlib import Path

import ptq

PACKAGE = Path(ptq.__file__).parent


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(tree: ast.AST, name: str, is_package: bool, modules: set[str]) -> set[str]:
    """The package's modules that `name` imports anywhere in its source (module level, functions, classes).
    `from a import b` depends on the module a.b when it is one, else on a; a package's __init__ counts only
    where it is imported for itself."""
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [f"{source}.{alias.name}" for alias in node.names]
            targets = [t if t in modules else source for t in targets]
        else:
            continue
        for target in targets:
            # `import ptq.a.b` imports ptq.a.b (its packages' __init__ files are one line each, no imports)
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and target.split(".")[0] == PACKAGE.name:
                found.add(target)
    return found


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    paths = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    modules = set(paths)
    return {
        name: imported_modules(
            ast.parse(path.read_text(), str(path)), name, path.name == "__init__.py", modules
        )
        for name, path in paths.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a list of modules (the first repeated at the end), or None. Depth-first search."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 30 and "ptq.cli" in graph  # the walk found the package
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_function_local_and_relative_imports_count(tmp_path):
    """The checker itself: a cycle closed inside a function, through a relative import, is found."""
    pkg = tmp_path / "ptq"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from ptq.sub import b\n")
    (pkg / "sub" / "b.py").write_text("import os\nfrom . import c\n")
    (pkg / "sub" / "c.py").write_text("def f():\n    from ..a import x\n    return x\n")
    graph = import_graph(pkg)
    assert graph["ptq.a"] == {"ptq.sub.b"} and graph["ptq.sub.b"] == {"ptq.sub.c"}
    assert graph["ptq.sub.c"] == {"ptq.a"}
    assert find_cycle(graph) == ["ptq.a", "ptq.sub.b", "ptq.sub.c", "ptq.a"]
    (pkg / "sub" / "c.py").write_text("import ptq.sub.b as b\n")
    assert find_cycle(graph := import_graph(pkg)) == ["ptq.sub.b", "ptq.sub.c", "ptq.sub.b"], graph
    (pkg / "sub" / "c.py").write_text("import json\n")
    assert find_cycle(import_graph(pkg)) is None

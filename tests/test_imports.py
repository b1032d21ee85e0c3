"""The package's imports go one way, counting the imports inside functions too: no import cycle
between modules (a cycle hidden behind a function-local import is still a cycle: the modules cannot
be understood, tested or moved apart), and no stage imports a later stage (LAYERS)."""

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


# The package's layers, lowest first: a module may import its own layer's modules and those of lower
# layers, never a later layer's (module-level and function-local imports alike). A prefix names a
# module and the modules under it (`ptq.models` names ptq.models.loading).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # leaves: the package's version, errors, files (and which a model may be read from), progress lines, and the runtime (devices,
    # memory, the host allocator, distributed ranks) that every stage may use
    (
        "leaves",
        ("ptq", "ptq.errors", "ptq.files", "ptq.model_files", "ptq.progress", "ptq.runtime"),
    ),
    # number formats, granularities and the kernels that round to them
    ("numerics", ("ptq.numerics",)),
    # a model: loading it, and finding its matmuls
    ("models", ("ptq.models",)),
    # how a model is run, whole or layer by layer: batch sizes, placement, executors, streaming.
    # It needs only a model; calibration and evaluation run models through it, and what runs
    # (a quantized layer or not) is not its concern
    ("execution", ("ptq.execution",)),
    # recipes, the plan of what is quantized, and the modules that quantize a layer
    ("quantization", ("ptq.quantization",)),
    # observers, the calibration run, and the clips a calibration gives a recipe's static inputs
    ("calibration", ("ptq.calibration",)),
    # evaluation text, the evaluation loop, tasks, statistics, how a variant measures up
    ("evaluation", ("ptq.evaluation",)),
    # the search: units, sensitivity, selection under a budget, the held-out verdict
    ("search", ("ptq.search",)),
    # results.json, gates, report.md, trend and plots
    ("reporting", ("ptq.reporting",)),
    # the quantized checkpoint and the Hub
    ("export", ("ptq.export",)),
    # the commands' work, one function each
    ("commands", ("ptq.commands",)),
    # the command line
    ("cli", ("ptq.cli", "ptq.__main__")),
]


def layer_of(module: str, layers=LAYERS) -> int:
    """The index of the layer `module` belongs to. The package itself ("ptq") names only its
    __init__, so that a new top-level module must be given a layer."""
    for index, (_, prefixes) in enumerate(layers):
        for prefix in prefixes:
            if module == prefix or ("." in prefix and module.startswith(prefix + ".")):
                return index
    raise AssertionError(f"{module} is in no layer: add it to LAYERS")


def import_lines(root: Path = PACKAGE) -> dict[tuple[str, str], int]:
    """(importer, imported) -> the first line of the importer that imports it."""
    paths = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    modules = set(paths)
    lines: dict[tuple[str, str], int] = {}
    for name, path in paths.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                one = ast.Module(body=[node], type_ignores=[])
                for target in imported_modules(one, name, is_package, modules):
                    key = (name, target)
                    lines[key] = min(lines.get(key, node.lineno), node.lineno)
    return lines


def upward_imports(root: Path = PACKAGE, layers=LAYERS) -> list[str]:
    """Each import of a later layer's module, as 'importer (layer) line N imports module (layer)'."""
    found = []
    for (importer, imported), line in sorted(import_lines(root).items()):
        low, high = layer_of(importer, layers), layer_of(imported, layers)
        if high > low:
            found.append(
                f"{importer} ({layers[low][0]}) line {line} imports {imported} ({layers[high][0]})"
            )
    return found


def test_no_stage_imports_a_later_stage():
    assert len(import_lines()) > 30  # the walk found the package
    upward = upward_imports()
    assert not upward, "imports of a later layer:\n" + "\n".join(upward)


def test_every_module_is_in_a_layer():
    for module in import_graph():
        layer_of(module)


def test_an_upward_import_is_reported(tmp_path):
    """The checker itself: an import of a later layer, inside a function, is found with its line;
    the same import downward is not."""
    pkg = tmp_path / "ptq"
    (pkg / "low").mkdir(parents=True)
    (pkg / "high").mkdir()
    for init in (pkg, pkg / "low", pkg / "high"):
        (init / "__init__.py").write_text("")
    (pkg / "high" / "top.py").write_text("from ptq.low import base\n")
    (pkg / "low" / "base.py").write_text("import os\n\n\ndef f():\n    from ..high.top import x\n")
    layers = [("base", ("ptq", "ptq.low")), ("top", ("ptq.high",))]
    assert upward_imports(pkg, layers) == ["ptq.low.base (base) line 5 imports ptq.high.top (top)"]
    (pkg / "low" / "base.py").write_text("import os\n")
    assert upward_imports(pkg, layers) == []

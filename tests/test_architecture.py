"""The import graph of opt_serving, read from the source with `ast` (module-level imports; an import inside a
function runs late and is allowed for optional or heavy dependencies, see docs/architecture.md): no circles,
production code never imports opt_serving.testing, and every import points to the same or a lower layer."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "opt_serving"

GROUND, BACKEND, MODEL, RUNNER, ENGINE, TEXT, SERVICE = range(7)
NAMES = ["ground", "backend", "model", "runner", "engine", "text", "service"]

# Each module's layer (a prefix names a package and everything in it; the longest prefix wins). The rule: a
# module imports only modules of its own layer or below. Where a folder's modules sit is decided by what they
# import: parallel/ is the runner's (the planner sizes the prefix cache, the stage actors run runner stages, the
# alpa/ backend builds runners) but for sharding.py (how the model's params split over a mesh: model and
# backend only) and cli.py (`opt-serving plan`, an entry point); checkpoint/ is a converter, an entry point used
# only by the CLI (it reads the model's weight layouts and installs the tokenizer); batch is an entry point
# beside the service. backend/sampling.py is the token choice the backend plugs its kernels into.
LAYERS = {
    "opt_serving": GROUND,  # the package itself (empty __init__)
    "opt_serving.config": GROUND,
    "opt_serving.errors": GROUND,
    "opt_serving.settings": GROUND,
    "opt_serving.spec": GROUND,
    "opt_serving.jax_env": GROUND,
    "opt_serving.xla_cache": GROUND,
    "opt_serving.startlog": GROUND,
    "opt_serving.backend": BACKEND,
    "opt_serving.model": MODEL,
    "opt_serving.parallel.sharding": MODEL,
    "opt_serving.runner": RUNNER,
    "opt_serving.parallel": RUNNER,
    "opt_serving.engine": ENGINE,  # the scheduler, admission, its types, the fake slot model
    "opt_serving.text": TEXT,
    "opt_serving.service": SERVICE,
    "opt_serving.batch": SERVICE,
    "opt_serving.batch_io": SERVICE,
    "opt_serving.models": SERVICE,  # get_model(), the notebook's entry point
    "opt_serving.cli": SERVICE,
    "opt_serving.__main__": SERVICE,
    "opt_serving.parallel.cli": SERVICE,
    "opt_serving.checkpoint": SERVICE,
}
TESTING = "opt_serving.testing"


def modules() -> dict[str, tuple[Path, bool]]:
    """Every module of the package: dotted name -> (file, is a package's __init__)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if package else parts)] = (path, package)
    return found


MODULES = modules()


def _resolve(module: str, package: bool, node: ast.AST) -> set[str]:
    """The opt_serving modules an import statement loads (`from a import b` is module a.b where that exists)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            parts = module.split(".") if package else module.split(".")[:-1]
            parts = parts[:len(parts) - node.level + 1]
            base = ".".join(parts + ([node.module] if node.module else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
    out = set()
    for name in names:
        while name not in MODULES and "." in name:
            name = name.rsplit(".", 1)[0]
        if name in MODULES and name != module:
            out.add(name)
    return out


def _module_level(body):
    """The import statements that run when the module is imported: its body's, and those under a module-level
    if/try/with or in a class body; not those inside functions."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _type_checking(node.test):
            yield from _module_level(node.orelse)  # `if TYPE_CHECKING:` never runs
        elif isinstance(node, (ast.If, ast.Try, ast.With, ast.ClassDef)):
            for field in ("body", "orelse", "finalbody"):
                yield from _module_level(getattr(node, field, []))
            for handler in getattr(node, "handlers", []):
                yield from _module_level(handler.body)


def _type_checking(test: ast.AST) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_graph(module_level: bool = True) -> dict[str, set[str]]:
    """module -> the opt_serving modules it imports (module-level ones, or every import with False)."""
    graph = {}
    for module, (path, package) in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        nodes = _module_level(tree.body) if module_level else (
            n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)))
        graph[module] = set().union(*(_resolve(module, package, n) for n in nodes))
    return graph


def layer(module: str) -> int:
    prefix = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len, default=None)
    if prefix is None:
        raise KeyError(module)
    return LAYERS[prefix]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), each as a sorted list."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


GRAPH = import_graph()


def test_the_graph_is_read():
    # the reader sees the imports it is meant to (a reader that found nothing would pass every rule)
    assert "opt_serving.engine.types" in GRAPH["opt_serving.engine.scheduler"]
    assert "opt_serving.model.wrapper" in GRAPH["opt_serving.model.loader"]
    assert "opt_serving.service.app" in GRAPH["opt_serving.service"]
    assert len(MODULES) > 80 and sum(map(len, GRAPH.values())) > 200


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_package_root_holds_only_the_ground_floor_and_the_entry_points():
    """The other layers are folders (text/, engine/, runner/, parallel/, model/, backend/), so the tree reads
    as the layers do."""
    root = [m for m, (path, package) in MODULES.items() if m.count(".") == 1 and not package]
    assert len(root) > 5
    assert [m for m in root if layer(m) not in (GROUND, SERVICE)] == []


def test_no_import_circles():
    assert cycles(GRAPH) == []


def test_production_code_never_imports_the_test_helpers():
    wrong = {m: sorted(i for i in imports if i == TESTING or i.startswith(TESTING + "."))
             for m, imports in import_graph(module_level=False).items()
             if not (m == TESTING or m.startswith(TESTING + "."))}
    assert {m: i for m, i in wrong.items() if i} == {}


def test_every_module_has_a_layer():
    assert [m for m in MODULES if not m.startswith(TESTING) and _layer_or_none(m) is None] == []


def _layer_or_none(module):
    try:
        return layer(module)
    except KeyError:
        return None


@pytest.mark.parametrize("module", sorted(m for m in MODULES if not m.startswith(TESTING)))
def test_imports_point_down_the_layers(module):
    up = sorted(f"{i} ({NAMES[layer(i)]})" for i in GRAPH[module]
                if not i.startswith(TESTING) and layer(i) > layer(module))
    assert up == [], f"{module} ({NAMES[layer(module)]}) imports a higher layer"

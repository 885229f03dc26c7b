"""House rules of the package's size (issue "modules of one concern"): no module of opt_serving over 450 lines
(the Python and the C++ of csrc/), and no Python function or method over 60 lines, so that each module holds one
concern and reads top to bottom. A module or function that grows past them is split where its concern splits.

The modules and functions still over them are named in KNOWN, each being split; the test fails for any offender
not named there, and for any name there that is no longer an offender (take it off: the list only shrinks)."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "opt_serving"
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 60

# the offenders left, each being split by its own change: "path" for a module, "path:qualified.name" for a function
KNOWN: set[str] = set()  # none now


def sources() -> list[Path]:
    return sorted([*PACKAGE.rglob("*.py"), *(PACKAGE / "csrc").glob("*.cc"), *(PACKAGE / "csrc").glob("*.h")])


def functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, lines) of every function and method, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node.end_lineno - node.lineno + 1  # from its `def` to its last line
            yield from functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from functions(node, f"{prefix}{node.name}.")


def offenders() -> dict[str, str]:
    """Every module over MAX_MODULE_LINES and function over MAX_FUNCTION_LINES -> what it measures."""
    found = {}
    for path in sources():
        name = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES:
            found[name] = f"{lines} lines"
        if path.suffix == ".py":
            for qualname, n in functions(ast.parse(text, str(path))):
                if n > MAX_FUNCTION_LINES:
                    found[f"{name}:{qualname}"] = f"{n} lines"
    return found


def test_no_new_module_over_450_lines_nor_function_over_60():
    found = offenders()
    new = {k: v for k, v in found.items() if k not in KNOWN}
    assert not new, ("over the limits (split them where their concern splits):\n"
                     + "\n".join(f"  {k}: {v}" for k, v in sorted(new.items())))


def test_the_known_offenders_are_all_still_over_the_limits():
    gone = sorted(KNOWN - set(offenders()))
    assert not gone, "no longer over the limits, take them off KNOWN:\n" + "\n".join(f"  {k}" for k in gone)


def test_the_reader_sees_every_module_and_measures_functions():
    # a walk that found nothing would pass every rule
    paths = sources()
    assert len(paths) > 100 and any(p.suffix == ".cc" for p in paths) and any(p.suffix == ".h" for p in paths)
    tree = ast.parse("class A:\n    def f(self):\n        def g():\n            pass\n        return g\n")
    assert dict(functions(tree)) == {"A.f": 4, "A.f.g": 2}

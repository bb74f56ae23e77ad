"""The package's import graph, read from the source: no cycles, few imports inside functions, and no path from
the model half to DeepSpeed (statically, and by importing the modules in a fresh interpreter).

Edges are module-level and function-level imports (`if TYPE_CHECKING:` blocks are type-only and skipped);
`from P import N` is an edge to the module P.N when that is a module, else to P.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "glm53_ds"

# The model half (and the DeepSpeed-free layers below it): nothing here may reach DeepSpeed.
MODEL_HALF = ("config", "backends", "compat", "mhc", "layers", "model", "specs", "transformer_config",
              "transformer_layer", "parallel")  # fmt: skip
# Package imports inside functions stay a handful: optional heavy kernels (Triton, only where it runs: DSA attention,
# the DSA indexer, hc_post's forward and backward, mHC's Sinkhorn, block FP8) and the lazy `glm53_ds.build_engine`.
MAX_FUNCTION_LEVEL = 7


def modules(root: str, package: str) -> dict[str, str]:
    """module name -> file path for every .py under root/package."""
    out = {}
    for directory, _, files in os.walk(os.path.join(root, package)):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                rel = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__")] = path
    return out


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def imports(
    module: str, path: str, known: dict[str, str], type_only: bool = False
) -> Iterator[tuple[str, bool]]:
    """(imported module, inside a function?) for every import in `path` (TYPE_CHECKING blocks skipped unless
    `type_only`)."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    skip = set() if type_only else _type_checking_lines(tree)
    is_package = path.endswith("__init__.py")
    base = module.split(".") if is_package else module.split(".")[:-1]
    in_function: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for child in ast.walk(node):
                if isinstance(child, ast.Import | ast.ImportFrom):
                    in_function.add(id(child))
    for node in ast.walk(tree):
        if not isinstance(node, ast.Import | ast.ImportFrom) or node.lineno in skip:
            continue
        inner = id(node) in in_function
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, inner
            continue
        if node.level:
            parent = base[: len(base) - node.level + 1]
            target = ".".join(parent + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        for alias in node.names:
            candidate = f"{target}.{alias.name}"
            yield (candidate if candidate in known else target), inner


def graph(
    root: str, package: str, type_only: bool = False
) -> tuple[dict[str, set[str]], list[tuple[str, str]]]:
    """Edges between the package's modules and to outside modules; the function-level package imports.
    `type_only`: type-only imports (`if TYPE_CHECKING:`) are edges too."""
    known = modules(root, package)
    edges: dict[str, set[str]] = {m: set() for m in known}
    function_level = []
    for module, path in known.items():
        for target, inner in imports(module, path, known, type_only):
            edges[module].add(target)
            if inner and target.startswith(package):
                function_level.append((module, target))
    return edges, function_level


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (or a module importing itself), Tarjan."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in edges:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges.get(v, ()):
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def reachable(edges: dict[str, set[str]], start: str) -> dict[str, str]:
    """Every module reachable from `start` -> the module it was reached from."""
    seen = {start: start}
    todo = [start]
    while todo:
        v = todo.pop()
        for w in edges.get(v, ()):
            if w not in seen:
                seen[w] = v
                todo.append(w)
    return seen


def _path(seen: dict[str, str], end: str) -> list[str]:
    path = [end]
    while seen[path[-1]] != path[-1]:
        path.append(seen[path[-1]])
    return path[::-1]


def _is_model_half(module: str) -> bool:
    parts = module.split(".")
    return len(parts) > 1 and parts[1] in MODEL_HALF


def test_no_cycles():
    edges, _ = graph(ROOT, PACKAGE)
    assert cycles(edges) == []


def test_no_cycles_even_through_type_only_imports():
    """Two modules that import each other only for types still depend on each other (training/config.py and
    option_checks.py did: the declarations now come first, the checks import them)."""
    edges, _ = graph(ROOT, PACKAGE, type_only=True)
    assert cycles(edges) == []
    assert "glm53_ds.training.config" in edges["glm53_ds.training.option_checks"]
    assert "glm53_ds.training.option_checks" not in edges["glm53_ds.training.config"]


def test_control_a_synthetic_cycle_is_caught(tmp_path):
    pkg = tmp_path / "cyc"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import a\n")  # through a function, too
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n")
    edges, function_level = graph(str(tmp_path), "cyc")
    assert cycles(edges) == [["cyc.a", "cyc.sub.b"]]
    assert function_level == [("cyc.sub.b", "cyc.a")]
    assert "cyc.a" not in edges["cyc.c"]  # type-only imports are not edges
    (pkg / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .. import a\n"
    )
    assert cycles(graph(str(tmp_path), "cyc")[0]) == []  # a type-only cycle: none by the first rule ...
    assert cycles(graph(str(tmp_path), "cyc", type_only=True)[0]) == [
        ["cyc.a", "cyc.sub.b"]
    ]  # ... but by this


def test_few_package_imports_inside_functions():
    _, function_level = graph(ROOT, PACKAGE)
    assert len(function_level) <= MAX_FUNCTION_LEVEL, function_level


def test_no_path_from_the_model_half_to_deepspeed():
    edges, _ = graph(ROOT, PACKAGE)
    half = [m for m in edges if _is_model_half(m)]
    assert len(half) > 20
    for module in half:
        seen = reachable(edges, module)
        bad = [
            m
            for m in seen
            if m == "deepspeed" or m.startswith("deepspeed.") or m.startswith(f"{PACKAGE}.engine")
        ]
        assert not bad, f"{module} reaches {bad[0]}: {' -> '.join(_path(seen, bad[0]))}"
        # the distributed layer (parallel/) is below the model: it may not import the model's modules
        if module.startswith(f"{PACKAGE}.parallel"):
            upward = [
                m
                for m in seen
                if _is_model_half(m) and m.split(".")[1] not in ("parallel", "config", "compat")
            ]
            assert not upward, f"{module} reaches {upward[0]}: {' -> '.join(_path(seen, upward[0]))}"


@pytest.mark.slow
def test_importing_the_model_half_loads_no_deepspeed():
    """At run time too (package __init__ files and third-party imports included): a fresh interpreter."""
    edges, _ = graph(ROOT, PACKAGE)
    names = sorted(m for m in edges if _is_model_half(m) and not m.endswith("hc_post_triton"))
    code = "import sys\n" + "".join(f"import {m}\n" for m in names)
    code += "import glm53_ds\nprint(sorted(m for m in sys.modules if m.split('.')[0] == 'deepspeed'))\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_deepspeed_initialize_is_called_in_one_module():
    calls = []
    for directory in (
        os.path.join(ROOT, PACKAGE),
        os.path.join(ROOT, "tests"),
        os.path.join(ROOT, "benchmarks"),
    ):
        for path in sorted(p for d, _, fs in os.walk(directory) for p in (os.path.join(d, f) for f in fs)):
            if path.endswith(".py") and path != os.path.abspath(__file__):
                if "deepspeed.initialize(" in open(path, encoding="utf-8").read():
                    calls.append(os.path.relpath(path, ROOT))
    assert calls == [os.path.join(PACKAGE, "engine", "build.py")]

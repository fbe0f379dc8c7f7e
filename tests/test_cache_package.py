"""The jaxgen.cache package: every kind honours the `Cache` protocol, each module imports on
its own, the modules' imports form no circle, and no private name crosses a module."""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

from jaxgen.cache import CACHE_KINDS, Cache, GrowableCache, make_cache

CACHE_DIR = pathlib.Path(__file__).resolve().parent.parent / "jaxgen" / "cache"
MODULES = sorted(path.stem for path in CACHE_DIR.glob("*.py") if path.stem != "__init__")
SHAPE = dict(num_layers=2, batch=2, max_len=8, num_kv_heads=1, head_dim=4, sliding_window=4)


def _imports(path: pathlib.Path) -> list[tuple[str, list[str]]]:
    """(absolute module, imported names) for every import statement of a jaxgen.cache file."""
    package = "jaxgen.cache"
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative to jaxgen.cache (level 1) or above
                base = package.rsplit(".", node.level - 1)[0]
                module = f"{base}.{module}" if module else base
            out.append((module, [alias.name for alias in node.names]))
    return out


@pytest.mark.parametrize("kind", CACHE_KINDS)
def test_every_kind_is_a_cache(kind):
    cache = make_cache(kind, **SHAPE)
    assert isinstance(cache, Cache)
    assert cache.kind == kind
    # growing needs `resize`; the ring has a fixed number of slots
    assert isinstance(cache, GrowableCache) == (kind != "sliding_window")


@pytest.mark.parametrize("module", MODULES)
def test_module_imports_alone(module):
    """A fresh interpreter importing one module first: an import circle fails here."""
    result = subprocess.run([sys.executable, "-c", f"import jaxgen.cache.{module}"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr


def test_no_private_names_cross_modules():
    offenders = []
    for path in sorted(CACHE_DIR.glob("*.py")):
        for module, names in _imports(path):
            if not module.startswith("jaxgen"):
                continue
            private = [n for n in names if n.startswith("_")]
            private += [p for p in module.split(".") if p.startswith("_")]
            if private:
                offenders.append(f"{path.name}: from {module} import {private}")
    assert not offenders, offenders


def test_module_graph_has_no_circle_and_factory_is_on_top():
    """The imports between jaxgen.cache modules form a DAG; only __init__ imports factory."""
    graph = {}
    for path in CACHE_DIR.glob("*.py"):
        deps = set()
        for module, names in _imports(path):
            if module == "jaxgen.cache":  # `from jaxgen.cache import X` reads __init__
                deps.add("__init__")
            elif module.startswith("jaxgen.cache."):
                deps.add(module.split(".")[2])
        graph[path.stem] = deps
    assert all(("factory" not in deps) for name, deps in graph.items() if name != "__init__")
    assert all(("__init__" not in deps) for name, deps in graph.items())

    state: dict[str, str] = {}

    def visit(node, trail):
        if state.get(node) == "done":
            return
        assert state.get(node) != "open", f"import circle: {' -> '.join(trail + [node])}"
        state[node] = "open"
        for dep in sorted(graph.get(node, ())):
            visit(dep, trail + [node])
        state[node] = "done"

    for node in sorted(graph):
        visit(node, [])

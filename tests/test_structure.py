"""The house's structure: floors, no import circle, the plan as the only dispatcher.

Floors (docs/DESIGN.md): a module may import modules of its own floor or below, never
above; `jaxgen/models/` (installed as jaxgen.models) sees floor 1 only. Imports under
`if TYPE_CHECKING:` are annotations and do not count.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "jaxgen"
MODELS = ROOT / "models"

FLOORS = {
    4: ("jaxgen.cli.main", "jaxgen.cli.batch", "jaxgen.cli.compile_cache", "jaxgen.cli.assisted",
        "jaxgen.api.text", "jaxgen.train"),
    3: ("jaxgen.generate", "jaxgen.api.plan", "jaxgen.drivers.chunked", "jaxgen.drivers.growing",
        "jaxgen.runtime.compiled", "jaxgen.speculative.uad.align", "jaxgen.speculative.uad.bridge", "jaxgen.drivers.uad",
        "jaxgen.constraints.compile", "jaxgen.drivers.prefix_hook", "jaxgen.runtime.executable_cache"),
    2: ("jaxgen.loops.decode", "jaxgen.loops.beam", "jaxgen.core.step", "jaxgen.speculative", "jaxgen.loops.guidance"),
    1: ("jaxgen.config.generation", "jaxgen.config.checks", "jaxgen.core.state", "jaxgen.core.output",
        "jaxgen.core.contracts", "jaxgen.cache", "jaxgen.logits.chain", "jaxgen.logits.history",
        "jaxgen.logits.position", "jaxgen.logits.warpers", "jaxgen.logits.sampling",
        "jaxgen.stopping", "jaxgen.stopping.strings", "jaxgen.drivers.streamers", "jaxgen.core.extensions",
        "jaxgen.stopping.criteria", "jaxgen.logits.watermark.green_list", "jaxgen.logits.watermark.rng",
        "jaxgen.logits.watermark.detect", "jaxgen.logits.watermark.synthid", "jaxgen.logits.watermark.synthid_detect",
        "jaxgen.constraints.automaton",
        "jaxgen.loops.guidance_inputs", "jaxgen.backends.cpu.kernels"),
    0: ("jaxgen.models",),
}


def floor_of(module: str) -> int:
    for floor, prefixes in FLOORS.items():
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return floor
    raise AssertionError(f"{module} is on no floor: add it to FLOORS and to docs/DESIGN.md")


def modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    for path in MODELS.rglob("*.py"):
        parts = ("jaxgen", "models") + path.relative_to(MODELS).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    found.pop("jaxgen")  # the facade re-exports the public API from every floor
    return found


def _type_checking_nodes(tree) -> set[int]:
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in ast.walk(node):
                skipped.add(id(child))
    return skipped


def imports_of(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    tree = ast.parse(path.read_text())
    skipped = _type_checking_nodes(tree)
    out = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            targets = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name and target != "jaxgen":
                out.add(target)
    return out


GRAPH = None


def graph() -> dict[str, set[str]]:
    global GRAPH
    if GRAPH is None:
        found = modules()
        GRAPH = {name: imports_of(name, path, set(found)) for name, path in found.items()}
    return GRAPH


def test_every_module_is_on_a_floor():
    for name in graph():
        floor_of(name)


@pytest.mark.parametrize("name", sorted(modules()))
def test_no_import_from_a_higher_floor(name):
    mine = floor_of(name)
    if mine == 0:  # models: floor 1 only
        allowed = lambda other: floor_of(other) <= 1  # noqa: E731
    else:
        allowed = lambda other: floor_of(other) <= mine  # noqa: E731
    higher = sorted(other for other in graph()[name] if not allowed(other))
    assert not higher, f"{name} (floor {mine}) imports from a higher floor: {higher}"


def test_no_import_circle():
    edges = graph()
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt == node or nxt.startswith(node + ".") or node.startswith(nxt + "."):
                continue  # a package and its own modules
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt]
                raise AssertionError("import circle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)


def test_only_the_compiled_module_holds_generate_jits():
    """No module-level jit chosen by positional static_argnums outside jaxgen.runtime.compiled."""
    for name, path in modules().items():
        text = path.read_text()
        assert "static_argnums" not in text, f"{name} uses positional static_argnums"
        if name != "jaxgen.runtime.compiled" and not name.startswith("jaxgen.models"):
            tree = ast.parse(text)
            for node in tree.body:  # module level only
                if isinstance(node, ast.Assign) and "jax.jit(" in ast.unparse(node.value):
                    raise AssertionError(f"{name} defines a module-level jit: "
                                         f"{ast.unparse(node)[:80]}")


def test_nothing_points_outside_the_repository():
    needles = ("../shared", "shared/DESIGN", "DESIGN s.", "issue #")
    for path in list(PACKAGE.rglob("*.py")) + list(MODELS.rglob("*.py")) + [ROOT / "README.md"]:
        text = path.read_text()
        for needle in needles:
            assert needle not in text, f"{path.relative_to(ROOT)} points outside: {needle!r}"

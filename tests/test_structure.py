"""The house's structure, as rules per package (docs/DESIGN.md, "The house"):

1. Floors. Every top-level package of jaxgen sits on a floor (FLOORS); a module imports
   modules of its own package or of a lower floor, never of its floor or above. The one
   top-level module beside the facade is `jaxgen/__main__.py` (`python -m jaxgen`), on the
   top floor: it runs the jaxgen command.
2. No import circle, at any level: inside every package, the rooms (its modules and its
   sub-packages, a folder counting as one room) import each other without a circle.
3. One seam. `jaxgen.backends` is imported only by `jaxgen.runtime.backend` (and by itself).
4. The facade `jaxgen/__init__.py` re-exports the public API; nothing below it imports it.

Every import counts: module level, inside functions, under `if TYPE_CHECKING:`. Relative
imports are resolved. Docstring examples are not imports.
"""
from __future__ import annotations

import ast
import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "jaxgen"

# Top-level packages of jaxgen, lowest floor first. A package imports only lower floors.
FLOORS = {
    "jaxgen.cache": 0,        # KV caches and attention over them
    "jaxgen.storage": 0,      # private cache folders and files, keyed checksums
    "jaxgen.notices": 0,      # announcements lower floors make for higher ones (model loads)
    "jaxgen.config": 1,       # GenerationConfig, field checks, watermarking settings
    "jaxgen.stopping": 2,     # stop reasons, criteria, stop strings
    "jaxgen.logits": 2,       # the processor chain, warpers, sampling, watermarking
    "jaxgen.models": 2,       # model families, loaders, tokenizers, shipped weights
    "jaxgen.constraints": 3,  # regex / JSON schema -> token automaton
    "jaxgen.backends": 3,     # XLA:CPU kernels and layouts (reached through runtime.backend)
    "jaxgen.core": 4,         # contracts, state, output, extensions, step pieces
    "jaxgen.loops": 5,        # decode, beam, guidance
    "jaxgen.runtime": 5,      # the compiled programs, the executable cache, the backend seam
    "jaxgen.speculative": 6,  # the assisted loop, drafters, UAD
    "jaxgen.drivers": 7,      # chunked, growing, streamers, prefix hook, UAD rounds
    "jaxgen.api": 8,          # generate, generate_ids, generate_text, the plan
    "jaxgen": 9,              # the facade (jaxgen/__init__.py)
    "jaxgen.serving": 9,      # continuous batching: the engine, generate_batch (the facade
    #                           reaches it by name, lazily, so beside it is below the cli)
    "jaxgen.cli": 10,         # the jaxgen command
    "jaxgen.train": 10,       # training recipes for drafters
    "jaxgen.__main__": 11,    # `python -m jaxgen`: runs the jaxgen command (a module)
}
ENTRY_MODULES = ("__init__.py", "__main__.py")  # a package's facade and its `python -m`
SEAM = "jaxgen.runtime.backend"


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, pathlib.Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _resolve(name: str, path: pathlib.Path, node: ast.ImportFrom) -> str:
    """The absolute module a (possibly relative) `from ... import` names."""
    if not node.level:
        return node.module or ""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    base = package[:len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The jaxgen modules `name` imports (a name imported from a package that is a module of
    it counts as that module)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(name, path, node)
            targets = [f"{base}.{alias.name}" for alias in node.names]
            targets = [t for t in targets if t in known] or [base]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


_GRAPH: dict[str, set[str]] = {}


def graph() -> dict[str, set[str]]:
    if not _GRAPH:
        found = modules()
        _GRAPH.update({name: imports_of(name, path, set(found)) for name, path in found.items()})
    return _GRAPH


def top_package(module: str) -> str:
    """The floor-holding package of a module (the facade for `jaxgen` itself)."""
    parts = module.split(".")
    return "jaxgen" if len(parts) == 1 else ".".join(parts[:2])


def test_every_top_level_room_is_a_package_on_a_floor():
    for path in PACKAGE.iterdir():
        if path.suffix == ".py" and path.name not in ENTRY_MODULES:
            raise AssertionError(f"jaxgen/{path.name}: a module at the top level; put it in "
                                 f"the package of its concern")
        if path.is_dir() and (path / "__init__.py").exists():
            assert f"jaxgen.{path.name}" in FLOORS, f"jaxgen/{path.name}/ is on no floor"


@pytest.mark.parametrize("name", sorted(modules()))
def test_imports_go_down_the_floors(name):
    mine = top_package(name)
    wrong = sorted(other for other in graph()[name]
                   if top_package(other) != mine
                   and FLOORS[top_package(other)] >= FLOORS[mine])
    assert not wrong, (f"{name} (floor {FLOORS[mine]}) imports from its floor or above: "
                       f"{[(w, FLOORS[top_package(w)]) for w in wrong]}")


def room_edges() -> dict[str, dict[str, set[str]]]:
    """For every package, the imports between its rooms (modules and sub-packages)."""
    rooms: dict[str, dict[str, set[str]]] = {}
    for source, targets in graph().items():
        for target in targets:
            a, b = source.split("."), target.split(".")
            depth = 0
            while depth < min(len(a), len(b)) and a[depth] == b[depth]:
                depth += 1
            if depth == 0 or depth == len(a) or depth == len(b):
                continue  # another top level, or a package and its own __init__
            parent = ".".join(a[:depth])
            edges = rooms.setdefault(parent, {})
            edges.setdefault(a[depth], set()).add(b[depth])
    return rooms


def test_no_import_circle_at_any_level():
    for parent, edges in sorted(room_edges().items()):
        state: dict[str, int] = {}
        path: list[str] = []

        def visit(node):
            state[node] = 1
            path.append(node)
            for nxt in sorted(edges.get(node, ())):
                if state.get(nxt) == 1:
                    cycle = path[path.index(nxt):] + [nxt]
                    raise AssertionError(f"import circle in {parent}: " + " -> ".join(cycle))
                if nxt not in state:
                    visit(nxt)
            path.pop()
            state[node] = 2

        for node in sorted(edges):
            if node not in state:
                visit(node)


def test_backends_are_reached_only_through_the_seam():
    for name, targets in graph().items():
        if name == SEAM or name.startswith("jaxgen.backends"):
            continue
        reached = sorted(t for t in targets if t.startswith("jaxgen.backends"))
        assert not reached, f"{name} imports a backend directly: {reached} (use {SEAM})"


def test_the_portable_core_names_no_cpu_machinery():
    """Outside the backends, only the CLI (its defaults) mentions the CPU layouts."""
    needles = re.compile(r"JAXGEN_LAYER_LAYOUT|kernel_matrix|layer_split|few_rows")
    for name, path in modules().items():
        if name.startswith(("jaxgen.backends", "jaxgen.cli")):
            continue
        hits = [line for line in path.read_text().splitlines() if needles.search(line)]
        assert not hits, f"{name} names CPU machinery: {hits[:2]}"


def test_nothing_below_the_facade_imports_it():
    for name, targets in graph().items():
        if FLOORS[top_package(name)] < FLOORS["jaxgen"]:
            assert "jaxgen" not in targets, f"{name} imports the facade `jaxgen`"


def test_only_the_compiled_module_holds_generate_jits():
    """No module-level jit chosen by positional static_argnums outside jaxgen.runtime.compiled."""
    for name, path in modules().items():
        text = path.read_text()
        assert "static_argnums" not in text, f"{name} uses positional static_argnums"
        if name != "jaxgen.runtime.compiled" and not name.startswith("jaxgen.models"):
            for node in ast.parse(text).body:  # module level only
                if isinstance(node, ast.Assign) and "jax.jit(" in ast.unparse(node.value):
                    raise AssertionError(f"{name} defines a module-level jit: "
                                         f"{ast.unparse(node)[:80]}")


def test_no_environment_variable_changes_a_traced_program():
    """Layouts are arguments jit keys on; only the CLI reads layout defaults from the
    environment (JAXGEN_CPU_KERNELS, the kernel build switch, is in every cache key)."""
    for name, path in modules().items():
        if name.startswith("jaxgen.cli"):
            continue
        assert "JAXGEN_LAYER_LAYOUT" not in path.read_text(), name


def test_file_names_say_one_thing():
    """No module name occurs twice in the package (a newcomer's search finds one file)."""
    seen: dict[str, str] = {}
    for name in modules():
        leaf = name.rsplit(".", 1)[-1]
        if name == "jaxgen" or pathlib.Path(modules()[name]).name in ENTRY_MODULES:
            continue
        assert leaf not in seen, f"{name} and {seen[leaf]} share a file name"
        seen[leaf] = name


def test_nothing_points_outside_the_repository():
    needles = ("../shared", "shared/DESIGN", "DESIGN s.", "issue #", "/work/", "/root/",
               "/home/")
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    paths = [ROOT / p for p in tracked.stdout.split()
             if p.endswith((".py", ".md", ".json", ".toml", ".ipynb"))
             and p != "tests/test_structure.py"] if tracked.returncode == 0 else []
    paths = paths or list(PACKAGE.rglob("*.py")) + [ROOT / "README.md"]
    for path in paths:
        text = path.read_text(errors="replace")
        for needle in needles:
            assert needle not in text, f"{path.relative_to(ROOT)} points outside: {needle!r}"


def _sets_xla_flags(statement: ast.stmt) -> bool:
    """Whether a module-level statement writes os.environ["XLA_FLAGS"]."""
    return any(isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store)
               and isinstance(node.slice, ast.Constant) and node.slice.value == "XLA_FLAGS"
               for node in ast.walk(statement))


def test_no_test_module_sets_the_device_count_on_import():
    """The test suite imports every tests/*.py module (doctests): a script that simulates 8
    devices at import would give the whole worker 8 devices (no kernel, no layouts, no
    executable cache). Scripts set XLA_FLAGS under `if __name__ == "__main__":` or in a
    function."""
    offenders = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for statement in tree.body:
            if isinstance(statement, (ast.If, ast.FunctionDef, ast.ClassDef)):
                continue  # guarded or deferred
            if _sets_xla_flags(statement):
                offenders.append(f"{path.name}:{statement.lineno}")
    assert offenders == [], offenders

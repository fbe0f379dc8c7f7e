"""The notebooks in notebooks/ run top to bottom (nbclient, a fresh kernel each) and say what
they should; in git they are stored without outputs.

The quickstart runs in the default suite; the vmap sweep, the speculative explorer and the
sharding walkthrough (several SmolLM2 compiles each, one on 6 simulated devices) and the Flax
model (SmolLM2 as a Flax NNX module) are slow.
"""
from __future__ import annotations

import importlib
import os
import pathlib

import pytest
from model_fixtures import require_smollm2_package

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
EXPECTED = {  # notebook -> texts its outputs must contain
    "01_quickstart.ipynb": ["Paris", "one device: no mesh needed"],
    "02_vmap_sweep.ipynb": ["programs compiled for the whole grid: 1", "image/png"],
    "03_speculative_explorer.ipynb": ["prompt lookup", "early exit (E=24)", "image/png"],
    "04_sharding.ipynb": ["same tokens as one device: True", "programs compiled: 2",
                          "num_heads (9)", "0.33 of it per device"],
    "05_flax_model.ipynb": ["same tokens as jaxgen's Llama: True", "Paris",
                            "prompt lookup, same tokens as greedy: True", "missing vocab_size"],
}
SLOW = {"02_vmap_sweep.ipynb", "03_speculative_explorer.ipynb", "04_sharding.ipynb",
        "05_flax_model.ipynb"}


def _require(module: str):
    """The test extras install nbclient / nbformat / ipykernel: their absence is a broken
    environment, so the test fails (it does not skip)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        pytest.fail(f"{module} is missing: pip install -e '.[test]' (nbclient, nbformat, "
                    f"ipykernel)", pytrace=False)


def test_every_notebook_is_tested():
    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_notebook_is_stored_without_outputs(name):
    nbformat = _require("nbformat")
    book = nbformat.read(NOTEBOOKS / name, as_version=4)
    for index, cell in enumerate(book.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, (
                f"{name} cell {index} stores outputs: clear them before committing")


def _outputs_text(book) -> str:
    parts = []
    for cell in book.cells:
        for output in cell.get("outputs", []):
            parts.append(output.get("text", ""))
            for kind, value in output.get("data", {}).items():
                parts.append(kind)
                if kind == "text/plain":
                    parts.append(value)
    return "\n".join(parts)


def _run(name: str) -> None:
    require_smollm2_package()
    nbformat, nbclient = _require("nbformat"), _require("nbclient")
    _require("ipykernel")
    book = nbformat.read(NOTEBOOKS / name, as_version=4)
    env_flags = os.environ.pop("XLA_FLAGS", None)  # each kernel starts JAX its own way
    try:
        nbclient.NotebookClient(book, timeout=900, kernel_name="python3",
                                resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    finally:
        if env_flags is not None:
            os.environ["XLA_FLAGS"] = env_flags
    text = _outputs_text(book)
    missing = [want for want in EXPECTED[name] if want not in text]
    assert not missing, f"{name}: outputs lack {missing}:\n{text[-3000:]}"


@pytest.mark.parametrize("name", sorted(set(EXPECTED) - SLOW))
def test_notebook_runs(name):
    _run(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SLOW))
def test_slow_notebook_runs(name):
    _run(name)

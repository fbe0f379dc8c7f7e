"""Shared test setup: the tests folder is importable (stubs, fixtures)."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))


import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops JAX's compiled programs after each test module. Without it a full run
    (hundreds of compiled programs kept alive in one process) crashed with SIGSEGV inside
    XLA's compiler at the same test twice, a test that passes alone; the suspected cause is
    the process running out of memory mappings (vm.max_map_count = 65530 here)."""
    yield
    jax.clear_caches()

"""Shared test setup: the tests folder is importable (stubs, fixtures); fixtures more than one
module uses."""
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


@pytest.fixture
def drafter_folder(tmp_path) -> str:
    """A saved one-layer MTP drafter folder for the tiny Llama (the loader tests)."""
    from jaxgen.models import tiny_llama
    from jaxgen.models.mtp_drafter import MtpDrafterConfig, MtpDrafterModel
    from jaxgen.models.mtp_drafter_io import save_mtp_drafter

    target, _ = tiny_llama()
    drafter = MtpDrafterModel(MtpDrafterConfig.for_target(
        target.config, hidden_size=8, intermediate_size=16, num_layers=1))
    return save_mtp_drafter(drafter, drafter.init_params(jax.random.key(0)),
                            str(tmp_path / "drafter"))

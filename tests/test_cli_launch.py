"""The `jaxgen` command's entry point: Ctrl-C / SIGTERM while jax and the command load give one
line and exit 130 / 143, never a traceback (jaxgen.cli.launch)."""
from __future__ import annotations

import signal
import subprocess
import sys

import pytest

# The child blocks inside the import of jaxgen.cli.main (the heavy part of the start), after
# saying so: the signal lands exactly in the window the launcher covers.
CHILD = r"""
import importlib.abc, sys, time
class Slow(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "jaxgen.cli.main":
            print("loading", flush=True)
            time.sleep(60)
        return None
sys.meta_path.insert(0, Slow())
from jaxgen.cli.launch import main
raise SystemExit(main(["hello"]))
"""


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_during_start_up_is_one_line_and_the_shell_code(signum, code):
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "loading"
        child.send_signal(signum)
        _, stderr = child.communicate(timeout=30)
    finally:
        child.kill()
    assert child.returncode == code
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines() == ["jaxgen: error: interrupted"]


def test_importing_jaxgen_loads_no_jax():
    """The facade is lazy: the launcher's handlers are in place before jax loads."""
    probe = ("import sys, jaxgen, jaxgen.cli.launch; print('jax' in sys.modules); "
             "from jaxgen import generate; print('jax' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            timeout=120, check=True)
    assert result.stdout.split() == ["False", "True"]


def test_python_dash_m_jaxgen_runs_the_command():
    """`python -m jaxgen` is the `jaxgen` console script (jaxgen/__main__.py)."""
    result = subprocess.run([sys.executable, "-m", "jaxgen", "--help"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: jaxgen "), result.stdout[:200]
    assert "--input" in result.stdout and "--max-new-tokens" in result.stdout

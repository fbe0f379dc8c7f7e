"""The built wheel: it holds every module, the kernels' sources and header, the shipped weights
and the training prompts, and installed into a fresh virtual environment (outside the checkout)
the native CPU kernels build from the installed files and compute the right products.

The wheel is built from a copy of the working tree (pyproject.toml, README.md, jaxgen/) in a
temporary folder, so setuptools' build/ and egg-info folders neither land in the checkout nor
leak files of an earlier build into the wheel. Every temporary folder (the build's, the venv, the
kernels' cache via $XDG_CACHE_HOME) is removed afterwards; nothing is written to ~/.cache.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jaxgen"
KERNELS = "jaxgen/backends/cpu/kernels"
WEIGHTS = "jaxgen/models/weights"
TRAIN_DATA = "jaxgen/train/data"
# project files the build reads besides the package (the ones present are copied)
PROJECT_FILES = ("pyproject.toml", "README.md", "setup.py", "setup.cfg", "MANIFEST.in", "LICENSE")
IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "dist")

# Run inside the venv: build and run both kernels from the installed package, print a JSON report.
CHECK_SCRIPT = textwrap.dedent("""
    import json, os, sys, warnings
    warnings.simplefilter("always")
    with warnings.catch_warnings(record=True) as caught:
        import numpy as np
        import jax, jax.numpy as jnp
        import jaxgen
        from jaxgen.backends.cpu.kernels import build, few_rows, quantized_rows

        report = {"jaxgen": jaxgen.__file__, "kernels_dir": str(build.SOURCE.parent),
                  "cache_dir": str(build.cache_dir()), "setting": build.kernel_setting(),
                  "backend": jax.default_backend()}
        report["target"] = build.ffi_target()
        report["available"] = few_rows.available()
        report["group_rows"] = build.group_rows()
        if report["available"]:
            rng = np.random.default_rng(0)
            x = rng.standard_normal((3, 37)).astype(np.float32)    # [M, K]
            w = rng.standard_normal((21, 37)).astype(np.float32)   # [N, K]
            got = np.asarray(jax.jit(few_rows.few_rows_product)(jnp.asarray(x), jnp.asarray(w)))
            want = x.astype(np.float64) @ w.T.astype(np.float64)
            report["few_rows_shape"] = list(got.shape)
            report["few_rows_close"] = bool(np.allclose(got, want, rtol=1e-5, atol=1e-4))
            report["few_rows_max_error"] = float(np.abs(got - want).max())

        report["quantized_target"] = build.quantized_target()
        report["quantized_available"] = quantized_rows.available()
        if report["quantized_available"]:
            rng = np.random.default_rng(1)
            codes = rng.integers(-127, 128, (19, 64)).astype(np.int8)                # [N, K]
            scale = (rng.random((19, 2)) * 0.1 + 0.01).astype(np.float32)          # [N, G = 2]
            x = rng.standard_normal((2, 64)).astype(np.float32)                    # [M, K]
            assert quantized_rows.runs(64, codes.dtype, 2)
            got = np.asarray(jax.jit(quantized_rows.quantized_product)(
                jnp.asarray(x), jnp.asarray(codes), jnp.asarray(scale)))
            weight = codes.astype(np.float64) * np.repeat(scale, 32, axis=1)       # [N, K]
            seen = np.asarray(quantized_rows.rounded_rows(jnp.asarray(x), 2))      # as it rounds
            want = seen.astype(np.float64) @ weight.T
            report["quantized_shape"] = list(got.shape)
            report["quantized_close"] = bool(np.allclose(got, want, rtol=1e-5, atol=1e-4))
            report["quantized_max_error"] = float(np.abs(got - want).max())
    report["warnings"] = [str(w.message) for w in caught]
    print("REPORT " + json.dumps(report))
""")


def _source_files(pattern_root: str, pattern: str) -> set[str]:
    """Package-relative posix paths of the files under ROOT/pattern_root matching pattern."""
    return {path.relative_to(ROOT).as_posix() for path in (ROOT / pattern_root).glob(pattern)
            if path.is_file() and "__pycache__" not in path.parts}


def _clean_env(tmp: Path) -> dict:
    """The environment for every subprocess: no PYTHONPATH, no inherited kernel settings, caches
    (pip's, the kernels') under tmp."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "JAXGEN_KERNEL_DIR",
                        "JAXGEN_CPU_KERNELS", "PYTHONSTARTUP")}
    env.update(XDG_CACHE_HOME=str(tmp / "cache"), PIP_NO_CACHE_DIR="1",
               PIP_DISABLE_PIP_VERSION_CHECK="1", JAX_PLATFORMS="cpu")
    return env


def _run(command, cwd: Path, env: dict, timeout: int = 600) -> str:
    result = subprocess.run([str(c) for c in command], cwd=cwd, env=env, capture_output=True,
                            text=True, timeout=timeout, check=False)
    assert result.returncode == 0, (
        f"{' '.join(map(str, command))} failed ({result.returncode}):\n"
        f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    return result.stdout


def _scratch():
    """A temporary folder, removed afterwards (pass or fail)."""
    return tempfile.TemporaryDirectory(prefix="jaxgen-test-wheel-", ignore_cleanup_errors=True)


@pytest.fixture(scope="module")
def wheel():
    """A wheel built from a copy of the working tree."""
    with _scratch() as scratch:
        yield _build_wheel(Path(scratch))


@pytest.fixture
def scratch():
    with _scratch() as folder:
        yield Path(folder)


def _build_wheel(tmp: Path) -> Path:
    source = tmp / "source"
    source.mkdir()
    for name in PROJECT_FILES:
        if (ROOT / name).is_file():
            shutil.copy2(ROOT / name, source / name)
    shutil.copytree(PACKAGE, source / "jaxgen", ignore=IGNORED)
    out = tmp / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
          "--no-cache-dir", "-w", out, source], cwd=tmp, env=_clean_env(tmp))
    wheels = list(out.glob("jaxgen-*.whl"))
    assert len(wheels) == 1, f"expected one jaxgen wheel, got {wheels}"
    return wheels[0]


def test_wheel_holds_modules_kernel_sources_weights_and_training_data(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = _source_files("jaxgen", "**/*.py")
    kernel_files = _source_files(KERNELS, "*.cc") | _source_files(KERNELS, "*.h")
    weights = _source_files(WEIGHTS, "**/*")
    train_data = _source_files(TRAIN_DATA, "*.jsonl")
    # the globs found something (a moved folder would otherwise make these checks vacuous)
    assert {"jaxgen/__init__.py", f"{KERNELS}/few_rows.py", f"{KERNELS}/build.py"} <= modules
    assert {f"{KERNELS}/few_rows.cc", f"{KERNELS}/few_rows.h",
            f"{KERNELS}/quantized_rows.cc"} <= kernel_files
    assert weights and train_data
    for kind, files in [("modules", modules), ("kernel sources and headers", kernel_files),
                        ("shipped weights", weights), ("training data", train_data)]:
        missing = sorted(files - names)
        assert not missing, f"the wheel lacks {len(missing)} {kind}: {missing[:20]}"


def test_installed_wheel_builds_and_runs_the_cpu_kernels(wheel, scratch):
    env = _clean_env(scratch)
    venv = scratch / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", venv], cwd=scratch, env=env)
    python, pip = venv / "bin" / "python", venv / "bin" / "pip"
    _run([pip, "install", "--no-deps", "--force-reinstall", "--no-cache-dir", wheel],
         cwd=scratch, env=env)
    script = scratch / "check_kernels.py"
    script.write_text(CHECK_SCRIPT)
    work = scratch / "work"  # outside the checkout: the wheel's jaxgen, not the editable one
    work.mkdir()
    stdout = _run([python, script], cwd=work, env=env)
    report = json.loads(next(line for line in stdout.splitlines()
                             if line.startswith("REPORT "))[len("REPORT "):])
    site = venv.resolve()
    assert Path(report["jaxgen"]).resolve().is_relative_to(site), report["jaxgen"]
    assert Path(report["kernels_dir"]).resolve().is_relative_to(site), report["kernels_dir"]
    cache = (scratch / "cache" / "jaxgen" / "kernels").resolve()
    assert Path(report["cache_dir"]).resolve() == cache
    assert report["backend"] == "cpu" and report["setting"] == "auto"
    assert report["target"] == "jaxgen_few_rows", report["warnings"]
    assert report["available"] and report["group_rows"] in (4, 8), report
    assert report["few_rows_shape"] == [3, 21] and report["few_rows_close"], report
    assert report["quantized_target"] == "jaxgen_quantized_rows", report["warnings"]
    assert report["quantized_available"], report
    assert report["quantized_shape"] == [2, 19] and report["quantized_close"], report
    # built now, from the installed sources, into the fresh cache
    built = sorted(p.name for p in cache.glob("*.so"))
    assert any(n.startswith("few_rows-") for n in built), built
    assert any(n.startswith("quantized_rows-") for n in built), built

"""Compile the native kernels (`few_rows.cc`, `quantized_rows.cc`) with the system C++ compiler on first use and register it with XLA.

The shared library lands in a cache folder ($JAXGEN_KERNEL_DIR, else
$XDG_CACHE_HOME/jaxgen/kernels, else ~/.cache/jaxgen/kernels) under a name that hashes the
sources, the flags, jaxlib's version, the compiler's version and the CPU's feature flags, so a
later process loads it without compiling (about 10 s) and a changed machine or jaxlib builds
its own. $JAXGEN_CPU_KERNELS=off never builds; when building fails (no compiler, no FFI
headers) `ffi_target()` returns None once with a warning that says why, and callers run
XLA's own products.

Example:
    >>> from jaxgen.kernels.build import kernel_setting
    >>> kernel_setting() in ("auto", "off")
    True
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import tempfile
import warnings
from pathlib import Path

import jax
import jaxlib

SOURCES = tuple(Path(__file__).with_name(name)
                for name in ("few_rows.cc", "quantized_rows.cc"))  # one library
HEADERS = (Path(__file__).with_name("few_rows.h"),)
TARGETS = {"jaxgen_few_rows": "JaxgenFewRows",  # FFI target name: the library's handler
           "jaxgen_quantized_rows": "JaxgenQuantizedRows"}
TARGET_NAME = "jaxgen_few_rows"  # what ffi_target() names: float32 weights
QUANTIZED_TARGET_NAME = "jaxgen_quantized_rows"  # int8 / 4-bit codes
SETTING_VARIABLE = "JAXGEN_CPU_KERNELS"
SETTINGS = ("auto", "off")
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-w")
NATIVE_FLAGS = ("-march=native",)  # dropped if the compiler refuses them


def kernel_setting() -> str:
    """$JAXGEN_CPU_KERNELS ("auto" when unset); any other value than SETTINGS is a ValueError."""
    setting = os.environ.get(SETTING_VARIABLE, "auto").strip().lower() or "auto"
    if setting not in SETTINGS:
        raise ValueError(f"{SETTING_VARIABLE}={setting!r} is not a kernel setting; "
                         f"expected one of {', '.join(SETTINGS)}")
    return setting


def cache_dir() -> Path:
    """Where built kernels are kept."""
    if os.environ.get("JAXGEN_KERNEL_DIR"):
        return Path(os.environ["JAXGEN_KERNEL_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "jaxgen" / "kernels"


def _compiler() -> str:
    return os.environ.get("CXX", "c++")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.machine()


def _library_name(flags: tuple[str, ...]) -> str:
    version = subprocess.run([_compiler(), "--version"], capture_output=True, text=True,
                             timeout=60).stdout
    digest = hashlib.sha256("\n".join([
        *(path.read_text() for path in SOURCES + HEADERS), " ".join(flags), jaxlib.__version__, version, _cpu_flags(),
    ]).encode()).hexdigest()[:16]
    return f"few_rows-{digest}.so"


def _compile(target: Path, flags: tuple[str, ...]) -> None:
    """Build into a temporary file beside target, then rename it (atomic: parallel test
    workers may build at once)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, scratch = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(handle)
    try:
        command = [_compiler(), *flags, f"-I{jax.ffi.include_dir()}", *map(str, SOURCES), "-o",
                   scratch]
        result = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if result.returncode:
            raise RuntimeError(f"{' '.join(command)} failed: {result.stderr.strip()[-2000:]}")
        os.replace(scratch, target)
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)


def _load_library() -> ctypes.CDLL:
    errors = []
    for flags in (FLAGS + NATIVE_FLAGS, FLAGS):
        try:
            target = cache_dir() / _library_name(flags)
            if not target.exists():
                _compile(target, flags)
            return ctypes.CDLL(str(target))
        except (OSError, RuntimeError, subprocess.SubprocessError) as error:
            errors.append(str(error))
    raise RuntimeError("; ".join(errors))


def ffi_target() -> str | None:
    """The registered FFI target's name, or None when kernels are off (read on every call) or
    cannot be built (warned once, with the reason)."""
    return None if kernel_setting() == "off" else _registered_target()


_LOADED: list = []  # the library registered in this process (read by group_rows)


@functools.cache
def _registered_target() -> str | None:
    try:
        library = _load_library()
        for name, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(library, symbol)),
                                        platform="cpu")
        _LOADED[:] = [library]
    except (RuntimeError, AttributeError, OSError) as error:
        warnings.warn(f"jaxgen: the CPU few-row kernel is not available ({error}); decoding "
                      f"runs XLA's own products (set {SETTING_VARIABLE}=off to silence this)",
                      RuntimeWarning, stacklevel=2)
        return None
    return TARGET_NAME


def quantized_target() -> str | None:
    """The FFI target of the quantized-weight kernel (same library, same conditions)."""
    return None if ffi_target() is None else QUANTIZED_TARGET_NAME


def group_rows() -> int:
    """Input rows the built kernel streams a weight row for at once: 8 where AVX-512 gives it 32
    vector registers, 4 otherwise; 0 when the kernel is not available."""
    return 0 if ffi_target() is None else int(_LOADED[0].JaxgenFewRowsGroupRows())


__all__ = ["SETTINGS", "cache_dir", "ffi_target", "group_rows", "kernel_setting", "quantized_target"]

"""Compile the native kernels (`few_rows.cc`; `quantized_rows.cc`, a library of its own built
on the first quantized product) with the system C++ compiler on first use and register it with XLA.

The shared library lands in a cache folder ($JAXGEN_KERNEL_DIR, else
$XDG_CACHE_HOME/jaxgen/kernels, else ~/.cache/jaxgen/kernels) under a name that hashes the
sources, the flags, jaxlib's version, the compiler's version and the CPU's feature flags, so a
later process loads it without compiling (about 10 s) and a changed machine or jaxlib builds
its own. $JAXGEN_CPU_KERNELS=off never builds; when building fails (no compiler, no FFI
headers) `ffi_target()` returns None once with a warning that says why, and callers run
XLA's own products.

Example:
    >>> from jaxgen.backends.cpu.kernels.build import kernel_setting
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

HEADER = Path(__file__).with_name("few_rows.h")  # shared by both sources
SOURCE = Path(__file__).with_name("few_rows.cc")
QUANTIZED_SOURCE = Path(__file__).with_name("quantized_rows.cc")
TARGET_NAME = "jaxgen_few_rows"  # what ffi_target() names: float32 weights
HANDLER_SYMBOL = "JaxgenFewRows"
QUANTIZED_TARGET_NAME = "jaxgen_quantized_rows"  # int8 / 4-bit codes
QUANTIZED_HANDLER_SYMBOL = "JaxgenQuantizedRows"
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


def _library_name(source: Path, flags: tuple[str, ...]) -> str:
    version = subprocess.run([_compiler(), "--version"], capture_output=True, text=True,
                             timeout=60).stdout
    digest = hashlib.sha256("\n".join([
        source.read_text(), HEADER.read_text(), " ".join(flags), jaxlib.__version__, version, _cpu_flags(),
    ]).encode()).hexdigest()[:16]
    return f"{source.stem}-{digest}.so"


def _compile(target: Path, flags: tuple[str, ...], source: Path = SOURCE) -> None:
    """Build into a temporary file beside target, then rename it (atomic: parallel test
    workers may build at once)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, scratch = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(handle)
    try:
        command = [_compiler(), *flags, f"-I{jax.ffi.include_dir()}", str(source), "-o", scratch]
        result = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if result.returncode:
            raise RuntimeError(f"{' '.join(command)} failed: {result.stderr.strip()[-2000:]}")
        os.replace(scratch, target)
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)


def _load_library(source: Path = SOURCE) -> ctypes.CDLL:
    errors = []
    for flags in (FLAGS + NATIVE_FLAGS, FLAGS):
        try:
            target = cache_dir() / _library_name(source, flags)
            if not target.exists():
                _compile(target, flags, source)
            return ctypes.CDLL(str(target))
        except (OSError, RuntimeError, subprocess.SubprocessError) as error:
            errors.append(str(error))
    raise RuntimeError("; ".join(errors))


def ffi_target() -> str | None:
    """The registered FFI target's name, or None when kernels are off (read on every call) or
    cannot be built (warned once, with the reason)."""
    return None if kernel_setting() == "off" else _registered_target()


_LOADED: dict = {}  # source name -> the library registered in this process (group_rows reads it)


@functools.cache
def _registered_target() -> str | None:
    try:
        library = _load_library()
        jax.ffi.register_ffi_target(TARGET_NAME, jax.ffi.pycapsule(getattr(library, HANDLER_SYMBOL)),
                                    platform="cpu")
        _LOADED[SOURCE.name] = library
    except (RuntimeError, AttributeError, OSError) as error:
        warnings.warn(f"jaxgen: the CPU few-row kernel is not available ({error}); decoding "
                      f"runs XLA's own products (set {SETTING_VARIABLE}=off to silence this)",
                      RuntimeWarning, stacklevel=2)
        return None
    return TARGET_NAME


def quantized_target() -> str | None:
    """The quantized-weight kernel's FFI target, or None when kernels are off, the few-row
    kernel is not available or this one cannot be built (warned once, with the reason)."""
    return None if ffi_target() is None else _registered_quantized_target()


@functools.cache
def _registered_quantized_target() -> str | None:
    try:
        library = _load_library(QUANTIZED_SOURCE)
        jax.ffi.register_ffi_target(
            QUANTIZED_TARGET_NAME, jax.ffi.pycapsule(getattr(library, QUANTIZED_HANDLER_SYMBOL)),
            platform="cpu")
        _LOADED[QUANTIZED_SOURCE.name] = library
    except (RuntimeError, AttributeError, OSError) as error:
        warnings.warn(f"jaxgen: the CPU quantized kernel is not available ({error}); quantized "
                      f"weights run XLA's own products (set {SETTING_VARIABLE}=off to silence "
                      f"this)", RuntimeWarning, stacklevel=2)
        return None
    return QUANTIZED_TARGET_NAME


def group_rows() -> int:
    """Input rows the built kernel streams a weight row for at once: 8 where AVX-512 gives it 32
    vector registers, 4 otherwise; 0 when the kernel is not available."""
    return 0 if ffi_target() is None else int(_LOADED[SOURCE.name].JaxgenFewRowsGroupRows())


__all__ = ["SETTINGS", "cache_dir", "ffi_target", "group_rows", "kernel_setting", "quantized_target"]

"""Compile the native kernels (`few_rows.cc`; `quantized_rows.cc`, a library of its own built
on the first quantized product; `decode_attention.cc` and `prefill_attention.cc`, two more, on
the first attention through each) with the system C++ compiler on first use and register them
with XLA.

The shared library lands in a private folder ($JAXGEN_KERNEL_DIR, else
$XDG_CACHE_HOME/jaxgen/kernels, else ~/.cache/jaxgen/kernels; 0700, checked with every folder
above it) under a name that hashes the sources, the flags, jaxlib's version, the compiler's
version and the CPU's feature flags, so a later process loads it without compiling (about
10 s) and a changed machine or jaxlib builds its own. Before a library is loaded, its folder
chain and the file itself (opened without following a link) are checked: the user's, not
writable by group or others. A folder that fails is replaced, with a one-line warning, by a
private folder for this process; a file that fails is refused with a one-line warning and
built again. `use_temporary_folder()` (the CLI's --no-cache) writes nothing to that cache: a
library already there is loaded, a missing one builds into a private folder removed at exit.

The compiler runs in a process group of its own with a deadline ($JAXGEN_KERNEL_BUILD_TIMEOUT
seconds, default 120, for the whole build): past it the group is killed, and so it is when
the build is interrupted (an exception, SIGTERM while waiting, the process exiting; on Linux
the compiler also dies with the process). `start_background_build(sources)` starts builds in
threads, each under its own deadline, unless the library is in the kernel folder already
(`library_ready`: one `--version` run, no build); the first use then waits at most what is
left of that deadline, and a build that failed or ran out of time gives XLA's own products.
`start_builds_for(weights, file_bytes)` is what a model load starts (`jaxgen.models.load`
announces it; runtime.backend passes it on): the few-row and both attention kernels, and the
quantized one for int8 / GGUF weights, when the weight files are large enough for "auto" to
lay the weights out. The CLI also starts the few-row build before it loads a model. `python -m
jaxgen.backends.cpu.kernels.build` builds the four libraries ahead of time.

$JAXGEN_KERNEL_ARCH (`parse_kernel_arch`) names the instruction set the kernels are built for
(the compiler's -march; default native, this CPU's), e.g. haswell for an AVX2 build on an
AVX-512 host; it is part of the library's name.

$JAXGEN_CPU_KERNELS (`parse_kernel_setting`): auto / on / 1 / true / yes (or unset) build and
use the kernels, off / 0 / false / no never build; anything else is a ValueError naming the
variable and the values. When building fails (no compiler, no FFI headers, the deadline)
`ffi_target()` returns None once with a warning that says why, and callers run XLA's own
products.

Example:
    >>> parse_kernel_setting("1"), parse_kernel_setting("No"), parse_kernel_setting(None)
    ('auto', 'off', 'auto')
    >>> parse_kernel_setting("fast")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: JAXGEN_CPU_KERNELS='fast' is not a kernel setting; expected auto, on, 1, ...
"""
from __future__ import annotations

import atexit
import ctypes
import functools
import hashlib
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import jax
import jaxlib

from jaxgen.backends.cpu.kernels.compiler_run import run_compiler, terms_while_waiting
from jaxgen.backends.cpu.tuning import SPLIT_MIN_BYTES
from jaxgen.storage.host_cpu import host_cpu
from jaxgen.storage.private import (
    NotPrivate,
    check_private_file,
    private_folder,
    private_folder_or_fallback,
)

HEADERS = sorted(Path(__file__).parent.glob("*.h"))  # included by the sources (few_rows.h, ...)
SOURCE = Path(__file__).with_name("few_rows.cc")
QUANTIZED_SOURCE = Path(__file__).with_name("quantized_rows.cc")
TARGET_NAME = "jaxgen_few_rows"  # what ffi_target() names: float32 weights
HANDLER_SYMBOL = "JaxgenFewRows"
QUANTIZED_TARGET_NAME = "jaxgen_quantized_rows"  # int8 / 4-bit codes
QUANTIZED_HANDLER_SYMBOL = "JaxgenQuantizedRows"
ATTENTION_SOURCE = Path(__file__).with_name("decode_attention.cc")
ATTENTION_TARGETS = {"jaxgen_decode_attention_dense": "JaxgenDecodeAttention",  # float32
                     "jaxgen_decode_attention_codes": "JaxgenDecodeAttentionCodes"}  # int8
PREFILL_SOURCE = Path(__file__).with_name("prefill_attention.cc")
PREFILL_TARGETS = {"jaxgen_prefill_attention_dense": "JaxgenPrefillAttention",  # float32
                   "jaxgen_prefill_attention_codes": "JaxgenPrefillAttentionCodes"}  # int8
NATIVE_TARGETS = (TARGET_NAME, QUANTIZED_TARGET_NAME, *ATTENTION_TARGETS,
                  *PREFILL_TARGETS)  # every FFI target a program may call
SETTING_VARIABLE = "JAXGEN_CPU_KERNELS"
SETTINGS = ("auto", "off")
SETTING_WORDS = {"auto": "auto", "on": "auto", "1": "auto", "true": "auto", "yes": "auto",
                 "off": "off", "0": "off", "false": "off", "no": "off"}
TIMEOUT_VARIABLE = "JAXGEN_KERNEL_BUILD_TIMEOUT"
DEFAULT_TIMEOUT_S = 120.0
STALE_BUILD_S = 3600.0  # a half-built file this old was left by a build that was killed
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-w")
ARCH_VARIABLE = "JAXGEN_KERNEL_ARCH"  # the instruction set the kernels are built for
DEFAULT_ARCH = "native"
CHECK_TIMEOUT_S = 5.0  # library_ready's `--version` run (the loading thread waits on it)
# A weight file's bytes times this bound its float32 weights (4-bit codes: 8x): a load starts
# the builds when that may reach SPLIT_MIN_BYTES, the size "auto" lays weights out from.
WEIGHT_FILE_EXPANSION = 8
QUANTIZED_WEIGHTS = ("int8", "gguf")  # load's weights= that the quantized kernel runs


def parse_kernel_setting(raw: str | None) -> str:
    """"auto" or "off" for a $JAXGEN_CPU_KERNELS value (None or blank: "auto"); any other
    value is a ValueError naming the variable and the values it takes."""
    word = (raw or "").strip().lower() or "auto"
    if word not in SETTING_WORDS:
        on = ", ".join(w for w, s in SETTING_WORDS.items() if s == "auto")
        off = ", ".join(w for w, s in SETTING_WORDS.items() if s == "off")
        raise ValueError(f"{SETTING_VARIABLE}={raw!r} is not a kernel setting; expected {on} "
                         f"(build and use the native kernels) or {off} (XLA's own products)")
    return SETTING_WORDS[word]


def kernel_setting() -> str:
    """$JAXGEN_CPU_KERNELS, parsed ("auto" or "off"; ValueError for any other value)."""
    return parse_kernel_setting(os.environ.get(SETTING_VARIABLE))


def parse_kernel_arch(raw: str | None) -> str:
    """The compiler's -march value for a $JAXGEN_KERNEL_ARCH value (None or blank:
    DEFAULT_ARCH, this CPU's own instruction set): a name of letters, digits, "-", "_" and
    "." that does not start with "-" (e.g. "haswell" or "x86-64-v3" for an AVX2 build on an
    AVX-512 host); anything else is a ValueError naming the variable.

    Example:
        >>> parse_kernel_arch(None), parse_kernel_arch(" x86-64-v3 ")
        ('native', 'x86-64-v3')
        >>> parse_kernel_arch("-O0 -fplugin=x")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: JAXGEN_KERNEL_ARCH='-O0 -fplugin=x' is not an instruction set name; ...
    """
    word = (raw or "").strip() or DEFAULT_ARCH
    if word.startswith("-") or not all(c.isascii() and (c.isalnum() or c in "-_.") for c in word):
        raise ValueError(f"{ARCH_VARIABLE}={raw!r} is not an instruction set name; expected "
                         f"a compiler -march value such as native (the default), haswell or "
                         f"x86-64-v3: letters, digits, '-', '_' and '.', not starting with '-'")
    return word


def arch_flags() -> tuple[str, ...]:
    """The instruction-set flags the kernels are built with first ($JAXGEN_KERNEL_ARCH,
    `parse_kernel_arch`); dropped, for the compiler's default target, if it refuses them."""
    return (f"-march={parse_kernel_arch(os.environ.get(ARCH_VARIABLE))}",)


def build_timeout() -> float:
    """Seconds a whole build may take: $JAXGEN_KERNEL_BUILD_TIMEOUT (a positive number),
    else DEFAULT_TIMEOUT_S."""
    raw = os.environ.get(TIMEOUT_VARIABLE, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{TIMEOUT_VARIABLE}={raw!r} is not a build timeout; expected a "
                         f"positive number of seconds (default {DEFAULT_TIMEOUT_S:g})")
    return value


def cache_dir() -> Path:
    """Where built kernels are kept (the folder as named; `kernel_folder` makes it private)."""
    if os.environ.get("JAXGEN_KERNEL_DIR"):
        return Path(os.environ["JAXGEN_KERNEL_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "jaxgen" / "kernels"


_TEMPORARY: list[Path] = []  # use_temporary_folder's folder, when set


def use_temporary_folder() -> Path:
    """From now on, nothing is written to the user's kernel cache: a library already there
    (and private) is loaded, one that is missing builds into a fresh private folder removed
    at exit."""
    if not _TEMPORARY:
        folder = Path(tempfile.mkdtemp(prefix="jaxgen-kernels-"))  # 0700
        atexit.register(shutil.rmtree, folder, True)
        _TEMPORARY.append(folder)
    return _TEMPORARY[0]


def kernel_folder() -> Path:
    """The private folder built kernels go to and are loaded from (a one-line warning and a
    private folder for this process when the cache folder is not private)."""
    if _TEMPORARY:
        return private_folder(_TEMPORARY[0])
    return private_folder_or_fallback(cache_dir(), "kernel cache")


_BUILD = f"the kernel build (${TIMEOUT_VARIABLE})"


def _compiler() -> str:
    return os.environ.get("CXX", "c++")


_VERSIONS: dict[str, str] = {}  # compiler -> its `--version` text (asked once a process)


def _compiler_version(deadline: float) -> str:
    compiler = _compiler()
    if compiler not in _VERSIONS:
        _VERSIONS[compiler] = run_compiler([compiler, "--version"], deadline, _BUILD).stdout
    return _VERSIONS[compiler]


def _library_name(source: Path, flags: tuple[str, ...], deadline: float) -> str:
    version = _compiler_version(deadline)
    digest = hashlib.sha256("\n".join([
        source.read_text(), *(header.read_text() for header in HEADERS), " ".join(flags),
        jaxlib.__version__, version, host_cpu(),
    ]).encode()).hexdigest()[:16]
    return f"{source.stem}-{digest}.so"


def _compile(target: Path, flags: tuple[str, ...], source: Path, deadline: float) -> None:
    """Build into a temporary file beside target (mode 0600), then rename it (atomic:
    parallel test workers may build at once)."""
    for stale in target.parent.glob(".building-*"):  # left by a build that was killed
        try:
            if stale.lstat().st_mtime < time.time() - STALE_BUILD_S:
                stale.unlink()
        except OSError:
            pass
    handle, scratch = tempfile.mkstemp(suffix=".so", prefix=".building-", dir=target.parent)
    os.close(handle)
    try:
        command = [_compiler(), *flags, f"-I{jax.ffi.include_dir()}", str(source), "-o", scratch]
        result = run_compiler(command, deadline, _BUILD)
        if result.returncode:
            raise RuntimeError(f"{' '.join(command)} failed: {result.stderr.strip()[-2000:]}")
        os.chmod(scratch, 0o600)  # the linker writes 0755 & ~umask
        os.replace(scratch, target)
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)


def _refuse(target: Path, why: Exception) -> Path:
    """A library that is not the user's own: warned, removed, and the folder to build in."""
    warnings.warn(f"jaxgen: refusing the kernel library {target} ({why}); building it again",
                  RuntimeWarning, stacklevel=2)
    try:
        os.remove(target)
        return target.parent
    except OSError:
        return private_folder(tempfile.mkdtemp(prefix="jaxgen-kernels-"))


def _checked(target: Path) -> bool:
    """True when target is a library of the user's, not writable by others (checked on the
    file opened without following a link); False when it is missing; NotPrivate otherwise."""
    try:
        handle = os.open(target, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return False
    except OSError as error:  # a link (ELOOP) or unreadable
        raise NotPrivate(f"{target} cannot be opened as a plain file ({error})") from None
    try:
        check_private_file(target, os.fstat(handle))
    finally:
        os.close(handle)
    return True


def _in_user_cache(name: str) -> Path | None:
    """The user's kernel cache's library `name` when the folder exists, is private and holds
    it as a file of the user's (nothing is created there)."""
    if not cache_dir().is_dir():
        return None
    try:
        target = private_folder(cache_dir()) / name
        return target if _checked(target) else None
    except OSError:
        return None


def build_library(source: Path = SOURCE, deadline: float | None = None) -> Path:
    """The checked library of `source` in the kernel folder, compiled when missing or
    refused; RuntimeError (or OSError) with the reasons when it cannot be built in time."""
    deadline = time.monotonic() + build_timeout() if deadline is None else deadline
    errors = []
    for flags in (FLAGS + arch_flags(), FLAGS):
        try:
            folder = kernel_folder()
            target = folder / _library_name(source, flags, deadline)
            cached = _in_user_cache(target.name) if _TEMPORARY else None
            if cached is not None:
                return cached
            try:
                present = _checked(target)
            except NotPrivate as why:
                target = _refuse(target, why) / target.name
                present = False
            if not present:
                _compile(target, flags, source, deadline)
                _checked(target)
            return target
        except (OSError, RuntimeError, subprocess.SubprocessError) as error:
            errors.append(str(error))
            if time.monotonic() >= deadline:
                break
    raise RuntimeError("; ".join(errors))


class _Build(threading.Thread):
    """A library built in the background; `result()` waits for it, until its deadline."""

    def __init__(self, source: Path, deadline: float):
        super().__init__(name=f"jaxgen-kernel-build-{source.stem}", daemon=True)
        self.source, self.deadline = source, deadline
        self.path: Path | None = None
        self.error: BaseException | None = None

    def run(self):
        try:
            self.path = build_library(self.source, self.deadline)
        except BaseException as error:  # noqa: BLE001  (handed to the waiting caller)
            self.error = error

    def result(self) -> Path:
        with terms_while_waiting():
            while self.is_alive() and time.monotonic() < self.deadline:
                self.join(timeout=min(0.25, max(self.deadline - time.monotonic(), 0.0)))
        if self.is_alive():
            raise RuntimeError(f"the background kernel build did not finish within "
                               f"{build_timeout():g} s ({TIMEOUT_VARIABLE})")
        if self.error is not None:
            raise self.error
        return self.path


_BUILDS: dict[str, _Build] = {}  # source name -> its background build
_BUILDS_LOCK = threading.Lock()


def library_ready(source: Path) -> bool:
    """True when `source`'s library is in the kernel folder already, so that a build would
    compile nothing (one `--version` run, under CHECK_TIMEOUT_S; any failure: False)."""
    deadline = time.monotonic() + min(build_timeout(), CHECK_TIMEOUT_S)
    try:
        name = _library_name(source, FLAGS + arch_flags(), deadline)
        if _TEMPORARY and _in_user_cache(name) is not None:
            return True
        return _checked(kernel_folder() / name)
    except (OSError, RuntimeError, subprocess.SubprocessError):
        return False


def _registered(source: Path) -> bool:
    """True when `source`'s kernel is registered in this process (or found unavailable)."""
    registered = {QUANTIZED_SOURCE.name: _registered_quantized_target,
                  ATTENTION_SOURCE.name: _registered_attention_targets,
                  PREFILL_SOURCE.name: _registered_prefill_targets}.get(source.name,
                                                                       _registered_target)
    return bool(registered.cache_info().currsize)


def start_background_build(sources=None) -> list[str]:
    """Starts building each of `sources` (None: the few-row kernel's) in a thread of its own
    with its own deadline; nothing for one that is registered, building or built already
    (`library_ready`), or when kernels are off. The first use waits at most the rest of that
    deadline. Returns the names of the sources whose build started."""
    if kernel_setting() == "off":
        return []
    started = []
    for source in (SOURCE,) if sources is None else sources:
        with _BUILDS_LOCK:
            pending = source.name in _BUILDS
        if pending or _registered(source) or library_ready(source):
            continue
        with _BUILDS_LOCK:
            if source.name not in _BUILDS:
                build = _Build(source, time.monotonic() + build_timeout())
                _BUILDS[source.name] = build
                build.start()
                started.append(source.name)
    return started


def start_builds_for(weights: str, file_bytes: int | None) -> list[str]:
    """The builds a model load may need, started in the background (start_background_build):
    the few-row, decode-attention and prefill-attention kernels', and the quantized kernel's
    for `weights` "int8" / "gguf"; none when
    `file_bytes` (the weight files' size) is unknown or too small for "auto" to lay the
    weights out (WEIGHT_FILE_EXPANSION x file_bytes < SPLIT_MIN_BYTES: a first use with
    layout="split" builds then). Returns the names of the sources whose build started."""
    if file_bytes is None or file_bytes * WEIGHT_FILE_EXPANSION < SPLIT_MIN_BYTES:
        return []
    sources = (SOURCE, ATTENTION_SOURCE, PREFILL_SOURCE)
    if weights in QUANTIZED_WEIGHTS:
        sources += (QUANTIZED_SOURCE,)
    return start_background_build(sources)


def _library_path(source: Path) -> Path:
    with _BUILDS_LOCK:
        build = _BUILDS.get(source.name)
    return build.result() if build is not None else build_library(source)


def _load_library(source: Path = SOURCE) -> ctypes.CDLL:
    target = _library_path(source)
    handle = os.open(target, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    try:
        checked = os.fstat(handle)
        check_private_file(target, checked)
        library = ctypes.CDLL(str(target))
        now = os.stat(target)
        if (now.st_dev, now.st_ino) != (checked.st_dev, checked.st_ino):
            raise NotPrivate(f"{target} was replaced while it was loaded")
    finally:
        os.close(handle)
    return library


def ffi_target() -> str | None:
    """The registered FFI target's name, or None when kernels are off (read on every call) or
    cannot be built (warned once, with the reason)."""
    return None if kernel_setting() == "off" else _registered_target()


_LOADED: dict = {}  # source name -> the library registered in this process (its reports)


def _register(source: Path, targets: dict[str, str], kernel: str, fallback: str) -> bool:
    """Loads `source`'s library and registers its handlers ({FFI target: symbol}) for the
    CPU; False, with a warning naming the `kernel` and the `fallback` that runs instead, when
    it cannot be built or loaded."""
    try:
        library = _load_library(source)
        for name, symbol in targets.items():
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(library, symbol)),
                                        platform="cpu")
        _LOADED[source.name] = library
    except (RuntimeError, AttributeError, OSError) as error:
        warnings.warn(f"jaxgen: the CPU {kernel} is not available ({error}); {fallback} (set "
                      f"{SETTING_VARIABLE}=off to silence this)", RuntimeWarning, stacklevel=3)
        return False
    return True


@functools.cache
def _registered_target() -> str | None:
    registered = _register(SOURCE, {TARGET_NAME: HANDLER_SYMBOL}, "few-row kernel",
                           "decoding runs XLA's own products")
    return TARGET_NAME if registered else None


def quantized_target() -> str | None:
    """The quantized-weight kernel's FFI target, or None when kernels are off, the few-row
    kernel is not available or this one cannot be built (warned once, with the reason)."""
    return None if ffi_target() is None else _registered_quantized_target()


@functools.cache
def _registered_quantized_target() -> str | None:
    registered = _register(QUANTIZED_SOURCE, {QUANTIZED_TARGET_NAME: QUANTIZED_HANDLER_SYMBOL},
                           "quantized kernel", "quantized weights run XLA's own products")
    return QUANTIZED_TARGET_NAME if registered else None


def attention_targets() -> dict[str, str] | None:
    """The decode-attention kernel's FFI targets ({"dense": name, "codes": name}: float32 and
    int8 caches), or None when kernels are off, the few-row kernel is not available or this
    one cannot be built (warned once, with the reason)."""
    return None if ffi_target() is None else _registered_attention_targets()


def _by_cache_kind(targets: dict[str, str]) -> dict[str, str]:
    """An attention library's {FFI target: symbol} (float32 first, int8 second) as
    {"dense": target, "codes": target}."""
    dense, codes = targets
    return {"dense": dense, "codes": codes}


@functools.cache
def _registered_attention_targets() -> dict[str, str] | None:
    if not _register(ATTENTION_SOURCE, ATTENTION_TARGETS, "decode-attention kernel",
                     "attention runs XLA's own products"):
        return None
    return _by_cache_kind(ATTENTION_TARGETS)


def prefill_targets() -> dict[str, str] | None:
    """The prefill-attention kernel's FFI targets ({"dense": name, "codes": name}: float32
    and int8 caches, many query positions), or None when kernels are off, the few-row kernel
    is not available or this one cannot be built (warned once, with the reason)."""
    return None if ffi_target() is None else _registered_prefill_targets()


@functools.cache
def _registered_prefill_targets() -> dict[str, str] | None:
    if not _register(PREFILL_SOURCE, PREFILL_TARGETS, "prefill-attention kernel",
                     "long forwards attend through XLA"):
        return None
    return _by_cache_kind(PREFILL_TARGETS)


def _target_of(library, name: str) -> str | None:
    """`name` when `library()` (attention_targets, prefill_targets) is registered, else None."""
    return name if library() is not None else None


def register_targets(names) -> bool:
    """Registers the named FFI targets (NATIVE_TARGETS), building what is missing; True when
    every one is registered, False when one is not available (or not a target of these)."""
    registered = {TARGET_NAME: ffi_target, QUANTIZED_TARGET_NAME: quantized_target,
                  **{name: functools.partial(_target_of, attention_targets, name)
                     for name in ATTENTION_TARGETS},
                  **{name: functools.partial(_target_of, prefill_targets, name)
                     for name in PREFILL_TARGETS}}
    return all(name in registered and registered[name]() == name for name in names)


def group_rows() -> int:
    """Input rows the built kernel streams a weight row for at once: 8 where AVX-512 gives it 32
    vector registers, 4 otherwise; 0 when the kernel is not available."""
    return 0 if ffi_target() is None else int(_LOADED[SOURCE.name].JaxgenFewRowsGroupRows())


def intel_avx512_host() -> bool:
    """True when the built few-row kernel is an AVX-512 build running on an Intel CPU (the
    hosts some tuned constants differ on: `tuning.py`); False when it is not available."""
    return ffi_target() is not None and bool(_LOADED[SOURCE.name].JaxgenFewRowsIntelAvx512())


def quantized_rounded_rows() -> int:
    """The most input rows the quantized kernel rounds to int16 codes (3 on AVX2 builds without
    AVX-512; 0: it multiplies float rows); 0 when the kernel is not available."""
    if quantized_target() is None:
        return 0
    return int(_LOADED[QUANTIZED_SOURCE.name].JaxgenQuantizedRowsRoundedRows())


def attention_query_bits() -> int:
    """Bits of the integer codes the decode-attention kernel rounds a query row to against int8
    keys (16 on an AVX2 build, 0: float queries); 0 when the kernel is not available."""
    if attention_targets() is None:
        return 0
    return int(_LOADED[ATTENTION_SOURCE.name].JaxgenDecodeAttentionQueryBits())


def main(argv=None) -> int:
    """`python -m jaxgen.backends.cpu.kernels.build`: builds the four libraries into the kernel
    folder now (a later run loads them), prints where; exit status 1 when one fails."""
    argv = sys.argv[1:] if argv is None else argv
    if argv not in ([], ["build"]):
        print("usage: python -m jaxgen.backends.cpu.kernels.build [build]", file=sys.stderr)
        return 2
    status = 0
    for source in (SOURCE, QUANTIZED_SOURCE, ATTENTION_SOURCE, PREFILL_SOURCE):
        try:
            print(f"{source.name}: {build_library(source)}")
        except (OSError, RuntimeError, ValueError) as error:
            print(f"{source.name}: not built: {error}", file=sys.stderr)
            status = 1
    return status


__all__ = ["NATIVE_TARGETS", "SETTINGS", "arch_flags", "attention_query_bits", "attention_targets",
           "build_library", "build_timeout", "cache_dir", "ffi_target", "group_rows",
           "intel_avx512_host",
           "kernel_folder", "kernel_setting", "library_ready", "parse_kernel_arch",
           "parse_kernel_setting",
           "prefill_targets", "quantized_rounded_rows", "quantized_target", "register_targets",
           "start_background_build", "start_builds_for", "use_temporary_folder"]

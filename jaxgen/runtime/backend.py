"""The one seam between the portable core and hardware backends.

The compiled programs (`jaxgen.runtime.compiled`) reach backend-specific preparation only
through this module; nothing else in jaxgen imports `jaxgen.backends`. `layout`, an argument of
every generate call and a static argument of every program (jit keys on it), chooses:

    "auto"      the backend of this process decides: on XLA:CPU, `jaxgen.backends.cpu` lays the
                weights out per layer (native few-row kernels where built) for models with
                enough weight bytes; on GPU / TPU, nothing (the portable path)
    "portable"  no backend preparation: the program a GPU or TPU runs, on any platform
    "split"     the CPU backend's layouts whatever the model's size (XLA:CPU only)

The native kernels' side (XLA:CPU): `kernel_setting()` ($JAXGEN_CPU_KERNELS) and
`kernel_arch()` ($JAXGEN_KERNEL_ARCH), parsed: part of every executable-cache key;
`native_target_names()` (what a stored program may call: the executable cache records which
ones it does), `register_native_targets(names)` (before such a program is loaded),
`start_native_build()` (the CLI, before it loads a model) and
`start_builds_for_load(weights, file_bytes)` (a model is loading: the facade passes on
`jaxgen.models.load`'s announcement, jaxgen.notices.model_loads).

Example:
    >>> check_layout("portable")
    'portable'
    >>> check_layout("fused")
    Traceback (most recent call last):
    ...
    ValueError: layout='fused' is not a layout; expected one of 'auto', 'portable', 'split'
"""
from __future__ import annotations

import os

import jax

LAYOUTS = ("auto", "portable", "split")


def check_layout(layout) -> str:
    """`layout` when it names a layout this process can run, else a ValueError naming it."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not a layout; expected one of "
                         + ", ".join(repr(name) for name in LAYOUTS))
    if layout == "split" and jax.default_backend() != "cpu":
        raise ValueError(f"layout='split' lays weights out for XLA:CPU; this process runs on "
                         f"{jax.default_backend()}: use 'auto' or 'portable'")
    return layout


def _cpu(layout: str):
    """The CPU backend's preparation module when `layout` asks for it here, else None."""
    if layout == "portable" or jax.default_backend() != "cpu":
        return None
    from jaxgen.backends.cpu import prepare  # the one import of a backend

    return prepare


def layout_plan(model, params, rows: int | None, layout: str):
    """How the backend lays params out for a program whose decode forwards run `rows` rows
    (None: it varies): a hashable plan, or None to run them as they are."""
    backend = _cpu(layout)
    return None if backend is None else backend.layout_plan(model, params, rows, layout)


def layout_pieces(params, plan, *, layout: str):
    """The arrays of a plan (traced in a program of its own, so a copy can be kept)."""
    return _cpu(layout).layout_pieces(params, plan)


def with_layout(params, pieces, plan, layout: str):
    """params laid out from a plan's pieces."""
    return _cpu(layout).with_layout(params, pieces, plan)


def placed_for_streaming(params, laid_out, layout: str, stop=lambda: False):
    """laid-out params (host arrays, not traced) re-placed where a backend reads them faster
    step after step (XLA:CPU: on huge pages), or laid_out itself (also when `stop()` turns
    true midway). Slow to make (it copies the weights): callers make it off the critical
    path."""
    cpu = _cpu(layout)
    return laid_out if cpu is None else cpu.on_huge_pages(params, laid_out, stop)


def prepare(model, params, state, rows: int | None, layer_tuples: bool, layout: str):
    """(params, state) as a program runs them, at the top of its trace."""
    backend = _cpu(layout)
    if backend is None:
        return params, state
    return backend.prepare(model, params, state, rows, layer_tuples, layout)


def layers_apart(params) -> bool:
    """True when a program's prepared params hold their layers as a list (a backend's
    unrolled forward): `prepare` then gives loops that take layer tuples the cache one
    buffer per layer, and a loop that reshapes the cache itself holds it so too."""
    return isinstance(params, dict) and isinstance(params.get("layers"), (list, tuple))


def finish(state, layout: str, held_tuples: bool = False):
    """The state as the caller holds it, at the end of a program's trace. held_tuples: the
    caller's cache came in as per-layer buffers (a long-lived state kept so between calls,
    as the serving engine keeps its slots): it goes back so, with no stacking copy."""
    backend = _cpu(layout)
    return state if backend is None else backend.finish(state, stack=not held_tuples)


def _kernels():
    """The native kernels' build module (the seam's second door: building, not layouts)."""
    from jaxgen.backends.cpu.kernels import build

    return build


def kernel_setting() -> str:
    """$JAXGEN_CPU_KERNELS parsed: "auto" or "off" (a ValueError naming the variable and the
    values it takes for anything else). What a compiled program depends on, not the raw text:
    `=0` and `=off` are the same setting."""
    return _kernels().parse_kernel_setting(os.environ.get("JAXGEN_CPU_KERNELS"))


def kernel_arch() -> str:
    """$JAXGEN_KERNEL_ARCH parsed: the instruction set the native kernels are built for
    ("native" unless set; a ValueError naming the variable for a malformed value). Part of
    every executable-cache key: the kernels' row groups and roundings follow it."""
    return _kernels().parse_kernel_arch(os.environ.get("JAXGEN_KERNEL_ARCH"))


def native_target_names() -> tuple[str, ...]:
    """The FFI targets this backend's programs may call (none off XLA:CPU)."""
    return _kernels().NATIVE_TARGETS if jax.default_backend() == "cpu" else ()


def register_native_targets(names=None) -> bool:
    """Registers the named native targets (all of native_target_names() when None), building
    a kernel that is missing; True when every one is registered."""
    names = native_target_names() if names is None else tuple(names)
    if not names:
        return True
    if jax.default_backend() != "cpu":
        return False
    return _kernels().register_targets(names)


def start_native_build(temporary: bool = False) -> None:
    """Starts building the native kernels in the background (XLA:CPU with kernels on; nothing
    otherwise), so the first program that needs them waits less. temporary: build into a
    private folder removed at exit instead of the user's kernel cache (--no-cache)."""
    if jax.default_backend() != "cpu" or kernel_setting() == "off":
        return
    if temporary:
        _kernels().use_temporary_folder()
    _kernels().start_background_build()


def start_builds_for_load(weights: str, file_bytes: int | None) -> None:
    """A model of these weights ("float", "int8", "gguf"), from files of this size, is loading:
    the native builds it may need start in the background (XLA:CPU with kernels on; nothing
    for a library built already). A bad $JAXGEN_CPU_KERNELS, $JAXGEN_KERNEL_ARCH or build
    timeout starts nothing here: the first call that reads it names it."""
    if jax.default_backend() != "cpu":
        return
    try:
        if kernel_setting() == "off":
            return
        _kernels().start_builds_for(weights, file_bytes)
    except ValueError:
        return


__all__ = ["LAYOUTS", "check_layout", "finish", "kernel_arch", "kernel_setting", "layout_pieces",
           "layout_plan", "native_target_names", "placed_for_streaming", "prepare",
           "register_native_targets", "start_builds_for_load", "start_native_build",
           "with_layout"]

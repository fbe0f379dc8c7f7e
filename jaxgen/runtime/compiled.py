"""The compiled programs every plan runs: a `jax.jit` per entry and static configuration, the
loop and the layout static by name, at most a bounded number alive.

    run_donated(params, state, cfg, inputs, loop=, layout=)   a whole call; the state is donated
    run_kept(params, state, cfg, inputs, loop=, layout=)      the same without donation (beam
                                                              search, calls under jax.vmap / jit)
    start(params, state, cfg, inputs, loop=, layout=)         chunked driver: prefill + first step
    advance(params, state, carry, begin, end, cfg, inputs, loop=, layout=)   chunked: steps

A program is compiled per static configuration: the entry, the loop, the layout and the
arguments' structure and shapes (the config's static fields, the prompt bucket, the bucket of
new tokens, the stop-string tables' buckets, the number of EOS ids). Budgets, stop strings and
EOS ids are dynamic inputs (jaxgen.config.program), so they do not add programs. At most
`set_max_programs(n)` programs (default 16, $JAXGEN_MAX_PROGRAMS) stay alive: the least
recently used is cleared (`jax.jit(...).clear_cache()` of its own wrapper), which frees its
executable and code pages, so a long-lived process does not grow with the configurations
it has seen. A cleared configuration compiles again when it comes back.

`loop` is a static, hashable description (jaxgen.loops.decode.DecodeLoop,
jaxgen.loops.beam.BeamLoop, jaxgen.speculative.loop.SpeculativeLoop or a custom_generate
wrapper): equal loops share a compiled program. A loop may say how many rows its decode
forwards run (`decode_rows(state, cfg)`) and whether it carries a cache held as per-layer
buffers (`takes_layer_tuples`); the backend seam (`jaxgen.runtime.backend`) prepares params and
state from that and `layout`. `inputs` are the loop's dynamic extras (draft params, start
lengths) or None. New prompts of the same bucket, new sampling values and new keys reuse the
program.

Example (a second call with new prompts of the same bucket reuses the program):
    >>> import jaxgen
    >>> from jaxgen.models import tiny_llama
    >>> model, params = tiny_llama()
    >>> cfg = jaxgen.GenerationConfig(max_new_tokens=3)
    >>> before = jaxgen.trace_count()
    >>> for prompts in ([[1, 2, 3]], [[4, 5]]):
    ...     _ = jaxgen.generate(params, jaxgen.init_state(model, prompts, cfg), cfg)
    >>> jaxgen.trace_count() - before
    1
"""
from __future__ import annotations

import atexit
import collections
import dataclasses
import functools
import os
import threading
import warnings
import weakref

import jax
import numpy as np

from jaxgen.cache.layer_forms import holds_layer_tuples, to_layer_tuples, to_stacked_layers
from jaxgen.config.fields import check_int
from jaxgen.runtime import backend, executable_cache

_TRACES = {"generate": 0}


def _decode_rows(state, loop, cfg) -> int | None:
    """How many rows each decode forward of the loop runs (None: it varies or is unknown)."""
    rows = getattr(loop, "decode_rows", None)
    return None if rows is None else rows(state, cfg)


def _held_tuples(state) -> bool:
    """True when the caller's state holds its cache as per-layer buffers (kept so)."""
    cache = getattr(state, "cache", None)
    return cache is not None and holds_layer_tuples(cache)


def _prepared(params, state, loop, cfg, layout):
    """(params, state) as the loop runs them, through the backend seam."""
    return backend.prepare(getattr(state, "model", None), params, state,
                           _decode_rows(state, loop, cfg),
                           bool(getattr(loop, "takes_layer_tuples", False)), layout)


@dataclasses.dataclass
class _Kept:
    """The last params laid out for decoding, kept while the caller's arrays live."""

    key: tuple  # (ids of the caller's leaves, plan, layout)
    refs: list  # weak references to the caller's leaves
    laid_out: object  # the laid-out params; replaced by their placed copy once it is made
    calls: int = 0  # generate calls that began with this entry (a chunked call counts once)
    placing: threading.Thread | None = None  # makes the placed copy (started by a second call)


_LAID_OUT: list = []  # [] or [_Kept]
_LAID_OUT_LOCK = threading.RLock()  # a finalizer may run on the thread that holds it
_EXITING = threading.Event()  # set at interpreter exit: a placing thread stops between arrays
_PLACING: set = set()  # placing threads still running (an old entry's too), joined at exit


def _laid_out(params, state, loop, cfg, layout, begins_call: bool = True):
    """params in the layout the backend plans for this program, computed by its own compiled
    call and kept for the next call with the same arrays (the same plan), so a generate call
    does not slice, fuse and transpose the weights again (0.3-0.5 s a call for SmolLM2 on a
    CPU; the streaming driver calls once a chunk). Params under a trace, or that stay as they
    are, are returned unchanged. One entry: the laid-out copy lives until other params are laid
    out or the caller's layer arrays are freed.

    The second generate call that uses the copy (`begins_call`: the entries that begin a call,
    not a chunked call's later chunks) starts a background thread that re-places it where the
    backend streams it faster (`backend.placed_for_streaming`: XLA:CPU copies it onto huge
    pages); calls after that thread finishes read the placed copy (same values, shapes,
    devices and commitment: nothing compiles again). A one-call process never pays for the
    copy.

    Example:
        >>> import jaxgen
        >>> from jaxgen.models import tiny_llama
        >>> model, params = tiny_llama()                 # small: stays stacked
        >>> cfg = jaxgen.GenerationConfig(max_new_tokens=2)
        >>> state = jaxgen.init_state(model, [[1, 2]], cfg)
        >>> _laid_out(params, state, None, cfg, "auto") is params
        True
    """
    leaves = jax.tree_util.tree_leaves(params)
    if not leaves or not all(isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer)
                             for leaf in leaves):
        return params
    plan = backend.layout_plan(getattr(state, "model", None), params,
                               _decode_rows(state, loop, cfg), layout)
    if plan is None:
        return params
    key = (tuple(map(id, leaves)), plan, layout)
    with _LAID_OUT_LOCK:
        if _LAID_OUT and _LAID_OUT[0].key == key and all(
                ref() is leaf for ref, leaf in zip(_LAID_OUT[0].refs, leaves)):
            kept = _LAID_OUT[0]
            kept.calls += begins_call
            if kept.calls >= 2 and kept.placing is None and not _EXITING.is_set():
                kept.placing = threading.Thread(target=_place, args=(kept, params, layout),
                                                name="jaxgen-place-weights", daemon=True)
                _PLACING.add(kept.placing)
                kept.placing.start()
            return kept.laid_out
        _LAID_OUT.clear()  # the old copy goes before the new one is made
        pieces = executable_cache.call("layout_pieces", _layout_pieces_jit, (params,),
                                       loop=plan, layout=layout)
        laid_out = backend.with_layout(params, pieces, plan, layout)
        _LAID_OUT.append(_Kept(key, [weakref.ref(leaf) for leaf in leaves], laid_out,
                               calls=int(begins_call)))
    # a layer array: the laid-out copy holds the caller's other arrays (the embedding), never
    # these, so this one is freed when the caller lets go
    weakref.finalize(jax.tree_util.tree_leaves(params["layers"])[0], _forget, key)
    return laid_out


def _place(kept: _Kept, params, layout) -> None:
    """The placing thread: swaps the kept copy for its placed copy, unless the entry went
    meanwhile (then it stops after the array it copies). A failure (no memory for the copy)
    leaves the laid-out copy serving, with a warning."""
    def stop() -> bool:
        return _EXITING.is_set() or not (_LAID_OUT and _LAID_OUT[0] is kept)

    try:
        placed = backend.placed_for_streaming(params, kept.laid_out, layout, stop)
    except Exception as err:  # noqa: BLE001 - any failure: the unplaced copy still serves
        warnings.warn(f"jaxgen: the laid-out weights stay where XLA put them ({err!r})",
                      RuntimeWarning, stacklevel=1)
        return
    finally:
        _PLACING.discard(threading.current_thread())
    with _LAID_OUT_LOCK:
        if _LAID_OUT and _LAID_OUT[0] is kept:
            kept.laid_out = placed


def wait_for_placement(timeout: float | None = None) -> bool:
    """Waits for the kept copy's placing thread, if one runs (benchmarks and tests); True
    when none runs after the wait."""
    with _LAID_OUT_LOCK:
        thread = _LAID_OUT[0].placing if _LAID_OUT else None
    if thread is not None:
        thread.join(timeout)
    return thread is None or not thread.is_alive()


@atexit.register
def _stop_placing() -> None:
    """At exit every placing thread stops after the array it copies (none outlives jax)."""
    _EXITING.set()
    for thread in list(_PLACING):
        thread.join(timeout=60.0)


def _forget(key) -> None:
    with _LAID_OUT_LOCK:
        if _LAID_OUT and _LAID_OUT[0].key == key:
            _LAID_OUT.clear()


def _layout_pieces(params, *, loop, layout):
    """The backend's layout program; `loop` holds the plan (the static name the executable
    cache keys on beside `layout`). One program per plan: few, kept."""
    return backend.layout_pieces(params, loop, layout=layout)


_layout_pieces_jit = jax.jit(_layout_pieces, static_argnames=("loop", "layout"))



def _run(params, state, cfg, inputs, *, loop, layout):
    _TRACES["generate"] += 1
    held = _held_tuples(state)
    output = loop.run(*_prepared(params, state, loop, cfg, layout), cfg, inputs)
    final = getattr(output, "state", None)
    if final is None:
        return output
    return dataclasses.replace(output, state=backend.finish(final, layout, held))


def _start(params, state, cfg, inputs, *, loop, layout):
    _TRACES["generate"] += 1
    held = _held_tuples(state)
    state, carry = loop.start(*_prepared(params, state, loop, cfg, layout), cfg, inputs)
    return backend.finish(state, layout, held), carry


def _advance(params, state, carry, begin, end, cfg, inputs, *, loop, layout):
    _TRACES["generate"] += 1
    held = _held_tuples(state)
    params, state = _prepared(params, state, loop, cfg, layout)
    state, carry = loop.advance(params, state, carry, begin, end, cfg, inputs)
    return backend.finish(state, layout, held), carry


_STATIC = ("loop", "layout")
# Unbounded wrappers of the entries, for lowering a program by hand (tests, tools); calls
# go through `_program`, which bounds the live programs.
_run_donated = jax.jit(_run, donate_argnames=("state",), static_argnames=_STATIC)
_run_kept = jax.jit(_run, static_argnames=_STATIC)
_start_jit = jax.jit(_start, donate_argnames=("state",), static_argnames=_STATIC)
_advance_jit = jax.jit(_advance, donate_argnames=("state", "carry"), static_argnames=_STATIC)
# entry -> (the function it traces, its donated arguments)
_ENTRIES = {
    "run_donated": (_run, ("state",)),
    "run_kept": (_run, ()),
    "start": (_start, ("state",)),
    "advance": (_advance, ("state", "carry")),
}
MAX_PROGRAMS_DEFAULT = 16
_PROGRAMS: "collections.OrderedDict[tuple, object]" = collections.OrderedDict()
_PROGRAMS_LOCK = threading.Lock()
_LIMIT = [int(os.environ.get("JAXGEN_MAX_PROGRAMS", MAX_PROGRAMS_DEFAULT))]


def set_max_programs(count: int) -> int:
    """Keeps at most `count` compiled programs alive (least recently used go first; default
    16, or $JAXGEN_MAX_PROGRAMS); returns the previous limit. Evicted programs are freed:
    their executables, traces and code pages."""
    check_int("max_programs", count, low=1)
    with _PROGRAMS_LOCK:
        previous, _LIMIT[0] = _LIMIT[0], int(count)
        _evict_over_limit()
    return previous


def reserve_programs(count: int) -> None:
    """Raises the live-program limit by `count` (a long-lived user of that many programs,
    e.g. a serving engine, keeps them alive beside everyone else's); `release_programs`
    gives them back."""
    check_int("count", count, low=0)
    with _PROGRAMS_LOCK:
        _LIMIT[0] += int(count)


def release_programs(count: int) -> None:
    """Lowers the limit by `count` again (at least 1 stays); the least recently used
    programs past it are freed."""
    check_int("count", count, low=0)
    with _PROGRAMS_LOCK:
        _LIMIT[0] = max(1, _LIMIT[0] - int(count))
        _evict_over_limit()


def live_programs() -> int:
    """How many compiled programs (static configurations) are alive in this process."""
    with _PROGRAMS_LOCK:
        return len(_PROGRAMS)


def _evict_over_limit() -> None:
    while len(_PROGRAMS) > _LIMIT[0]:
        _, jitted = _PROGRAMS.popitem(last=False)
        jitted.clear_cache()  # the executables, the traces and jax's lookups of this wrapper


def _signature(args: tuple) -> tuple:
    """What selects a compiled program besides the static names: the arguments' tree
    structure (with the static aux data: config fields, model, prompt bucket) and every
    leaf's shape, dtype, weak type and sharding."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    return tree, tuple(_leaf_signature(leaf) for leaf in leaves)


def _leaf_signature(leaf) -> tuple:
    if isinstance(leaf, jax.core.Tracer):
        aval = leaf.aval
        return aval.shape, str(aval.dtype), getattr(aval, "weak_type", False)
    if isinstance(leaf, jax.Array):
        return leaf.shape, str(leaf.dtype), getattr(leaf, "weak_type", False), leaf.sharding
    return np.shape(leaf), type(leaf).__name__, str(getattr(leaf, "dtype", ""))


def _program(name: str, args: tuple, statics: dict):
    """The jit wrapper of one static configuration of entry `name`, made on first use; the
    least recently used past the limit is cleared. One wrapper (a function object of its
    own, so clearing it frees only its program) per configuration."""
    key = (name, tuple(sorted(statics.items())), _signature(args))
    with _PROGRAMS_LOCK:
        jitted = _PROGRAMS.pop(key, None)
        if jitted is None:
            fn, donated = _ENTRIES[name]
            jitted = jax.jit(functools.wraps(fn)(lambda *a, **k: fn(*a, **k)),
                             donate_argnames=donated, static_argnames=_STATIC)
        _PROGRAMS[key] = jitted
        _evict_over_limit()
    return jitted


def _call(name: str, args: tuple, **statics):
    """Entry `name` on `args` through its bounded program and the executable cache."""
    return executable_cache.call(name, _program(name, args, statics), args, **statics)


# Each entry goes through jaxgen.runtime.executable_cache: a plain jit call unless a cache is
# enabled (the CLI enables one: a warm process then runs stored executables without tracing).
def run_donated(params, state, cfg, inputs, *, loop, layout="auto"):
    params = _laid_out(params, state, loop, cfg, layout)
    return _call("run_donated", (params, state, cfg, inputs), loop=loop, layout=layout)


def run_kept(params, state, cfg, inputs, *, loop, layout="auto"):
    params = _laid_out(params, state, loop, cfg, layout)
    return _call("run_kept", (params, state, cfg, inputs), loop=loop, layout=layout)


def start(params, state, cfg, inputs, *, loop, layout="auto"):
    params = _laid_out(params, state, loop, cfg, layout)
    return _call("start", (params, state, cfg, inputs), loop=loop, layout=layout)


def advance(params, state, carry, begin, end, cfg, inputs, *, loop, layout="auto"):
    params = _laid_out(params, state, loop, cfg, layout, begins_call=False)  # a later chunk
    return _call("advance", (params, state, carry, begin, end, cfg, inputs), loop=loop,
                 layout=layout)


def runs_layers_apart(params, state, loop, cfg, layout="auto") -> bool:
    """True when `loop`'s programs run `params` layer by layer (the backend lays them out
    so for this state's rows, or they come so): a state kept between calls may then hold its
    cache as per-layer buffers (jaxgen.cache.layer_forms.to_layer_tuples), which every entry
    hands back in that form, with no stacking copy a call.

    Example:
        >>> import jaxgen
        >>> from jaxgen.loops.decode import DecodeLoop
        >>> from jaxgen.models import tiny_llama
        >>> model, params = tiny_llama()                 # small: runs stacked
        >>> cfg = jaxgen.GenerationConfig(max_new_tokens=2)
        >>> runs_layers_apart(params, jaxgen.init_state(model, [[1, 2]], cfg), DecodeLoop(), cfg)
        False
    """
    return backend.layers_apart(_laid_out(params, state, loop, cfg, layout, begins_call=False))


def cache_apart(cache):
    """The cache one buffer per layer (`to_layer_tuples`), by a program the executable store
    keeps, so a fresh process that stored it compiles nothing. The input is left as it is."""
    return executable_cache.call("cache_apart", _cache_apart_jit, (cache,))


def cache_stacked(cache):
    """`cache_apart`'s inverse (`to_stacked_layers`), by a stored program too."""
    return executable_cache.call("cache_stacked", _cache_stacked_jit, (cache,))


_cache_apart_jit = jax.jit(to_layer_tuples)
_cache_stacked_jit = jax.jit(to_stacked_layers)


def trace_count() -> int:
    """How many times a generate program has been traced (compiled) in this process."""
    return _TRACES["generate"]

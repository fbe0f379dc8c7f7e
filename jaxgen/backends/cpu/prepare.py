"""The CPU backend's preparation of a compiled generate call: what `jaxgen.runtime.backend`
calls, and the only entry into this package.

    layout_plan(model, params, rows, layout)   host: how the weights are laid out (None: as
                                               they are); hashable, so a laid-out copy can be
                                               kept per params and plan
    layout_pieces(params, plan)                traced: the arrays the layout computes
    with_layout(params, pieces, plan)          host or traced: params in that layout
    on_huge_pages(params, laid_out)            host, in the background: the laid-out params
                                               with the arrays a step streams copied onto
                                               huge pages (huge_pages.py)
    prepare(model, params, state, rows,        traced, at the top of the program: params laid
            layer_tuples, layout)              out (unless laid out already) and, with per-layer
                                               weights, the cache held as per-layer buffers,
                                               dense and int8 ones attending through the native
                                               attention kernels (kernel_attention.py)
    finish(state, stack=True)                  traced, at the end: the cache in the caller's
                                               class, stacked back (the caller's form, so
                                               donated buffers alias) unless stack is False

Example:
    >>> import jaxgen
    >>> from jaxgen.models import tiny_llama
    >>> model, params = tiny_llama()
    >>> layout_plan(model, params, rows=1, layout="auto") is None      # small: as it is
    True
    >>> [name for name, _ in layout_plan(model, params, rows=1, layout="split")]  # forced
    ['fuse', 'kernel', 'rowwise']
"""
from __future__ import annotations

import jax

from jaxgen.backends.cpu import huge_pages, layer_split
from jaxgen.backends.cpu.kernel_attention import with_kernel_attention, without_kernel_attention
from jaxgen.cache.layer_forms import to_layer_tuples, to_stacked_layers


def layout_plan(model, params, rows: int | None, layout: str) -> tuple | None:
    """`layer_split.decoding_plan` as sorted (keyword, value) pairs, or None."""
    plan = layer_split.decoding_plan(model, params, rows, layout)
    return None if plan is None else tuple(sorted(plan.items()))


def layout_pieces(params, plan: tuple):
    """The arrays the plan computes from params, each once (a compiled call returns them)."""
    return layer_split.split_pieces(params, **dict(plan))


def with_layout(params, pieces, plan: tuple):
    """params laid out as `layout_pieces` computed them (no array work)."""
    return layer_split.with_split_pieces(params, pieces, kernel=dict(plan)["kernel"])


def on_huge_pages(params, laid_out, stop=lambda: False):
    """laid_out with the arrays every decode step streams read from copies on huge pages: the
    layout's own arrays (no longer the caller's: the copy replaces them) and the head's (a
    tied head's embedding is the caller's; its copy serves the embedding lookup too). The
    caller's other arrays stay as they are. laid_out itself where the host gives no huge
    pages, or when `stop()` turns true midway. Values, shapes, dtypes and devices are unchanged
    (no program compiles again)."""
    own = {id(leaf) for leaf in jax.tree_util.tree_leaves(params)}
    head = {id(leaf) for leaf in jax.tree_util.tree_leaves(laid_out.get("lm_head"))}
    streamed = [leaf for leaf in jax.tree_util.tree_leaves(laid_out)
                if id(leaf) not in own or id(leaf) in head]
    copies = huge_pages.on_huge_pages(streamed, stop)
    if not copies:
        return laid_out
    return jax.tree_util.tree_map(lambda leaf: copies.get(id(leaf), leaf), laid_out)


def prepare(model, params, state, rows: int | None, layer_tuples: bool, layout: str):
    """(params, state) as the program runs them: weights laid out for decoding and, when the
    forward unrolls per-layer weights and the loop takes it (`layer_tuples`), the cache held
    as one buffer per layer (XLA:CPU copies a stacked layer's slice before every matmul that
    reads it), whose few-query attention runs the native kernel when it is built."""
    decoded = layer_split.for_decoding(model, params, rows=rows, layout=layout)
    unrolled = isinstance(decoded, dict) and isinstance(decoded.get("layers"), (list, tuple))
    if unrolled and layer_tuples:
        state = state.replace(cache=with_kernel_attention(to_layer_tuples(state.cache)))
    return decoded, state


def finish(state, stack: bool = True):
    """The state with its cache in the caller's class and, unless `stack` is False (a caller
    that holds its cache per layer between calls), stacked back (a no-op for stacked
    caches)."""
    if not hasattr(state, "cache"):  # None, or a loop state without a cache
        return state
    cache = without_kernel_attention(state.cache)
    return state.replace(cache=to_stacked_layers(cache) if stack else cache)


__all__ = ["finish", "layout_pieces", "layout_plan", "on_huge_pages", "prepare",
           "with_layout"]

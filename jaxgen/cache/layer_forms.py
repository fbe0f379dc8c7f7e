"""A cache's per-layer fields in either storage form: stacked, one [L, ...] array, or as a
tuple of L [...] arrays.

Every kind stores its per-layer fields (those whose `field_axes` start with "layer") stacked,
so a model can `lax.scan` over its layers with the cache in the carry. A forward that unrolls
over its layers can carry them as tuples instead, so each layer's buffer is read and written in
place (a backend chooses this: `jaxgen.backends.cpu.prepare`; the layout helpers of
`jaxgen.cache.layout` take either form). `to_layer_tuples` and `to_stacked_layers` convert
between the forms, `holds_layer_tuples` tells which one a cache holds; kinds without
`field_axes`, and caches kept in another memory space (offloaded to host), keep theirs.

An unrolled forward computes what all its layers read (RoPE's cos / sin) through
`computed_once`: a backend's cache class may say how to keep it one computation (XLA:CPU
would otherwise recompute it inside every layer's fused operations).

Example:
    >>> from jaxgen.cache import KVCache
    >>> cache = KVCache.init(num_layers=3, batch=1, max_len=8, num_kv_heads=2, head_dim=4)
    >>> tuples = to_layer_tuples(cache)
    >>> type(tuples.k), len(tuples.k), tuples.k[0].shape, tuples.max_len
    (<class 'tuple'>, 3, (1, 2, 8, 4), 8)
    >>> holds_layer_tuples(tuples), holds_layer_tuples(cache)
    (True, False)
    >>> to_stacked_layers(tuples).k.shape                  # [L, B, Hkv, T, Dh] again
    (3, 1, 2, 8, 4)
    >>> computed_once(tuples, jnp.cos, jnp.zeros(2))       # no class rule: fn(*args)
    Array([1., 1.], dtype=float32)
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp


def _layer_fields(cache) -> tuple[str, ...]:
    """Names of the fields that lead with the layer axis ((): the kind cannot be split)."""
    axes = getattr(type(cache), "field_axes", None)
    if axes is None or not dataclasses.is_dataclass(cache):
        return ()
    if getattr(cache, "memory_kind", None) is not None:  # offloaded: moved layer by layer
        return ()
    return tuple(name for name, names in axes.items()
                 if names and names[0] == "layer" and getattr(cache, name, None) is not None)


def holds_layer_tuples(cache) -> bool:
    """True when the cache's per-layer fields are tuples of per-layer arrays."""
    return any(isinstance(getattr(cache, name), tuple) for name in _layer_fields(cache))


def to_layer_tuples(cache):
    """The cache with each [L, ...] field as a tuple of L [...] arrays (unchanged when it is
    in tuples already or its kind cannot be split)."""
    changes = {name: tuple(value[index] for index in range(value.shape[0]))
               for name in _layer_fields(cache)
               if not isinstance(value := getattr(cache, name), tuple)}
    return dataclasses.replace(cache, **changes) if changes else cache


def to_stacked_layers(cache):
    """The inverse of `to_layer_tuples`: each tuple field stacked into one [L, ...] array."""
    changes = {name: jnp.stack(value) for name in _layer_fields(cache)
               if isinstance(value := getattr(cache, name), tuple)}
    return dataclasses.replace(cache, **changes) if changes else cache


def computed_once(cache, fn, *args):
    """fn(*args), for every layer of one forward to read: as the cache's class computes such
    values once (its `compute_once(fn, *args)`, a backend's), else simply fn(*args). args:
    arrays (static settings go into fn)."""
    compute_once = getattr(type(cache), "compute_once", None)
    return fn(*args) if compute_once is None else compute_once(fn, *args)

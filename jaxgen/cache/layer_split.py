"""A cache's per-layer fields split into one buffer per layer, and stacked back.

Every kind stores its per-layer fields (those whose `field_axes` start with "layer") as one
[L, ...] array, so a model can `lax.scan` over its layers with the cache in the carry. XLA:CPU
cannot hand a matmul a slice of a buffer: when a forward unrolls over per-layer weights
(models/layer_split.py) and reads layer l of a stacked cache, every layer's keys and values
are copied out of the stack before the attention products (a `slice` fusion per layer, read
and written once more than the attention reads them). At long contexts the copy shows: a
random 8-layer model with 8 KV heads decoded a 16k-token static cache at 13.1 tok/s stacked
and 20.3 split (`benchmarks/bench_cache.py` with and without `--stacked-cache`; within the
noise at 4k).

`split_cache` turns those fields into tuples of L arrays (the same dataclass, the same
methods: jaxgen.cache.layout's helpers take either form), so a compiled generate call
(jaxgen.compiled) carries one buffer per layer through its decode loop, where each write is
in place and each read takes the buffer as it is. `stack_cache` restores the [L, ...] form
the caller's state had. A split cache needs static layer indices (the unrolled forward);
kinds without `field_axes`, and caches kept in another memory space (offloaded to host),
are left as they are.

Example:
    >>> from jaxgen.cache import KVCache
    >>> cache = KVCache.init(num_layers=3, batch=1, max_len=8, num_kv_heads=2, head_dim=4)
    >>> split = split_cache(cache)
    >>> type(split.k), len(split.k), split.k[0].shape, split.max_len
    (<class 'tuple'>, 3, (1, 2, 8, 4), 8)
    >>> is_split(split), is_split(cache)
    (True, False)
    >>> stack_cache(split).k.shape                        # [L, B, Hkv, T, Dh] again
    (3, 1, 2, 8, 4)
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


def is_split(cache) -> bool:
    """True when the cache's per-layer fields are tuples of per-layer arrays."""
    return any(isinstance(getattr(cache, name), tuple) for name in _layer_fields(cache))


def split_cache(cache):
    """The cache with each [L, ...] field as a tuple of L [...] arrays (unchanged when it is
    split already or its kind cannot be split)."""
    changes = {name: tuple(value[index] for index in range(value.shape[0]))
               for name in _layer_fields(cache)
               if not isinstance(value := getattr(cache, name), tuple)}
    return dataclasses.replace(cache, **changes) if changes else cache


def stack_cache(cache):
    """The inverse of `split_cache`: each tuple field stacked into one [L, ...] array."""
    changes = {name: jnp.stack(value) for name in _layer_fields(cache)
               if isinstance(value := getattr(cache, name), tuple)}
    return dataclasses.replace(cache, **changes) if changes else cache

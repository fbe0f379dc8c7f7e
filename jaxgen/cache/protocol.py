"""`Cache`: what models and decoding loops require of a KV cache, whatever its kind.

A cache holds every layer's keys and values in fixed-shape arrays, stacked over layers, so a
model can `lax.scan` over its layers with the cache in the carry; each row has its own length.
Every kind is a frozen dataclass registered as a PyTree (arrays as leaves, configuration as
static fields), so it can be donated to jit, carried through `lax.scan` / `lax.while_loop`,
and reordered leaf by leaf along each leaf's batch axis (beam search, jaxgen.loops.beam).

Visibility rule: a query at position p sees the keys at positions j <= p (and, for
sliding-window models, j > p - window). Every forward writes a contiguous block starting at
the row's current length, so the keys a query can see are always fresh; anything at
j >= length is stale and is overwritten before it becomes visible. Rolling back a rejected
speculative tail is therefore just `cache.rollback(n)`.

Who calls what:

    models (jaxgen/models/llama.py)      update_attend, once per layer inside the layer scan; then
                                  with_length(positions[:, -1] + 1)
    decode / beam loops           with_length
    speculative decoding          rollback, length
    jaxgen.drivers.growing                max_len, nbytes, resize (only kinds that can grow:
                                  `GrowableCache`)
    jaxgen.cache.check_rollback   length, max_rollback, kind
    test stubs, benchmarks        update, attend, batch

The kinds that implement it (jaxgen.cache.factory.make_cache builds them by name):
KVCache ("static"), DynamicKVCache ("dynamic"), QuantizedKVCache ("quantized"),
SlidingWindowCache ("sliding_window"), OffloadedKVCache ("offloaded").

Example:
    >>> from jaxgen.cache import Cache, GrowableCache, KVCache, SlidingWindowCache
    >>> shape = dict(num_layers=1, batch=1, max_len=8, num_kv_heads=1, head_dim=2)
    >>> isinstance(KVCache.init(**shape), GrowableCache)
    True
    >>> ring = SlidingWindowCache.init(**shape, window=4)
    >>> isinstance(ring, Cache), isinstance(ring, GrowableCache)
    (True, False)
"""
from __future__ import annotations

from typing import ClassVar, Protocol, runtime_checkable

import jax


@runtime_checkable
class Cache(Protocol):
    """A KV cache of any kind (see the module docs for who calls what).

    Shapes: k_new, v_new [B, S, Hkv, Dh] (a model's new keys / values, sequence-major);
    q [B, S, H, Dh] with H a multiple of Hkv (grouped-query attention); positions,
    q_positions int32 [B, S]; layer an int32 scalar that may be traced.
    """

    kind: ClassVar[str]  # the cache_implementation name, e.g. "static"
    length: jax.Array  # int32 [B]: valid positions per row

    @property
    def max_len(self) -> int:
        """Positions the storage holds per row (a ring's slot count, not a position limit)."""
        ...

    @property
    def batch(self) -> int:
        """Rows B."""
        ...

    def nbytes(self) -> int:
        """Bytes held by all the cache's arrays."""
        ...

    def update(self, layer, k_new: jax.Array, v_new: jax.Array,
               positions: jax.Array) -> Cache:
        """Writes one layer's new K/V at `positions`; returns the new cache."""
        ...

    def attend(self, layer, q: jax.Array, q_positions: jax.Array, *, scale: float,
               window: int | None = None, softcap: float | None = None) -> jax.Array:
        """Attention of q over one layer's cached keys. Returns [B, S, H, Dh] in q's dtype.
        softcap: attention logit soft-capping (Gemma 2), None for none."""
        ...

    def update_attend(self, layer, q: jax.Array, k_new: jax.Array, v_new: jax.Array,
                      positions: jax.Array, *, scale: float, window: int | None = None,
                      softcap: float | None = None) -> tuple[jax.Array, Cache]:
        """Writes the new K/V and attends with queries at `positions`; returns (out, cache).

        What models call. Kinds whose storage is smaller than the chunk being written (the
        sliding-window ring) attend over "old entries + the new chunk" before writing, so
        prompts longer than the ring are exact.
        """
        ...

    def with_length(self, length: jax.Array) -> Cache:
        """A copy whose rows hold `length` (int32 [B]) valid positions."""
        ...

    def max_rollback(self) -> jax.Array:
        """int32 [B]: how many tokens each row can roll back now."""
        ...

    def rollback(self, n: jax.Array) -> Cache:
        """Forgets the last n (int or int32 [B]) positions of each row by lowering `length`.
        Raises ValueError outside jit when impossible (jaxgen.cache.check_rollback)."""
        ...


@runtime_checkable
class GrowableCache(Cache, Protocol):
    """A cache whose storage can be re-allocated between jitted calls (jaxgen.drivers.growing)."""

    def resize(self, max_len: int) -> GrowableCache:
        """A copy with `max_len` positions per row (grown with zeros, or cropped); the
        positions it holds are unchanged."""
        ...

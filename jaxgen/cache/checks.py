"""Host-side checks and helpers shared by every cache kind.

Example:
    >>> import jax.numpy as jnp
    >>> from jaxgen.cache import KVCache, cache_nbytes, check_rollback
    >>> cache = KVCache.init(num_layers=1, batch=1, max_len=8, num_kv_heads=1, head_dim=2)
    >>> cache = cache.with_length(jnp.array([3]))
    >>> cache_nbytes(cache)          # k, v: 2 x 1*1*1*8*2 float32; length: 1 int32
    132
    >>> check_rollback(cache, 2)     # possible: returns None
    >>> check_rollback(cache, 4)
    Traceback (most recent call last):
        ...
    ValueError: cannot roll back [4] tokens: rows hold [3] (allowed: 0..length per row)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def is_concrete(x) -> bool:
    """True outside a trace (x is not a jax Tracer), where host-side checks can run."""
    return not isinstance(x, jax.core.Tracer)


def cache_nbytes(cache) -> int:
    """Bytes held by every array of a cache PyTree."""
    return int(sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(cache)))


def check_rollback(cache, n) -> None:
    """Host-side check before `cache.rollback(n)`: raises ValueError if it is impossible.

    n: int or int32 [B]. Works for every kind (kinds without limits only check
    0 <= n <= length). Call it outside jit, on concrete arrays.
    """
    n = np.broadcast_to(np.asarray(n), np.shape(cache.length))
    length = np.asarray(cache.length)
    if (n < 0).any() or (n > length).any():
        raise ValueError(f"cannot roll back {n.tolist()} tokens: rows hold {length.tolist()} "
                         f"(allowed: 0..length per row)")
    limit = np.asarray(cache.max_rollback())
    if (n > limit).any():
        rows = np.nonzero(n > limit)[0].tolist()
        raise ValueError(
            f"cannot roll back {n.tolist()} tokens: the {cache.kind} cache of row(s) {rows} "
            f"can only roll back {limit.tolist()} (the ring has wrapped past the rolled-back "
            f"tokens' window); raise cache_config['rollback_slack']")


def rollback_by_length(cache, n):
    """`cache.rollback(n)` for every kind: forgets the last n[B] positions of each row by
    setting its length (no copy). Outside jit (concrete arrays) an impossible rollback raises
    ValueError (`check_rollback`); under jit nothing can raise (see each kind's docs)."""
    n = jnp.asarray(n, jnp.int32)
    if is_concrete(n) and is_concrete(cache.length):
        check_rollback(cache, n)
    return cache.with_length(cache.length - n)

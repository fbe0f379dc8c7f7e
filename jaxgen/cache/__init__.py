"""The KV-cache family: one protocol (`Cache`), five kinds, and `make_cache(kind, ...)`.

Modules, lowest first (each imports only modules above it in this list):

    protocol    Cache, GrowableCache: what models and loops call
    checks      is_concrete, cache_nbytes, check_rollback, rollback_by_length
    layout      heads_major, scatter_heads_major, stored_shape: the [.., B, Hkv, T, Dh]
                storage layout, per-layer fields stacked [L, ...] or as tuples
    layer_forms to_layer_tuples, to_stacked_layers, holds_layer_tuples: a cache's
                per-layer fields stacked or one buffer per layer (a backend chooses)
    attention   KeyBlock, attend_blocks: the attention kernel every kind reads through
    ring        ring_write, ring_holds_window, ring_max_rollback: ring-buffer storage
    dense       KVCache ("static"), DynamicKVCache ("dynamic"), attend_dense
    int8        QuantizedKVCache ("quantized") and its int8 / 4-bit codec
    window      SlidingWindowCache ("sliding_window"), raise_if_lost
    offload     OffloadedKVCache ("offloaded")
    factory     CACHE_KINDS, CACHE_CONFIG_KEYS, SUPPORTED_NBITS, validate_cache_config,
                make_cache: the only module that imports every kind
    sharding    shard_cache, cache_shardings, check_mesh: caches on a ("data", "model")
                mesh, by the `field_axes` each kind declares (imports no kind)

Example:
    >>> import jax.numpy as jnp
    >>> from jaxgen.cache import Cache, KVCache, make_cache
    >>> cache = KVCache.init(num_layers=2, batch=1, max_len=8, num_kv_heads=1,
    ...                      head_dim=4, dtype=jnp.float32)
    >>> cache.k.shape                                   # [L, B, Hkv, T, Dh]
    (2, 1, 1, 8, 4)
    >>> isinstance(make_cache("offloaded", num_layers=2, batch=1, max_len=8,
    ...                       num_kv_heads=1, head_dim=4), Cache)
    True
"""
from jaxgen.cache.checks import cache_nbytes, check_rollback
from jaxgen.cache.dense import DynamicKVCache, KVCache, attend_dense
from jaxgen.cache.factory import (
                                  CACHE_CONFIG_KEYS,
                                  CACHE_KINDS,
                                  SUPPORTED_NBITS,
                                  make_cache,
                                  validate_cache_config,
)
from jaxgen.cache.int8 import QuantizedKVCache
from jaxgen.cache.offload import OffloadedKVCache
from jaxgen.cache.protocol import Cache, GrowableCache
from jaxgen.cache.sharding import cache_shardings, check_mesh, shard_cache
from jaxgen.cache.window import SlidingWindowCache, raise_if_lost

__all__ = [
    "Cache", "GrowableCache", "KVCache", "DynamicKVCache", "QuantizedKVCache",
    "SlidingWindowCache", "OffloadedKVCache", "make_cache", "validate_cache_config",
    "CACHE_KINDS", "CACHE_CONFIG_KEYS", "SUPPORTED_NBITS", "check_rollback", "cache_nbytes",
    "raise_if_lost", "attend_dense", "cache_shardings", "check_mesh", "shard_cache",
]

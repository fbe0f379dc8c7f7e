"""Cache kinds by name: `make_cache(kind, ...)` and `validate_cache_config`.

Kinds (`cache_implementation`, Hugging Face's names; `cache_config` keys in parentheses):

    "static"          dense k, v [L, B, Hkv, T, Dh] (jaxgen.cache.dense)          (none)
    "dynamic"         dense, starts at a small bucket and doubles between jitted chunks
                      (jaxgen.cache.dense, jaxgen.drivers.growing)     (initial_length, chunk_size)
    "quantized"       int8 (or 4-bit) codes of Hadamard-rotated K/V + per-token, per-group
                      scales, optional full-precision window of recent tokens
                      (jaxgen.cache.int8) (nbits, q_group_size, residual_length,
                      rollback_slack, rotate, backend)
    "sliding_window"  Mistral-style ring buffer of window + slack slots (jaxgen.cache.window)
                      (sliding_window, rollback_slack)
    "offloaded"       dense, kept in host memory ("pinned_host") and moved in per layer;
                      a no-op on CPU (jaxgen.cache.offload)   (memory_kind, offload_on_cpu)

This is the only module that imports every kind; kinds never import it.

Example:
    >>> from jaxgen.cache import make_cache, validate_cache_config
    >>> make_cache("quantized", num_layers=2, batch=1, max_len=8, num_kv_heads=1,
    ...            head_dim=4).kq.dtype
    dtype('int8')
    >>> make_cache("sliding_window", num_layers=2, batch=1, max_len=64, num_kv_heads=1,
    ...            head_dim=4, sliding_window=16).k.shape     # [L, B, Hkv, S, Dh]
    (2, 1, 1, 16, 4)
    >>> validate_cache_config("dynamic", {"chunk_size": 32})
    {'initial_length': 256, 'chunk_size': 32}
    >>> validate_cache_config("quantized", {"nbits": 2})
    Traceback (most recent call last):
        ...
    ValueError: cache_config['nbits']=2 is not supported by the quantized cache (allowed: 8 (int8) or 4 (packed 4-bit))
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxgen.cache.dense import DynamicKVCache, KVCache
from jaxgen.cache.int8 import QMAX, QuantizedKVCache
from jaxgen.cache.offload import OffloadedKVCache
from jaxgen.cache.protocol import Cache
from jaxgen.cache.window import SlidingWindowCache

CACHE_KINDS = ("static", "dynamic", "quantized", "sliding_window", "offloaded")

# cache_config keys per kind, with their defaults (None: filled in from the model / state).
CACHE_CONFIG_KEYS: dict[str, dict[str, Any]] = {
    "static": {},
    "dynamic": {"initial_length": 256, "chunk_size": 64},
    "quantized": {"nbits": 8, "q_group_size": None, "residual_length": 0,
                  "rollback_slack": 0, "backend": None, "rotate": True},
    "sliding_window": {"sliding_window": None, "rollback_slack": 0},
    "offloaded": {"memory_kind": "pinned_host", "offload_on_cpu": False},
}
SUPPORTED_NBITS = tuple(QMAX)  # (8, 4)


def _check_int(kind: str, key: str, value, low: int) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low:
        raise ValueError(f"cache_config[{key!r}] for cache_implementation={kind!r} must be an "
                         f"int >= {low}, got {value!r}")


def validate_cache_config(kind: str | None, cache_config: dict | None = None, *,
                          head_dim: int | None = None) -> dict:
    """Checks a (cache_implementation, cache_config) pair; returns the config with defaults.

    Raises ValueError naming the field and the allowed values (unknown kind, unknown key,
    nbits other than 8 / 4, a group size that does not divide head_dim, ...).
    """
    kind = "static" if kind is None else kind
    if kind not in CACHE_KINDS:
        raise ValueError(f"unknown cache_implementation {kind!r}; allowed: "
                         f"{', '.join(CACHE_KINDS)}")
    if cache_config is None:
        cache_config = {}
    if not isinstance(cache_config, dict):
        raise ValueError(f"cache_config must be a dict, got {type(cache_config).__name__}")
    allowed = CACHE_CONFIG_KEYS[kind]
    unknown = sorted(set(cache_config) - set(allowed))
    if unknown:
        raise ValueError(f"cache_config key(s) {unknown} are not used by cache_implementation="
                         f"{kind!r}; allowed keys: {sorted(allowed) or 'none'}")
    out = {**allowed, **{k: v for k, v in cache_config.items() if v is not None}}
    if kind == "dynamic":
        _check_int(kind, "initial_length", out["initial_length"], 1)
        _check_int(kind, "chunk_size", out["chunk_size"], 1)
    elif kind == "quantized":
        if out["nbits"] not in SUPPORTED_NBITS or isinstance(out["nbits"], bool):
            raise ValueError(f"cache_config['nbits']={out['nbits']!r} is not supported by the "
                             f"quantized cache (allowed: 8 (int8) or 4 (packed 4-bit))")
        _check_int(kind, "residual_length", out["residual_length"], 0)
        _check_int(kind, "rollback_slack", out["rollback_slack"], 0)
        if out["q_group_size"] is not None:
            _check_int(kind, "q_group_size", out["q_group_size"], 1)
            if head_dim is not None and head_dim % out["q_group_size"]:
                raise ValueError(f"cache_config['q_group_size']={out['q_group_size']} must "
                                 f"divide head_dim={head_dim}")
        if out["nbits"] == 4 and head_dim is not None and head_dim % 2:
            raise ValueError(f"nbits=4 packs two codes a byte: head_dim={head_dim} must be even")
        if not isinstance(out["rotate"], bool):
            raise ValueError("cache_config['rotate'] must be True or False")
        if out["backend"] not in (None, "jaxgen"):
            raise ValueError(f"cache_config['backend']={out['backend']!r}: jaxgen has its own "
                             f"quantizer (allowed: 'jaxgen' or unset)")
    elif kind == "sliding_window":
        if out["sliding_window"] is not None:
            _check_int(kind, "sliding_window", out["sliding_window"], 1)
        _check_int(kind, "rollback_slack", out["rollback_slack"], 0)
    elif kind == "offloaded":
        if out["memory_kind"] not in ("pinned_host", "unpinned_host"):
            raise ValueError(f"cache_config['memory_kind']={out['memory_kind']!r} (allowed: "
                             f"'pinned_host', 'unpinned_host')")
        if not isinstance(out["offload_on_cpu"], bool):
            raise ValueError("cache_config['offload_on_cpu'] must be True or False")
    return out


def make_cache(kind: str | None = "static", *, num_layers: int, batch: int, max_len: int,
               num_kv_heads: int, head_dim: int, dtype=jnp.float32,
               sliding_window: int | None = None, cache_config: dict | None = None) -> Cache:
    """An empty cache of the given kind (HF's `cache_implementation` names).

    sliding_window: the model's window (None: full attention); the "sliding_window" kind
    needs one (from the model or from cache_config["sliding_window"]).
    """
    kind = "static" if kind is None else kind
    opts = validate_cache_config(kind, cache_config, head_dim=head_dim)
    shape = dict(num_layers=num_layers, batch=batch, max_len=max_len,
                 num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype)
    if kind == "static":
        return KVCache.init(**shape)
    if kind == "dynamic":
        return DynamicKVCache.init(**shape)
    if kind == "quantized":
        return QuantizedKVCache.init(**shape, nbits=opts["nbits"],
                                     group_size=opts["q_group_size"],
                                     residual_length=opts["residual_length"],
                                     rollback_slack=opts["rollback_slack"],
                                     rotate=opts["rotate"])
    if kind == "sliding_window":
        window = opts["sliding_window"] or sliding_window
        if window is None:
            raise ValueError("cache_implementation='sliding_window' needs a window: the model "
                             "has no sliding_window in its config; pass cache_config="
                             "{'sliding_window': W}")
        return SlidingWindowCache.init(**shape, window=int(window),
                                       rollback_slack=opts["rollback_slack"])
    return OffloadedKVCache.init(**shape, memory_kind=opts["memory_kind"],
                                 offload_on_cpu=opts["offload_on_cpu"])

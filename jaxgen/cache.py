"""The KV cache protocol, the dense cache, and `make_cache(kind, ...)`.

A cache holds every layer's keys and values in fixed-shape arrays, stacked over layers so
that a model can `lax.scan` over its layers with the cache in the carry. Each row has its
own length (DESIGN s.2). The dense cache:

    k, v    [L, B, Hkv, T, Dh]   keys / values (heads-major), T = static buffer length
    length  int32 [B]            number of valid positions per row

Visibility rule: a query at position p sees the keys at positions j <= p (and, for
sliding-window models, j > p - window). Every forward writes a contiguous block starting at
the row's current length, so the keys a query can see are always fresh; anything at
j >= length is stale and is overwritten before it becomes visible. Rolling back a rejected
speculative tail is therefore just `cache.rollback(n)`.

The protocol every kind implements (models call only these, so kinds are swappable):

    update(layer, k_new, v_new, positions) -> cache          write one layer's new K/V
    attend(layer, q, q_positions, *, scale, window=None)      attention over the cache
    update_attend(layer, q, k_new, v_new, positions, *, scale, window=None) -> (out, cache)
        write + attend in one call; what models use. Kinds whose storage is smaller than
        the chunk being written (the sliding-window ring) attend over "old entries + the
        new chunk" before writing, so prompts longer than the ring are exact.
    with_length(length) / rollback(n) / length / nbytes() / batch_axes()

Kinds (`cache_implementation`, Hugging Face's names; `cache_config` keys in parentheses):

    "static"          dense [L, B, T, Hkv, Dh]                                  (none)
    "dynamic"         dense, starts at a small bucket and doubles between jitted chunks
                      (jaxgen.growing)                           (initial_length, chunk_size)
    "quantized"       int8 (or 4-bit) codes of Hadamard-rotated K/V + per-token, per-group
                      scales, optional full-precision window of recent tokens
                      (jaxgen.cache_int8) (nbits, q_group_size, residual_length,
                      rollback_slack, rotate, backend)
    "sliding_window"  Mistral-style ring buffer of window + slack slots (jaxgen.cache_window)
                      (sliding_window, rollback_slack)
    "offloaded"       dense, kept in host memory ("pinned_host") and moved in per layer;
                      a no-op on CPU (jaxgen.cache_offload)   (memory_kind, offload_on_cpu)

Example:
    >>> cache = KVCache.init(num_layers=2, batch=1, max_len=8, num_kv_heads=1,
    ...                      head_dim=4, dtype=jnp.float32)
    >>> cache.k.shape
    (2, 1, 1, 8, 4)
    >>> make_cache("quantized", num_layers=2, batch=1, max_len=8, num_kv_heads=1,
    ...            head_dim=4).kq.dtype
    dtype('int8')
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.cache_attention import KeyBlock, attend_blocks, heads_major

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
SUPPORTED_NBITS = (8, 4)


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


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
               sliding_window: int | None = None, cache_config: dict | None = None):
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
        from jaxgen.cache_int8 import QuantizedKVCache
        return QuantizedKVCache.init(**shape, nbits=opts["nbits"],
                                     group_size=opts["q_group_size"],
                                     residual_length=opts["residual_length"],
                                     rollback_slack=opts["rollback_slack"],
                                     rotate=opts["rotate"])
    if kind == "sliding_window":
        from jaxgen.cache_window import SlidingWindowCache
        window = opts["sliding_window"] or sliding_window
        if window is None:
            raise ValueError("cache_implementation='sliding_window' needs a window: the model "
                             "has no sliding_window in its config; pass cache_config="
                             "{'sliding_window': W}")
        return SlidingWindowCache.init(**shape, window=int(window),
                                       rollback_slack=opts["rollback_slack"])
    from jaxgen.cache_offload import OffloadedKVCache
    return OffloadedKVCache.init(**shape, memory_kind=opts["memory_kind"],
                                 offload_on_cpu=opts["offload_on_cpu"])


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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Dense static cache (fp32 or bf16). A PyTree; shapes never change.

    Heads-major layout: each (row, head) holds its keys as one contiguous [T, Dh] block, so
    the attention products are plain batched matmuls with no transpose of the cache (on CPU
    a [B, T, Hkv, Dh] layout costs a full copy of every layer's cache per step).
    """

    k: jax.Array  # [L, B, Hkv, T, Dh]
    v: jax.Array  # [L, B, Hkv, T, Dh]
    length: jax.Array  # int32 [B]

    kind: ClassVar[str] = "static"

    @classmethod
    def init(cls, *, num_layers: int, batch: int, max_len: int, num_kv_heads: int,
             head_dim: int, dtype=jnp.float32, **extra) -> "KVCache":
        shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   length=jnp.zeros((batch,), jnp.int32), **extra)

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    def nbytes(self) -> int:
        return cache_nbytes(self)

    def batch_axes(self):
        """Per leaf, the axis that indexes the batch (same structure as the cache)."""
        return dataclasses.replace(self, k=1, v=1, length=0)

    def update(self, layer, k_new: jax.Array, v_new: jax.Array,
               positions: jax.Array) -> "KVCache":
        """Writes one layer's new keys/values at `positions`.

        layer: int32 scalar (may be traced); k_new, v_new: [B, S, Hkv, Dh];
        positions: int32 [B, S]. Positions outside [0, T) are dropped.
        """
        index = heads_major_index(positions, self.k.shape[2], layer)
        k = self.k.at[index].set(heads_major(k_new).astype(self.k.dtype), mode="drop")
        v = self.v.at[index].set(heads_major(v_new).astype(self.v.dtype), mode="drop")
        return dataclasses.replace(self, k=k, v=v)

    def attend(self, layer, q: jax.Array, q_positions: jax.Array, *,
               scale: float, window: int | None = None) -> jax.Array:
        """Attention of queries over this layer's cache.

        q: [B, S, H, Dh]; q_positions: int32 [B, S]. Returns [B, S, H, Dh] in q's dtype.
        window: the model's sliding window (keys at j <= p - window are invisible).
        """
        k_layer = self.k[layer]  # [B, Hkv, T, Dh]
        v_layer = self.v[layer]  # [B, Hkv, T, Dh]
        return attend_dense(q, k_layer, v_layer, q_positions, scale=scale, window=window)

    def update_attend(self, layer, q: jax.Array, k_new: jax.Array, v_new: jax.Array,
                      positions: jax.Array, *, scale: float, window: int | None = None
                      ) -> tuple[jax.Array, "KVCache"]:
        """Writes the new K/V, then attends (queries at `positions`). Returns (out, cache)."""
        cache = self.update(layer, k_new, v_new, positions)
        return cache.attend(layer, q, positions, scale=scale, window=window), cache

    def with_length(self, length: jax.Array) -> "KVCache":
        return dataclasses.replace(self, length=length.astype(jnp.int32))

    def max_rollback(self) -> jax.Array:
        """int32 [B]: how many tokens each row can roll back (dense: all of them)."""
        return self.length

    def rollback(self, n: jax.Array) -> "KVCache":
        """Forgets the last n[B] positions of each row (no copy).

        Outside jit (concrete arrays) an impossible rollback raises ValueError
        (`check_rollback`); under jit it cannot raise, see each kind's docs.
        """
        n = jnp.asarray(n, jnp.int32)
        if _is_concrete(n) and _is_concrete(self.length):
            check_rollback(self, n)
        return self.with_length(self.length - n)

    def resize(self, max_len: int) -> "KVCache":
        """A copy with T = max_len (grows with zeros, or crops; positions are unchanged)."""
        pad = max_len - self.max_len
        if pad < 0:
            return dataclasses.replace(self, k=self.k[:, :, :, :max_len],
                                       v=self.v[:, :, :, :max_len])
        widths = ((0, 0), (0, 0), (0, 0), (0, pad), (0, 0))
        return dataclasses.replace(self, k=jnp.pad(self.k, widths), v=jnp.pad(self.v, widths))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DynamicKVCache(KVCache):
    """The dense cache of `cache_implementation="dynamic"`: same layout, small T that
    jaxgen.growing doubles between jitted chunks (`resize`)."""

    kind: ClassVar[str] = "dynamic"


def heads_major_index(positions: jax.Array, num_kv_heads: int, layer=None) -> tuple:
    """Scatter index of new keys [B, Hkv, S, Dh] into a heads-major [(L,) B, Hkv, T, Dh] array."""
    batch, seq = positions.shape
    shape = (batch, num_kv_heads, seq)
    rows = jnp.broadcast_to(jnp.arange(batch)[:, None, None], shape)  # [B, Hkv, S]
    heads = jnp.broadcast_to(jnp.arange(num_kv_heads)[None, :, None], shape)  # [B, Hkv, S]
    slots = jnp.broadcast_to(positions[:, None, :], shape)  # [B, Hkv, S]
    if layer is None:
        return rows, heads, slots
    return jnp.full(shape, layer, jnp.int32), rows, heads, slots


def attend_dense(q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array, *,
                 scale: float, window: int | None = None) -> jax.Array:
    """Grouped-query attention with the causal-by-position mask.

    q: [B, S, H, Dh]; k, v: [B, Hkv, T, Dh] (heads-major); q_positions: int32 [B, S].
    Key j is visible to a query at position p iff j <= p (and p - j < window). Softmax in fp32.
    """
    block = KeyBlock(k=k, v=v, positions=jnp.arange(k.shape[2], dtype=jnp.int32))
    return attend_blocks(q, q_positions, [block], scale=scale, window=window)

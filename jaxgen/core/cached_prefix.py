"""`CachedPrefix`: K/V already computed for the first tokens of every row, and `fit_cache`,
which copies them into the cache of a new (larger) state.

`init_state(model, prompts, cfg, prefix=CachedPrefix(...))` puts the prefix's tokens before
every prompt, copies the prefix's cache into every row (one cached row is shared by all rows;
otherwise one per row) and prefills only the positions after it
(`DecodeState.cached`, `jaxgen.core.step.prefill`). Two uses build one:

    jaxgen.prefill_prefix(model, params, ids, cfg)   a shared prefix (system prompt, few-shot
                                                     block), computed once (jaxgen.api.prefix_prefill)
    jaxgen.continue_state(out, new_tokens, cfg)      a finished call's rows, continued with new
                                                     tokens (jaxgen.core.continuation)

Kinds it copies: "static", "dynamic", "offloaded" (the time axis cropped or grown),
"quantized" (codes and scales likewise, the residual ring re-slotted) and "sliding_window"
(the ring re-slotted for its new slot count: it keeps the newest positions before the cached
length, which is the window every later query attends to). Other caches are refused.

Example:
    >>> import numpy as np
    >>> from jaxgen.cache import KVCache
    >>> old = KVCache.init(num_layers=1, batch=1, max_len=8, num_kv_heads=1, head_dim=2)
    >>> new = KVCache.init(num_layers=1, batch=3, max_len=16, num_kv_heads=1, head_dim=2)
    >>> fitted = fit_cache(old, new, np.zeros(3, int), np.array([5, 5, 5]))
    >>> fitted.k.shape, fitted.length.tolist()       # [L, B, Hkv, T, Dh]
    ((1, 3, 1, 16, 2), [5, 5, 5])
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.cache.int8 import QuantizedKVCache
from jaxgen.cache.dense import KVCache
from jaxgen.cache.layer_forms import holds_layer_tuples
from jaxgen.cache.ring import ring_holds_window
from jaxgen.cache.window import SlidingWindowCache

FITTED_KINDS = ("static", "dynamic", "offloaded", "quantized", "sliding_window")


@dataclasses.dataclass(frozen=True)
class CachedPrefix:
    """Tokens whose K/V a cache already holds, per cached row (host-side handle).

    model   the model that computed the cache (a continuation with another one is refused)
    tokens  tuple of R token tuples: row r's tokens (put before every prompt)
    cached  tuple of R ints: how many of them the cache holds (<= len(tokens[r]))
    cache   a Cache of R rows (per-layer fields stacked). R = 1: shared by every row.
    """

    model: Any
    tokens: tuple
    cached: tuple
    cache: Any

    @property
    def rows(self) -> int:
        return len(self.tokens)

    def source_rows(self, batch: int) -> np.ndarray:
        """int [batch]: the cached row each of `batch` rows copies (ValueError otherwise)."""
        if self.rows == 1:
            return np.zeros((batch,), np.int64)
        if self.rows != batch:
            raise ValueError(f"prefix holds {self.rows} cached rows but the state has {batch}: "
                             f"pass one cached row (shared) or one per row")
        return np.arange(batch)


def check_prefix(prefix, model) -> None:
    """ValueError unless `prefix` is a CachedPrefix computed by `model`."""
    if not isinstance(prefix, CachedPrefix):
        raise ValueError(f"`prefix` must be a jaxgen.CachedPrefix (from jaxgen.prefill_prefix "
                         f"or jaxgen.continue_state), got {type(prefix).__name__}")
    if prefix.model != model:
        raise ValueError(f"`prefix` was computed by another model ({type(prefix.model).__name__}"
                         f" {getattr(prefix.model, 'config', '')!r}); its cache cannot be "
                         f"continued with {type(model).__name__} "
                         f"{getattr(model, 'config', '')!r}")
    kind = getattr(prefix.cache, "kind", type(prefix.cache).__name__)
    if kind not in FITTED_KINDS:
        raise ValueError(f"a {kind!r} cache cannot be continued (allowed cache kinds: "
                         f"{list(FITTED_KINDS)})")
    if holds_layer_tuples(prefix.cache):
        raise ValueError("the prefix's cache holds per-layer tuples; pass a state as generate "
                         "returns it (stacked layers)")


def _take_rows(cache, rows: np.ndarray):
    """The cache with its rows gathered: row b of the result is row rows[b] of `cache`."""
    index = jnp.asarray(rows, jnp.int32)  # [B]
    changes = {}
    for name, axes in type(cache).field_axes.items():
        value = getattr(cache, name)
        if value is not None and "batch" in axes:
            changes[name] = jnp.take(value, index, axis=axes.index("batch"))
    return dataclasses.replace(cache, **changes)


def _reslot(k, v, pos, slots: int, upto: np.ndarray):
    """Ring buffers k, v [L, B, Hkv, S, Dh], pos int32 [L, B, S] re-slotted for `slots` slots:
    each row keeps its newest positions below upto[b] (position j in slot j % slots)."""
    old_slots = pos.shape[-1]
    last = jnp.asarray(upto, jnp.int32)[None, :, None] - 1  # [1, B, 1]
    slot = jnp.arange(slots, dtype=jnp.int32)[None, None]  # [1, 1, S']
    want = last - jnp.mod(last - slot, slots)  # [L?, B, S'] newest position of slot s'
    want = jnp.broadcast_to(want, pos.shape[:2] + (slots,))  # [L, B, S']
    source = jnp.mod(want, old_slots)  # [L, B, S']
    held = jnp.take_along_axis(pos, source, axis=-1)  # [L, B, S']
    keep = (want >= 0) & (held == want)  # [L, B, S']
    shape = k.shape[:3] + (slots, k.shape[-1])
    gather = jnp.broadcast_to(source[:, :, None, :, None], shape)  # [L, B, Hkv, S', Dh]
    mask = keep[:, :, None, :, None]

    def move(buf):
        return jnp.where(mask, jnp.take_along_axis(buf, gather, axis=3), 0).astype(buf.dtype)

    return move(k), move(v), jnp.where(keep, want, -1).astype(jnp.int32)


def _resized(cache, target, upto: np.ndarray):
    """`cache` (rows already gathered) in `target`'s shapes."""
    if isinstance(cache, SlidingWindowCache):
        k, v, pos = _reslot(cache.k, cache.v, cache.pos, target.max_len, upto)
        return dataclasses.replace(cache, k=k, v=v, pos=pos)
    if isinstance(cache, QuantizedKVCache):
        cache = cache.resize(target.max_len)
        if cache.rk is not None and target.rk is not None:
            rk, rv, rpos = _reslot(cache.rk, cache.rv, cache.rpos, target.rpos.shape[-1], upto)
            cache = dataclasses.replace(cache, rk=rk, rv=rv, rpos=rpos)
        return cache
    if isinstance(cache, KVCache):  # static, dynamic, offloaded
        cache = cache.resize(target.max_len)
        memory_kind = getattr(target, "memory_kind", None)
        if memory_kind is not None:  # offloaded: the fields where the target keeps them
            cache = dataclasses.replace(cache, k=jax.device_put(cache.k, target.k.sharding),
                                        v=jax.device_put(cache.v, target.v.sharding))
        return cache
    raise ValueError(f"a {type(cache).__name__} cannot be continued (allowed cache kinds: "
                     f"{list(FITTED_KINDS)})")


def _describe(cache) -> str:
    leaves = [(tuple(a.shape), str(a.dtype)) for a in jax.tree_util.tree_leaves(cache)]
    return f"{getattr(cache, 'kind', type(cache).__name__)} {leaves}"


def fit_cache(source, target, rows: np.ndarray, cached: np.ndarray):
    """`source`'s rows (row b = source row rows[b]) copied into a cache shaped like the empty
    `target` (same kind and settings; more or fewer positions), holding cached[b] positions.
    ValueError when the kinds, settings or dtypes differ, or a ring lost the window."""
    same = type(source) is type(target) and \
        jax.tree_util.tree_structure(source) == jax.tree_util.tree_structure(target)
    if same:
        fitted = _resized(_take_rows(source, rows), target, cached)
        same = [(a.shape, a.dtype) for a in jax.tree_util.tree_leaves(fitted)] == \
            [(a.shape, a.dtype) for a in jax.tree_util.tree_leaves(target)]
    if not same:
        raise ValueError(f"the cached rows' cache ({_describe(source)}) does not match the "
                         f"cache this config builds ({_describe(target)}): continue with the "
                         f"same cache_implementation, cache_config and cache dtype")
    fitted = fitted.with_length(jnp.asarray(cached, jnp.int32))  # [B]
    if isinstance(fitted, SlidingWindowCache):
        held = np.asarray(ring_holds_window(fitted.pos[0], fitted.length, fitted.window))
        if not held.all() or np.asarray(fitted.lost).any():
            raise ValueError(f"sliding-window cache rows {np.nonzero(~held)[0].tolist()} no "
                             f"longer hold the window before their cached length; they "
                             f"cannot be continued")
    return fitted

"""Dense and int8 caches whose attention runs the native attention kernels.

`with_kernel_attention(cache)` gives a cache of the same fields whose class is a subclass of
the cache's own (`KVCache`, `DynamicKVCache`, `QuantizedKVCache`): its `attend` (and the int8
cache's `update_attend`) run `kernels/decode_attention` when the call is one it takes
(`_kernel_runs`: float32 queries, at most MAX_ROWS query rows per KV head, no soft-capping,
no token tree; int8 codes without a residual ring, float32 scales); forwards of more query
rows (a prefill) over a float32 dense cache or such int8 codes run `kernels/prefill_attention`;
else the cache's own attention. `without_kernel_attention` gives the caller's class back.
The backend's `prepare` swaps the class in at the top of a program whose cache it holds per
layer, `finish` swaps it out at the end, so the caller never holds one.

The kernel reads only the keys a query can see, once; XLA:CPU's batched products read every
slot the cache holds (allocated for the whole generation). On an AVX2 host (Zen 1, two
cores), one layer of 8 KV heads x 64 at 16k keys: 3.4 ms against 5.4 (`benchmarks/
bench_cache.py` gives the whole step).

Example:
    >>> from jaxgen.cache import KVCache
    >>> from jaxgen.cache.layer_forms import to_layer_tuples
    >>> cache = to_layer_tuples(KVCache.init(num_layers=2, batch=1, max_len=8,
    ...                                      num_kv_heads=1, head_dim=8))
    >>> swapped = with_kernel_attention(cache)
    >>> isinstance(swapped, KVCache), type(without_kernel_attention(swapped)) is KVCache
    (True, True)
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxgen.backends.cpu.kernels import decode_attention as kernel
from jaxgen.backends.cpu.kernels import prefill_attention
from jaxgen.cache.attention import heads_out, query_rows
from jaxgen.cache.dense import DynamicKVCache, KVCache
from jaxgen.cache.int8 import QuantizedKVCache
from jaxgen.cache.layer_forms import holds_layer_tuples


def _kernel_runs(q: jax.Array, num_kv_heads: int, softcap, tree_mask, groups=(1, 1)) -> bool:
    """The kernel takes this attention call (decided while tracing)."""
    batch, seq, heads, dim = q.shape
    return (q.dtype == jnp.float32 and softcap is None and tree_mask is None
            and heads % num_kv_heads == 0 and kernel.runs(heads // num_kv_heads * seq, dim,
                                                          *groups)
            and kernel.available())


def _prefill_runs(q: jax.Array, num_kv_heads: int, softcap, tree_mask, groups=(1, 1)) -> bool:
    """The prefill kernel takes this attention call (decided while tracing): float32 queries,
    more query rows per KV head than the decode kernel takes, no soft-capping, no token tree."""
    batch, seq, heads, dim = q.shape
    return (q.dtype == jnp.float32 and softcap is None and tree_mask is None
            and heads // max(num_kv_heads, 1) * seq > kernel.MAX_ROWS
            and prefill_attention.runs(heads, num_kv_heads, dim, *groups)
            and prefill_attention.available())


class _ComputedOnce:
    """What every kernel cache class adds for the unrolled forward that carries it: values
    all its layers read (RoPE's cos / sin, `jaxgen.cache.layer_forms.computed_once`) computed
    once, into buffers the layers read. XLA:CPU otherwise fuses the producer into each
    consumer and recomputes it there: every layer's rotary took its own cos and sin of every
    query and key element (an 8-position verify of SmolLM2, AVX2 build: those fusions 1.00
    against 0.32 ms a forward; 16 positions 1.94 against 0.56). A branch (`lax.cond` with a
    predicate read from the data, fn on both sides) is a boundary XLA does not fuse across;
    `lax.optimization_barrier` is removed before fusion."""

    @staticmethod
    def compute_once(fn, *args):
        leaves = [leaf for leaf in jax.tree_util.tree_leaves(args) if leaf.size]
        if not leaves:
            return fn(*args)
        pred = jnp.ravel(leaves[0])[0] < 0  # either way fn: only the compiler must not know
        return jax.lax.cond(pred, fn, fn, *args)


class _DenseKernelAttention(_ComputedOnce):
    """attend through the kernels for a float32 dense cache (mixed into KVCache and its
    kinds): a few query rows per KV head through the decode kernel, more through the
    prefill kernel."""

    def attend(self, layer, q, q_positions, *, scale: float, window=None, softcap=None,
               tree_mask=None):
        k_layer, v_layer = self.k[layer], self.v[layer]  # [B, Hkv, T, Dh]
        kv_heads = k_layer.shape[1]
        if k_layer.dtype == jnp.float32:
            if _kernel_runs(q, kv_heads, softcap, tree_mask):
                rows = kernel.decode_attention(query_rows(q, kv_heads), k_layer, v_layer,
                                               q_positions, scale=scale,
                                               window=window)  # [B, Hkv, R, Dh]
                return heads_out(rows, q)
            if _prefill_runs(q, kv_heads, softcap, tree_mask):
                return prefill_attention.prefill_attention(q, k_layer, v_layer, q_positions,
                                                           scale=scale, window=window)
        tree = {} if tree_mask is None else {"tree_mask": tree_mask}
        return super().attend(layer, q, q_positions, scale=scale, window=window,
                              softcap=softcap, **tree)


class _CodesKernelAttention(_ComputedOnce):
    """attend / update_attend through the kernels for an int8 cache without a residual ring
    (a few query rows per KV head through the decode kernel, more through the prefill
    kernel): the query rotated into the codes' basis, the output rotated back
    (jaxgen.cache.int8)."""

    def _kernel_path(self, layer, q, softcap) -> str | None:
        """"decode", "prefill" or None (the cache's own attention), decided while tracing."""
        if not (self.nbits == 8 and self.rk is None and self.residual_length == 0
                and self.k_scale[layer].dtype == jnp.float32 and softcap is None):
            return None
        kv_heads, groups = self.kq[layer].shape[1], (self.k_scale[layer].shape[-1],
                                                     self.v_scale[layer].shape[-1])
        if _kernel_runs(q, kv_heads, softcap, None, groups):
            return "decode"
        return "prefill" if _prefill_runs(q, kv_heads, softcap, None, groups) else None

    def _kernel_attend(self, layer, q, q_positions, scale: float, window, path: str):
        rotation = self.rotation
        if path == "prefill":
            rotated = q if rotation is None else q @ rotation  # [B, S, H, Dh]
            out = prefill_attention.prefill_attention(
                rotated, self.kq[layer], self.vq[layer], q_positions, scale=scale,
                window=window, k_scale=self.k_scale[layer],
                v_scale=self.v_scale[layer])  # [B, S, H, Dh]
            return out if rotation is None else out @ rotation.T
        rows = query_rows(q, self.kq[layer].shape[1]).astype(jnp.float32)  # [B, Hkv, R, Dh]
        if rotation is not None:
            rows = rows @ rotation  # [B, Hkv, R, Dh]
        out = kernel.decode_attention(rows, self.kq[layer], self.vq[layer], q_positions,
                                      scale=scale, window=window, k_scale=self.k_scale[layer],
                                      v_scale=self.v_scale[layer])  # [B, Hkv, R, Dh]
        if rotation is not None:
            out = out @ rotation.T  # [B, Hkv, R, Dh]
        return heads_out(out, q)

    def attend(self, layer, q, q_positions, *, scale: float, window=None, softcap=None):
        path = self._kernel_path(layer, q, softcap)
        if path is None:
            return super().attend(layer, q, q_positions, scale=scale, window=window,
                                  softcap=softcap)
        return self._kernel_attend(layer, q, q_positions, scale, window, path)

    def update_attend(self, layer, q, k_new, v_new, positions, *, scale: float, window=None,
                      softcap=None):
        path = self._kernel_path(layer, q, softcap)
        if path is None:
            return super().update_attend(layer, q, k_new, v_new, positions, scale=scale,
                                         window=window, softcap=softcap)
        cache = self.update(layer, k_new, v_new, positions)
        return cache._kernel_attend(layer, q, positions, scale, window, path), cache


_MIXINS = {KVCache: _DenseKernelAttention, DynamicKVCache: _DenseKernelAttention,
           QuantizedKVCache: _CodesKernelAttention}


@functools.cache
def _kernel_class(base: type) -> type:
    """base's subclass with the kernel's attention (a registered dataclass PyTree too);
    `caller_class` names base."""
    cls = type(f"Kernel{base.__name__}", (_MIXINS[base], base),
               {"__module__": __name__, "caller_class": base})
    cls = dataclasses.dataclass(frozen=True)(cls)
    return jax.tree_util.register_dataclass(cls)


def _as_class(cache, cls):
    """The cache's fields in a cache of class cls (no array work)."""
    return cls(**{field.name: getattr(cache, field.name) for field in dataclasses.fields(cache)})


def with_kernel_attention(cache):
    """The cache with its class swapped for the kernel's (same fields, no array work), when
    it is a dense or int8 cache held per layer and the kernel is built; else unchanged."""
    base = type(cache)
    if base not in _MIXINS or not holds_layer_tuples(cache) or not kernel.available():
        return cache
    return _as_class(cache, _kernel_class(base))


def without_kernel_attention(cache):
    """The cache in the class it had before `with_kernel_attention` (others unchanged)."""
    base = getattr(type(cache), "caller_class", None)
    return cache if base is None else _as_class(cache, base)


__all__ = ["with_kernel_attention", "without_kernel_attention"]

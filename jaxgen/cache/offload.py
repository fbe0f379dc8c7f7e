"""Offloaded KV cache (cache_implementation="offloaded"): the dense layout kept in host
memory, moved in one layer at a time.

Where the backend exposes JAX memory kinds (GPU / TPU: "device", "pinned_host"), the stacked
k, v [L, B, Hkv, T, Dh] (heads-major, as in jaxgen.cache.dense) live in `memory_kind`
("pinned_host" by default). Inside the model's layer scan each layer is copied to device
memory (`jax.device_put(..., Space.Device)`), written and attended there, and copied back
(`Space.Host`), as Hugging Face's OffloadedCache does, so device memory holds one layer of KV
at a time (plus XLA's buffers).

On CPU it is a no-op: host and device memory are the same RAM, so the cache stays where it is
and behaves exactly as the static cache (`memory_kind` is None). `offload_on_cpu=True`
forces the memory-kind path on CPU anyway (same results; used to test that path here).

Example:
    >>> from jaxgen.cache import OffloadedKVCache
    >>> c = OffloadedKVCache.init(num_layers=1, batch=1, max_len=4, num_kv_heads=1,
    ...                           head_dim=2)
    >>> c.kind, c.k.shape             # [L, B, Hkv, T, Dh]; memory_kind is None on CPU
    ('offloaded', (1, 1, 1, 4, 2))
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
from jax.sharding import SingleDeviceSharding

from jaxgen.cache.dense import KVCache, attend_dense
from jaxgen.cache.layout import heads_major, replace_layer, scatter_heads_major


def host_memory_kind(requested: str = "pinned_host", offload_on_cpu: bool = False) -> str | None:
    """The memory kind to keep the cache in, or None when offloading is a no-op."""
    device = jax.devices()[0]
    if device.platform == "cpu" and not offload_on_cpu:
        return None
    try:
        kinds = {memory.kind for memory in device.addressable_memories()}
    except Exception:  # backends without memory kinds
        return None
    return requested if requested in kinds else None


def _to_host(x: jax.Array) -> jax.Array:
    return jax.device_put(x, jax.memory.Space.Host)


def _to_device(x: jax.Array) -> jax.Array:
    return jax.device_put(x, jax.memory.Space.Device)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OffloadedKVCache(KVCache):
    """Dense cache in host memory (cache_implementation="offloaded")."""

    memory_kind: str | None = dataclasses.field(default=None, metadata=dict(static=True))

    kind: ClassVar[str] = "offloaded"

    @classmethod
    def init(cls, *, memory_kind: str = "pinned_host", offload_on_cpu: bool = False,
             **shape) -> "OffloadedKVCache":
        kind = host_memory_kind(memory_kind, offload_on_cpu)
        cache = super().init(**shape, memory_kind=kind)
        if kind is None:
            return cache
        place = lambda a: jax.device_put(  # noqa: E731
            a, SingleDeviceSharding(jax.devices()[0], memory_kind=kind))
        return dataclasses.replace(cache, k=place(cache.k), v=place(cache.v))

    def _layer_in(self, layer):
        k, v = self.k[layer], self.v[layer]  # [B, Hkv, T, Dh]
        if self.memory_kind is None:
            return k, v
        return _to_device(k), _to_device(v)

    def _layer_out(self, layer, k_layer, v_layer) -> "OffloadedKVCache":
        if self.memory_kind is None:
            return dataclasses.replace(self, k=replace_layer(self.k, layer, k_layer),
                                       v=replace_layer(self.v, layer, v_layer))
        return dataclasses.replace(self, k=replace_layer(self.k, layer, _to_host(k_layer)),
                                   v=replace_layer(self.v, layer, _to_host(v_layer)))

    @staticmethod
    def _write(k_layer, v_layer, k_new, v_new, positions):
        """Writes k_new, v_new [B, S, Hkv, Dh] into one layer's k, v [B, Hkv, T, Dh]."""
        k_layer = scatter_heads_major(k_layer, heads_major(k_new), positions)
        v_layer = scatter_heads_major(v_layer, heads_major(v_new), positions)
        return k_layer, v_layer

    def update(self, layer, k_new, v_new, positions) -> "OffloadedKVCache":
        if self.memory_kind is None:
            return super().update(layer, k_new, v_new, positions)
        k_layer, v_layer = self._write(*self._layer_in(layer), k_new, v_new, positions)
        return self._layer_out(layer, k_layer, v_layer)

    def attend(self, layer, q, q_positions, *, scale: float, window: int | None = None,
               softcap: float | None = None):
        k_layer, v_layer = self._layer_in(layer)
        return attend_dense(q, k_layer, v_layer, q_positions, scale=scale, window=window,
                            softcap=softcap)

    def update_attend(self, layer, q, k_new, v_new, positions, *, scale: float,
                      window: int | None = None, softcap: float | None = None):
        """One move in, write + attend on device, one move out."""
        if self.memory_kind is None:
            return super().update_attend(layer, q, k_new, v_new, positions, scale=scale,
                                         window=window, softcap=softcap)
        k_layer, v_layer = self._write(*self._layer_in(layer), k_new, v_new, positions)
        out = attend_dense(q, k_layer, v_layer, positions, scale=scale, window=window,
                           softcap=softcap)
        return out, self._layer_out(layer, k_layer, v_layer)

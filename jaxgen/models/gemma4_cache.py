"""`Gemma4Cache`: one KV cache per attention type of a Gemma 4 model, behind the Cache contract.

Gemma 4's full-attention layers may have another head_dim (and number of kv heads) than its
sliding layers, so the layers' K/V cannot share one stacked array. This cache holds one inner
cache per group of equal shapes (one per layer type), each stacked over the group's layers,
and maps a model layer to (group, slot). Every inner cache keeps the same `length`; the loops
see only the contract (with_length, rollback, length, max_len, nbytes, max_rollback, resize).

KV-shared layers (Gemma 4's `num_kv_shared_layers`) have no slot: they `attend` over the slot
of the layer whose K/V they reuse.

Example:
    >>> from jaxgen.cache import make_cache
    >>> groups = tuple(make_cache("static", num_layers=n, batch=1, max_len=8, num_kv_heads=1,
    ...                           head_dim=d) for n, d in ((2, 4), (1, 8)))
    >>> cache = Gemma4Cache(groups=groups, slots=((0, 0), (1, 0), (0, 1)))
    >>> cache.max_len, cache.with_length(jnp.array([3])).rollback(1).length.tolist()
    (8, [2])
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from jaxgen.cache.sharding import INNER_CACHES

__all__ = ["Gemma4Cache"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Gemma4Cache:
    """Inner caches (one per group of equal K/V shapes) plus the static layer -> (group, slot)
    map. A PyTree: the inner caches are its children, `slots` its static aux data."""

    groups: tuple  # inner caches (jaxgen.cache kinds), each stacked over its slots
    slots: tuple = dataclasses.field(metadata=dict(static=True), default=())  # per cached layer
    # on a mesh each inner cache is split by its own field_axes (jaxgen.cache.sharding)
    field_axes: ClassVar[dict] = {"groups": INNER_CACHES}

    @property
    def kind(self) -> str:
        return self.groups[0].kind

    @property
    def length(self) -> jax.Array:
        return self.groups[0].length  # int32 [B]

    @property
    def max_len(self) -> int:
        return self.groups[0].max_len

    @property
    def batch(self) -> int:
        return self.groups[0].batch

    def nbytes(self) -> int:
        return sum(group.nbytes() for group in self.groups)

    def _map(self, fn) -> "Gemma4Cache":
        return dataclasses.replace(self, groups=tuple(fn(group) for group in self.groups))

    def _slot(self, layer: int) -> tuple[int, int]:
        return self.slots[int(layer)]

    def update(self, layer: int, k_new, v_new, positions) -> "Gemma4Cache":
        """Writes layer `layer`'s (a static int) new K/V [B, S, Hkv, Dh] at `positions`."""
        group, slot = self._slot(layer)
        groups = list(self.groups)
        groups[group] = groups[group].update(slot, k_new, v_new, positions)
        return dataclasses.replace(self, groups=tuple(groups))

    def attend(self, layer: int, q, q_positions, *, scale: float,
               window: int | None = None) -> jax.Array:
        """q [B, S, H, Dh] over layer `layer`'s cached K/V. Returns [B, S, H, Dh]."""
        group, slot = self._slot(layer)
        return self.groups[group].attend(slot, q, q_positions, scale=scale, window=window)

    def update_attend(self, layer: int, q, k_new, v_new, positions, *, scale: float,
                      window: int | None = None) -> tuple[jax.Array, "Gemma4Cache"]:
        group, slot = self._slot(layer)
        out, inner = self.groups[group].update_attend(slot, q, k_new, v_new, positions,
                                                      scale=scale, window=window)
        groups = list(self.groups)
        groups[group] = inner
        return out, dataclasses.replace(self, groups=tuple(groups))

    def layer_kv(self, layer: int) -> tuple[Any, Any]:
        """Layer `layer`'s stored keys and values, [B, Hkv, T, Dh] each (dense kinds only:
        what Gemma 4's assistant reads)."""
        group, slot = self._slot(layer)
        inner = self.groups[group]
        return inner.k[slot], inner.v[slot]

    def with_length(self, length: jax.Array) -> "Gemma4Cache":
        return self._map(lambda group: group.with_length(length))

    def max_rollback(self) -> jax.Array:
        return jnp.min(jnp.stack([group.max_rollback() for group in self.groups]), axis=0)

    def rollback(self, n) -> "Gemma4Cache":
        return self._map(lambda group: group.rollback(n))

    def resize(self, max_len: int) -> "Gemma4Cache":
        return self._map(lambda group: group.resize(max_len))

"""Sliding-window cache (cache_implementation="sliding_window"): a Mistral-style ring buffer.

A model with `sliding_window = W` lets a query at position p see keys p-W < j <= p. The
ring (jaxgen.cache.ring) keeps S = min(max_len, W + rollback_slack) slots per row and layer;
position j lives in slot j % S, and `pos` records which position each slot holds (-1: empty):

    k, v    [L, B, Hkv, S, Dh]   (heads-major, like the dense cache)
    pos     int32 [L, B, S]
    length  int32 [B]
    lost    bool  [B]      sticky: a rollback went past what the ring still holds

Memory is O(W) whatever the generation length.

Chunks longer than the ring (a long prompt) are exact: `update_attend` attends over the
ring's old entries plus the new chunk before writing, then keeps the chunk's last S tokens.

Rollback sets the length, as for every kind; it works while the ring still holds the window
of the position decoding resumes at: rolling back n tokens is safe iff the positions
[length - n - W + 1, length - n - 1] are all still in their slots, which always holds for
n <= rollback_slack + 1. The right-padded prefill is itself such a rollback (from the prompt
bucket to the prompt length), so `init_state` gives the ring a slack of the prompt bucket by
default. How an impossible rollback surfaces:

- outside jit, `cache.rollback(n)` / `jaxgen.cache.check_rollback(cache, n)` raise
  ValueError before anything is changed;
- under jit (nothing can raise), `with_length` sets the sticky `lost[B]` flag for the row;
  `cache.max_rollback()` (int32 [B]) tells a loop beforehand how far it may go, and
  `jaxgen.cache.raise_if_lost(cache)` raises on the host after the call.

Example:
    >>> import jax.numpy as jnp
    >>> from jaxgen.cache import SlidingWindowCache, raise_if_lost
    >>> c = SlidingWindowCache.init(num_layers=1, batch=1, max_len=100, num_kv_heads=1,
    ...                             head_dim=4, window=4, rollback_slack=2)
    >>> c.k.shape                     # 4 + 2 slots, not 100
    (1, 1, 1, 6, 4)
    >>> k = jnp.ones((1, 10, 1, 4))   # [B, S, Hkv, Dh]
    >>> c = c.update(0, k, k, jnp.arange(10)[None]).with_length(jnp.array([10]))
    >>> c.max_rollback().tolist()     # rollback_slack + 1
    [3]
    >>> raise_if_lost(c.with_length(jnp.array([5])))
    Traceback (most recent call last):
        ...
    ValueError: sliding-window cache rows [0] were rolled back past the tokens the ring still holds; their outputs are invalid (raise cache_config['rollback_slack'])
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.cache.attention import KeyBlock, attend_blocks
from jaxgen.cache.checks import cache_nbytes, rollback_by_length
from jaxgen.cache.layout import HEADS_MAJOR_AXES, heads_major, stored_shape
from jaxgen.cache.ring import ring_holds_window, ring_max_rollback, ring_write


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlidingWindowCache:
    """Ring-buffer cache for sliding-window attention. A PyTree; shapes never change."""

    k: jax.Array  # [L, B, Hkv, S, Dh]
    v: jax.Array  # [L, B, Hkv, S, Dh]
    pos: jax.Array  # int32 [L, B, S], -1 = empty
    length: jax.Array  # int32 [B]
    lost: jax.Array  # bool [B]
    window: int = dataclasses.field(metadata=dict(static=True))

    kind: ClassVar[str] = "sliding_window"
    field_axes: ClassVar[dict] = {"k": HEADS_MAJOR_AXES, "v": HEADS_MAJOR_AXES,  # .sharding
                                  "pos": ("layer", "batch", "slot"), "length": ("batch",),
                                  "lost": ("batch",)}

    @classmethod
    def init(cls, *, num_layers: int, batch: int, max_len: int, num_kv_heads: int,
             head_dim: int, dtype=jnp.float32, window: int,
             rollback_slack: int = 0) -> "SlidingWindowCache":
        slots = min(int(max_len), int(window) + int(rollback_slack))
        shape = (num_layers, batch, num_kv_heads, slots, head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   pos=jnp.full((num_layers, batch, slots), -1, jnp.int32),
                   length=jnp.zeros((batch,), jnp.int32), lost=jnp.zeros((batch,), bool),
                   window=int(window))

    @property
    def max_len(self) -> int:
        """Slots per row (not a limit on positions)."""
        return stored_shape(self.k)[3]

    @property
    def batch(self) -> int:
        return stored_shape(self.k)[1]

    def nbytes(self) -> int:
        return cache_nbytes(self)

    def _window(self, window: int | None) -> int:
        return self.window if window is None else min(int(window), self.window)

    def update(self, layer, k_new, v_new, positions) -> "SlidingWindowCache":
        """Writes a chunk (its last S tokens) into the ring. Attention for chunks longer than
        rollback_slack + 1 needs `update_attend`, which reads the entries this overwrites."""
        k, v, pos = ring_write(self.k, self.v, self.pos, layer, k_new, v_new, positions)
        return dataclasses.replace(self, k=k, v=v, pos=pos)

    def attend(self, layer, q, q_positions, *, scale: float, window: int | None = None,
               softcap: float | None = None):
        block = KeyBlock(k=self.k[layer], v=self.v[layer], positions=self.pos[layer])
        return attend_blocks(q, q_positions, [block], scale=scale, window=self._window(window),
                             softcap=softcap)

    def update_attend(self, layer, q, k_new, v_new, positions, *, scale: float,
                      window: int | None = None, softcap: float | None = None):
        """Write + attend. A chunk of n <= S - W + 1 tokens (decode steps, verify blocks within
        the slack) only overwrites positions older than every query's window, and a ring of
        S < W slots (capped by a buffer shorter than the window) never wraps: then the chunk is
        written first and attention reads the ring alone, so XLA updates the ring in place.
        Otherwise attend over (ring entries older than the chunk) + (the chunk), then write:
        reading before writing makes XLA copy the ring, which is fine for a prefill."""
        slots = self.max_len
        if positions.shape[1] <= slots - self.window + 1 or slots < self.window:
            cache = self.update(layer, k_new, v_new, positions)
            return cache.attend(layer, q, positions, scale=scale, window=window,
                                softcap=softcap), cache
        pos_layer = self.pos[layer]  # [B, S]
        old = KeyBlock(k=self.k[layer], v=self.v[layer], positions=pos_layer,
                       valid=pos_layer < positions[:, :1])
        new = KeyBlock(k=heads_major(k_new), v=heads_major(v_new), positions=positions)
        out = attend_blocks(q, positions, [old, new], scale=scale, window=self._window(window),
                            softcap=softcap)
        return out, self.update(layer, k_new, v_new, positions)

    def with_length(self, length: jax.Array) -> "SlidingWindowCache":
        """Sets the length; flags rows whose ring no longer holds the window before it."""
        length = length.astype(jnp.int32)
        ok = ring_holds_window(self.pos[0], length, self.window)  # [B]
        return dataclasses.replace(self, length=length, lost=self.lost | ~ok)

    def max_rollback(self) -> jax.Array:
        """int32 [B]: tokens each row can roll back now without losing its window."""
        return ring_max_rollback(self.pos[0], self.length, self.window)

    def rollback(self, n) -> "SlidingWindowCache":
        """Forgets the last n[B] positions. Outside jit an impossible rollback raises
        ValueError; under jit it sets `lost` (see the module docs)."""
        return rollback_by_length(self, n)


def raise_if_lost(cache) -> None:
    """Host-side: raises ValueError if a traced rollback went past the ring's window."""
    lost = getattr(cache, "lost", None)
    if lost is not None and bool(np.any(np.asarray(lost))):
        rows = np.nonzero(np.asarray(lost))[0].tolist()
        raise ValueError(f"sliding-window cache rows {rows} were rolled back past the tokens "
                         f"the ring still holds; their outputs are invalid (raise "
                         f"cache_config['rollback_slack'])")

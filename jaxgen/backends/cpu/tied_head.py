"""A tied LM head laid out for CPU decoding: the embedding [V, D] plus its [D, V] copy.

On XLA:CPU a forward of one or two rows reads a [D, V] matrix fastest as one contiguous
matrix-vector product, while wider forwards (a prefill, a verify block) read the embedding
itself. `TiedHead` keeps both and picks by the number of rows (HEAD_BY_VOCAB_MIN_ROWS in
tuning.py), so the model's head is `normed @ head` whatever the layout.

Example:
    >>> import jax.numpy as jnp
    >>> embed = jnp.arange(12.0).reshape(4, 3)              # [V, D]
    >>> head = TiedHead(embed.T, embed)
    >>> head.shape
    (3, 4)
    >>> x = jnp.ones((1, 1, 3))                             # one row: the [D, V] copy
    >>> bool(((x @ head) == x @ embed.T).all()), (jnp.ones((5, 3)) @ head).shape
    (True, (5, 4))
    >>> head.columns(jnp.array([0, 2])).shape               # [D, V_d]
    (3, 2)
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxgen.backends.cpu.tuning import HEAD_BY_VOCAB_MIN_ROWS


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TiedHead:
    """A tied head: `x @ self` is x @ embed.T [..., V], read from the copy for few rows."""

    copy_dv: jax.Array  # [D, V]
    embed_vd: jax.Array  # [V, D], the embedding itself (not copied)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.copy_dv.shape)

    @property
    def dtype(self):
        return self.copy_dv.dtype

    def __rmatmul__(self, x: jax.Array) -> jax.Array:
        """x [..., D] @ self -> [..., V] float32."""
        if math.prod(x.shape[:-1]) < HEAD_BY_VOCAB_MIN_ROWS:
            return jnp.einsum("...d,dv->...v", x, self.copy_dv,
                              preferred_element_type=jnp.float32)  # [..., V]
        return jnp.einsum("...d,vd->...v", x, self.embed_vd,
                          preferred_element_type=jnp.float32)  # [..., V]

    def columns(self, ids: jax.Array) -> jax.Array:
        """The head's columns `ids` [V_d] only, [D, V_d]."""
        return jnp.take(self.copy_dv, ids, axis=1)  # [D, V_d]


__all__ = ["TiedHead"]

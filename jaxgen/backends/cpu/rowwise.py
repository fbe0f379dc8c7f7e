"""Weight matrices whose products with a few rows run one matrix-vector product per row.

On XLA:CPU a product of a [M, K] block of activations with a [K, N] weight goes through a
matrix-matrix kernel that packs the weight before it multiplies, and for a handful of rows
that costs far more than the arithmetic: the 30 layers' matrices of SmolLM2 (425 MB) took
25 ms for one row and 46 / 74 / 98 ms for M = 2 / 4 / 8 rows (OpenBLAS through numpy
behaves alike), while one matrix-vector product per row took 36 / 44 / 72 ms: the
matrix-vector kernel streams the weight at memory speed, from DRAM for the first row and
mostly from the last-level cache for the others. A decode step with a few rows (beam
search's beams, a small batch, a short verify block) is that case. `RowwiseMatrix` wraps a
layer weight so `x @ w` runs one matrix-vector product per row for 2 to `ROWWISE_MAX_ROWS`
rows; one row and more rows run the plain product. In whole SmolLM2 decode steps: 4 beams
1.14-1.27x and batch 4 1.15x faster per step, batch 2 and batch 8 unchanged (so the bound
is 4).

`jaxgen/backends/cpu/layer_split.for_decoding` wraps the per-layer weights it lays out for CPU programs;
the model's forward does not change (`h @ p["wq"]` dispatches here).

Example:
    >>> import jax.numpy as jnp
    >>> w = RowwiseMatrix(jnp.arange(12.0).reshape(3, 4))
    >>> x = jnp.ones((2, 1, 3))                      # [B, S, K]: 2 rows, 2 products
    >>> (x @ w).shape, bool(((x @ w) == x @ w.weight).all())
    ((2, 1, 4), True)
    >>> w.shape
    (3, 4)
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxgen.backends.cpu.tuning import ROWWISE_MAX_ROWS


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowwiseMatrix:
    """A float weight [K, N]; `x @ self` (x [..., K]) runs per row for 2..ROWWISE_MAX_ROWS
    rows, as one product otherwise. Same values as x @ weight up to summation order."""

    weight: jax.Array  # [K, N]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.weight.shape)

    def __rmatmul__(self, x: jax.Array) -> jax.Array:
        """x [..., K] @ self -> [..., N]."""
        *lead, width = x.shape
        rows = math.prod(lead)
        if not 2 <= rows <= ROWWISE_MAX_ROWS:
            return x @ self.weight  # [..., N]
        flat = x.reshape(rows, width)  # [M, K]
        out = jnp.concatenate([flat[r:r + 1] @ self.weight for r in range(rows)])  # [M, N]
        return out.reshape(*lead, self.weight.shape[-1])  # [..., N]


def rowwise_layer(layer: dict) -> dict:
    """One layer's weights with every 2-D float matrix wrapped in RowwiseMatrix (norm vectors,
    biases and quantized matrices as they are).

    Example:
        >>> import jax.numpy as jnp
        >>> wrapped = rowwise_layer({"wq": jnp.ones((4, 8)), "attn_norm": jnp.ones(4)})
        >>> type(wrapped["wq"]).__name__, type(wrapped["attn_norm"]).__name__
        ('RowwiseMatrix', 'ArrayImpl')
    """
    def is_float_matrix(value) -> bool:
        return (isinstance(value, jax.Array) and value.ndim == 2
                and jnp.issubdtype(value.dtype, jnp.floating))

    return {name: RowwiseMatrix(value) if is_float_matrix(value) else value
            for name, value in layer.items()}


__all__ = ["ROWWISE_MAX_ROWS", "RowwiseMatrix", "rowwise_layer"]

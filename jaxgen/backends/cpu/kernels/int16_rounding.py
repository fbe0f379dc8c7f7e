"""What the kernels' integer paths see of their float inputs: vectors rounded to int16 codes.

The decode-attention kernel rounds each query row (against int8 keys) and the quantized kernel
each 32-input block of its input rows to codes of max |vector| / 32767 (`few_rows.h`'s
`round_to_int16`); `int16_rounded` gives the floats those codes stand for, so tests compare
the kernels against the products of exactly the inputs they multiply.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def int16_rounded(x: jax.Array) -> jax.Array:
    """x [..., N] with each vector along the last axis rounded to int16 codes of
    max |vector| / 32767 (ties to even, as the kernels' lrint); a vector holding a NaN or an
    infinity is returned as it is (the kernels' float path takes it).

    Example:
        >>> x = jnp.array([[1.0, -0.3, 0.0], [jnp.inf, 0.3, 0.0]])    # [2, 3]
        >>> out = int16_rounded(x)
        >>> bool(jnp.abs(out[0] - x[0]).max() <= 1.0 / 65534), bool(out[0, 1] != x[0, 1])
        (True, True)
        >>> bool((out[1] == x[1]).all())
        True
    """
    high = jnp.abs(x).max(axis=-1, keepdims=True)  # [..., 1]
    inverse = jnp.where(high > 0, jnp.float32(32767.0) / high, 0.0)  # [..., 1]
    codes = jnp.round(x * inverse)  # [..., N]
    return jnp.where(jnp.isfinite(high), codes * (high / jnp.float32(32767.0)), x)


__all__ = ["int16_rounded"]

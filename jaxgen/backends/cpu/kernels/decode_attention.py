"""`decode_attention(q_rows, k, v, q_positions, ...)`: attention of a few query rows over one
layer of a heads-major KV cache (float32, or int8 codes with group scales) through the native
kernel `decode_attention.cc` (CPU).

The kernel reads only the keys some query can see (j <= position, within the sliding window),
once, in chunks that XLA's thread pool shares, and widens int8 codes in registers; XLA:CPU's
batched products read every slot the cache holds, at about half the bandwidth probe's rate.

Against int8 keys whose scale groups span a multiple of 16 channels, an AVX2 build rounds each
query row to int16 codes (`query_bits()`; `rounded_queries` gives the query it sees) and
multiplies codes by codes: a rounding of 1/65534 of the row's largest channel, next to the
1/254 of a group's largest the keys themselves were rounded to.

Under `jax.vmap` the call runs once per mapped row (`vmap_method="sequential"`).

Example:
    >>> import jax.numpy as jnp
    >>> from jaxgen.backends.cpu.kernels.build import attention_targets
    >>> q = jnp.ones((1, 1, 1, 8))                                # [B, H, R, D]
    >>> k = jnp.ones((1, 1, 4, 8))                                # [B, H, T, D]
    >>> v = jnp.arange(4.0)[None, None, :, None] * jnp.ones((1, 1, 4, 8))
    >>> if attention_targets() is not None:                       # built on this machine
    ...     out = decode_attention(q, k, v, jnp.array([[2]]), scale=0.5)
    ...     assert abs(float(out[0, 0, 0, 0]) - 1.0) < 1e-6       # the mean of 0, 1, 2
"""
from __future__ import annotations

import jax

from jaxgen.backends.cpu.kernels.attention_ffi import attention_call
from jaxgen.backends.cpu.kernels.build import attention_query_bits as query_bits
from jaxgen.backends.cpu.kernels.build import attention_targets
from jaxgen.backends.cpu.kernels.int16_rounding import int16_rounded

MAX_ROWS = 64  # query rows (G * S) per (row, KV head) the kernel serves; more: XLA's matmuls


def available() -> bool:
    """True when the kernel is built and registered for this process (CPU only)."""
    return attention_targets() is not None


def runs(rows: int, head_dim: int, key_groups: int = 1, value_groups: int = 1) -> bool:
    """True when the kernel takes `rows` query rows per KV head of head_dim channels (a
    multiple of 8), with int8 scale groups of a multiple of 8 channels."""
    return (0 < rows <= MAX_ROWS and head_dim % 8 == 0
            and all(g > 0 and head_dim % (8 * g) == 0 for g in (key_groups, value_groups)))


def rounded_queries(q_rows: jax.Array, key_groups: int) -> jax.Array:
    """q_rows [..., D] as the int8 path sees them against keys of `key_groups` scale groups:
    rounded to int16 codes of max |row| / 32767 where the kernel does so (`query_bits()`),
    else unchanged.

    Example:
        >>> import jax.numpy as jnp
        >>> row = jnp.array([[1.0, -0.5] + [0.0] * 14])             # [1, 16]
        >>> out = rounded_queries(row, 1)
        >>> bool(jnp.abs(out - row).max() <= 1.0 / 65534)
        True
    """
    width = q_rows.shape[-1] // key_groups
    if query_bits() != 16 or width % 16 != 0:
        return q_rows
    return int16_rounded(q_rows)


def decode_attention(q_rows: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array, *,
                     scale: float, window=None, k_scale: jax.Array | None = None,
                     v_scale: jax.Array | None = None) -> jax.Array:
    """q_rows [B, H, R, D] float32 (R = G * S, group-major) over k, v [B, H, T, D] (float32,
    or int8 codes with k_scale [B, H, T, Nk] / v_scale [B, H, T, Nv] float32), queries at
    q_positions int32 [B, S]; key j visible iff j <= position (and position - j < window,
    an int or int32 scalar; None: no window). Returns [B, H, R, D] float32 (zeros for a row
    that sees no key). The kernel must be available."""
    return attention_call(attention_targets(), q_rows, k, v, q_positions, scale=scale,
                          window=window, k_scale=k_scale, v_scale=v_scale)  # [B, H, R, D]


__all__ = ["MAX_ROWS", "available", "decode_attention", "query_bits", "rounded_queries", "runs"]

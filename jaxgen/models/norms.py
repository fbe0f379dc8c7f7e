"""The RMS norm every Llama-family module uses (HF's LlamaRMSNorm), in one place.

Example:
    >>> import jax.numpy as jnp
    >>> rms_norm(jnp.array([[3.0, 4.0]]), jnp.array([1.0, 2.0]), 0.0) * 50 ** 0.5 / 2
    Array([[3., 8.]], dtype=float32)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """HF LlamaRMSNorm: normalize in fp32, cast back to x's dtype, then scale by weight."""
    x32 = x.astype(jnp.float32)  # [..., D]
    variance = jnp.mean(x32 * x32, axis=-1, keepdims=True)  # [..., 1]
    normed = (x32 * jax.lax.rsqrt(variance + eps)).astype(x.dtype)  # [..., D]
    return weight * normed

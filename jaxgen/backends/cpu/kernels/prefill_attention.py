"""`prefill_attention(q, k, v, q_positions, ...)`: causal attention of many query positions (a
prefill, a long chunk of one) over one layer of a heads-major float32 KV cache through the
native kernel `prefill_attention.cc` (CPU).

The kernel reads q and writes the output in the model's [B, S, H, D] layout, walks only the
key chunks each tile of query rows can see (the causal half of a prefill, a sliding window's
edge) with an online softmax, and keeps each tile's scores in registers. XLA:CPU runs the same
forward as loops of batched products with the softmax and copies between them: SmolLM2's 30
layers at 512 positions 189 ms there, 47-50 ms here; at 2048, 1954 and 570-580 ms (Intel
AVX-512 host, 2 threads).

Under `jax.vmap` the call runs once per mapped row (`vmap_method="sequential"`).

Example:
    >>> import jax.numpy as jnp
    >>> q = jnp.ones((1, 3, 2, 8))                                # [B, S, H, D]
    >>> k = jnp.ones((1, 1, 4, 8))                                # [B, Hkv, T, D]
    >>> v = jnp.arange(4.0)[None, None, :, None] * jnp.ones((1, 1, 4, 8))
    >>> if available():                                           # built on this machine
    ...     out = prefill_attention(q, k, v, jnp.array([[0, 1, 2]]), scale=0.5)
    ...     assert [float(out[0, s, 1, 0]) for s in range(3)] == [0.0, 0.5, 1.0]  # means
"""
from __future__ import annotations

import jax

from jaxgen.backends.cpu.kernels.attention_ffi import attention_call
from jaxgen.backends.cpu.kernels.build import prefill_targets


def available() -> bool:
    """True when the kernel is built and registered for this process (CPU only)."""
    return prefill_targets() is not None


def runs(heads: int, kv_heads: int, head_dim: int, key_groups: int = 1,
         value_groups: int = 1) -> bool:
    """True when the kernel takes queries of `heads` heads over `kv_heads` KV heads of
    head_dim channels (a multiple of 8), int8 scale groups dividing them."""
    return (kv_heads > 0 and heads % kv_heads == 0 and head_dim > 0 and head_dim % 8 == 0
            and all(g > 0 and head_dim % g == 0 for g in (key_groups, value_groups)))


def prefill_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array, *,
                      scale: float, window=None, k_scale: jax.Array | None = None,
                      v_scale: jax.Array | None = None) -> jax.Array:
    """q [B, S, H, D] float32 over k, v [B, Hkv, T, D] (float32, or int8 codes with k_scale
    [B, Hkv, T, Nk] / v_scale [B, Hkv, T, Nv] float32: key j = k[j] * its group's scale),
    key j at position j, queries at q_positions int32 [B, S]; key j visible iff j <=
    position (and position - j < window, an int or int32 scalar; None: no window). Returns
    [B, S, H, D] float32 (zeros for a query that sees no key). The kernel must be available."""
    return attention_call(prefill_targets(), q, k, v, q_positions, scale=scale, window=window,
                          k_scale=k_scale, v_scale=v_scale)  # [B, S, H, D]


__all__ = ["available", "prefill_attention", "runs"]

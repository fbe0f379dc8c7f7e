"""`attention_call`: one call of an attention kernel's FFI targets (`attention_ffi.h` holds
their signatures; `decode_attention.py` and `prefill_attention.py` lay out the queries): the
float32 target for float32 keys and values, the int8 one for codes with their scales.

Example:
    >>> from jaxgen.backends.cpu.kernels.build import prefill_targets
    >>> import jax.numpy as jnp
    >>> q, k = jnp.ones((1, 2, 1, 8)), jnp.ones((1, 1, 2, 8))     # [B, S, H, D], [B, Hkv, T, D]
    >>> if prefill_targets() is not None:                        # built on this machine
    ...     out = attention_call(prefill_targets(), q, k, k, jnp.array([[0, 1]]), scale=1.0)
    ...     assert out.shape == q.shape
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def attention_call(targets: dict[str, str], q: jax.Array, k: jax.Array, v: jax.Array,
                   q_positions: jax.Array, *, scale: float, window=None,
                   k_scale: jax.Array | None = None,
                   v_scale: jax.Array | None = None) -> jax.Array:
    """targets["dense"] over float32 k, v (k_scale None), else targets["codes"] over int8 codes
    with float32 k_scale / v_scale; positions as int32, window as one int32 (None: 0, no
    window), scale as a float32 attribute. Returns float32 in q's shape; under `jax.vmap`
    the call runs once per mapped row."""
    window = jnp.asarray(0 if window is None else window, jnp.int32).reshape(1)  # [1]
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    positions = q_positions.astype(jnp.int32)  # [B, S]
    if k_scale is None:
        call = jax.ffi.ffi_call(targets["dense"], out, vmap_method="sequential")
        return call(q, k, v, positions, window, scale=np.float32(scale))
    call = jax.ffi.ffi_call(targets["codes"], out, vmap_method="sequential")
    return call(q, k, v, k_scale.astype(jnp.float32), v_scale.astype(jnp.float32), positions,
                window, scale=np.float32(scale))


__all__ = ["attention_call"]

"""Exit adapters for self-speculative early exit: a small residual module between layer E's
hidden state and the model's shared final norm + LM head (in the spirit of Kangaroo).

Format (inside the model's params, optional): params["exit_adapters"][str(E)] =
    {"norm": [D], "w_in": [D, A], "w_out": [A, D]}
    adapted = h + silu(rms_norm(h) * norm) @ w_in) @ w_out        h: layer E's hidden [.., D]

A model without an adapter for E exits plainly (final norm + head on h). `w_out` initialised
to zeros makes a fresh adapter the plain exit.

Example:
    >>> import jax, jax.numpy as jnp
    >>> adapter = init_exit_adapter(jax.random.key(0), hidden=16, width=8)
    >>> h = jnp.ones((1, 2, 16))
    >>> bool(jnp.all(apply_exit_adapter(adapter, h, 1e-6) == h))   # w_out = 0: identity
    True
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def exit_adapter_shapes(hidden: int, width: int) -> dict:
    """The adapter's parameter shapes for hidden size D and adapter width A."""
    return {"norm": (hidden,), "w_in": (hidden, width), "w_out": (width, hidden)}


def init_exit_adapter(key: jax.Array, hidden: int, width: int, dtype=jnp.float32) -> dict:
    """A fresh adapter: random w_in, zero w_out (so it starts as the plain exit)."""
    return {"norm": jnp.ones((hidden,), dtype),
            "w_in": (jax.random.normal(key, (hidden, width)) * hidden ** -0.5).astype(dtype),
            "w_out": jnp.zeros((width, hidden), dtype)}


def apply_exit_adapter(adapter: dict, hidden: jax.Array, eps: float) -> jax.Array:
    """hidden [..., D] -> adapted hidden [..., D]."""
    x = hidden.astype(jnp.float32)
    normed = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)  # [..., D]
    normed = (normed * adapter["norm"]).astype(hidden.dtype)
    inner = jax.nn.silu(normed @ adapter["w_in"])  # [..., A]
    return hidden + inner @ adapter["w_out"]  # [..., D]

"""`few_rows_product(x, w_nk)`: x [..., K] @ w_nk[N, K]^T through the native few-row kernel.

The kernel (`few_rows.cc`, float32, CPU) streams each weight row once per call however many
rows x has, where XLA:CPU's matrix-matrix kernels repack the weight for every product of 2 or
more rows. On this project's 2-core host, 30 layers of SmolLM2's fused matrices (425 MB):
1 / 2 / 4 / 8 / 16 rows took 27 / 27 / 27 / 43 / 80 ms against XLA's 27 / 49 / 83 / 100 /
134 ms (`jax.jit` chains, medians of 7, interleaved).

Under `jax.vmap` an unbatched weight stays one weight (the mapped axis becomes more rows);
a batched weight runs `jnp.einsum` instead.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxgen.backends.cpu.kernels.build import ffi_target
    >>> x = jnp.arange(6.0).reshape(2, 3)            # [M, K]
    >>> w = jnp.arange(12.0).reshape(4, 3)           # [N, K]
    >>> if ffi_target() is not None:                 # built on this machine
    ...     assert bool((few_rows_product(x, w) == x @ w.T).all())
    >>> (x @ w.T).tolist()
    [[5.0, 14.0, 23.0, 32.0], [14.0, 50.0, 86.0, 122.0]]
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.backends.cpu.kernels.build import ffi_target, group_rows, intel_avx512_host
from jaxgen.backends.cpu.tuning import INTEL_AVX512_KERNEL_MAX_ROWS, KERNEL_MAX_ROWS


def available() -> bool:
    """True when the kernel is built and registered for this process (CPU only)."""
    return ffi_target() is not None


def max_rows() -> int:
    """The most input rows a float32 product runs the kernel for on this host, beyond which
    XLA's matrix-matrix product is the faster (`tuning.py`): INTEL_AVX512_KERNEL_MAX_ROWS on
    Intel AVX-512 hosts, KERNEL_MAX_ROWS elsewhere and when the kernel is not built.

    Example:
        >>> max_rows() in (INTEL_AVX512_KERNEL_MAX_ROWS, KERNEL_MAX_ROWS)
        True
    """
    return INTEL_AVX512_KERNEL_MAX_ROWS if intel_avx512_host() else KERNEL_MAX_ROWS


def few_rows_product(x: jax.Array, w_nk: jax.Array, layer: int | None = None) -> jax.Array:
    """x [..., K] float32 @ w_nk[N, K]^T -> [..., N] float32; with layer, w_nk is a stack
    [L, N, K] and w_nk[layer] is read in place (no slice copied). The kernel must be available."""
    return _product(layer)(x, w_nk)


@functools.cache
def _product(layer: int | None):
    @jax.custom_batching.custom_vmap
    def product(x, w_nk):
        out = jax.ShapeDtypeStruct(x.shape[:-1] + (w_nk.shape[-2],), jnp.float32)  # [..., N]
        return jax.ffi.ffi_call(ffi_target(), out)(x, w_nk, layer=np.int64(layer or 0))

    @product.def_vmap
    def product_vmap(axis_size, in_batched, x, w_nk):
        x_batched, w_batched = in_batched
        if not w_batched:  # one weight: the mapped axis (axis 0 of x) is more rows
            return product(x, w_nk), x_batched
        if not x_batched:
            x = jnp.broadcast_to(x, (axis_size,) + x.shape)  # [A, ..., K]
        weight = w_nk if layer is None else w_nk[:, layer]  # [A, N, K]
        return jnp.einsum("a...k,ank->a...n", x, weight), True  # [A, ..., N]

    return product


__all__ = ["available", "few_rows_product", "group_rows", "max_rows"]

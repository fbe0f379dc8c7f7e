"""`quantized_product(x, codes, scale, offset)`: x [..., K] @ w[N, K]^T with w kept as integer
codes, through the native kernel `quantized_rows.cc` (CPU).

Row n of w is scale[n, g] * (codes[n, i] - code_offset) + offset[n, g] for input i of group
g = i // (K // G): int8 codes [N, K] (int8 weights, GGUF Q8_0), or uint8 [N, K // 2] holding two
4-bit codes a byte, input j of each 32-input block in the low nibble of byte j and input
j + 16 in the high one (GGUF Q4_0 with code_offset 8, Q4_1 with offsets). Scales and offsets
are float32 or float16 [N, G]. The kernel reads the codes once and expands them in registers,
where XLA:CPU first writes the float matrix to memory.

Up to 3 input rows (`rounded_row_limit()`) against groups of a multiple of 32 inputs, an AVX2
build without AVX-512 rounds each 32-input block of a row to int16 codes of its own step
(max |block| / 32767) and multiplies codes by codes (`rounded_rows` gives the rows it
sees): a rounding of 1/65534 of the block's largest input,
next to the 1/30 (4-bit) or 1/254 (8-bit) of a group the weights were stored with.

Under `jax.vmap` an unbatched weight stays one weight (the mapped axis becomes more rows); a
batched weight expands it and runs `jnp.einsum`.

Example:
    >>> import jax.numpy as jnp
    >>> from jaxgen.backends.cpu.kernels.build import quantized_target
    >>> codes = jnp.arange(-8, 8, dtype=jnp.int8).reshape(2, 8)     # [N, K] int8
    >>> scale = jnp.array([[0.5], [2.0]])                           # [N, G = 1]
    >>> x = jnp.ones((1, 8))                                        # [M, K]
    >>> want = x @ expand(codes, scale).T
    >>> want.tolist()
    [[-18.0, 56.0]]
    >>> if quantized_target() is not None:                          # built on this machine
    ...     assert bool((quantized_product(x, codes, scale) == want).all())
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.backends.cpu.kernels.build import intel_avx512_host, quantized_target
from jaxgen.backends.cpu.kernels.build import quantized_rounded_rows as rounded_row_limit
from jaxgen.backends.cpu.kernels.int16_rounding import int16_rounded
from jaxgen.backends.cpu.tuning import (
    INTEL_AVX512_STACKED_KERNEL_MAX_ROWS,
    INTEL_AVX512_STACKED_NIBBLE_KERNEL_MAX_ROWS,
    STACKED_KERNEL_MAX_ROWS,
)

NIBBLE_BLOCK = 32  # inputs of one 4-bit block (two codes a byte within it)


def available() -> bool:
    """True when the kernel is built and registered for this process (CPU only)."""
    return quantized_target() is not None


def stacked_max_rows(codes_dtype=jnp.int8) -> int:
    """The most input rows a layer of a quantized stack (int8 codes, or uint8 bytes of two
    4-bit codes) runs the kernel for on this host, beyond which XLA's product with the
    expanded layer is the faster (`tuning.py`): on Intel AVX-512 hosts
    INTEL_AVX512_STACKED_KERNEL_MAX_ROWS (int8) / INTEL_AVX512_STACKED_NIBBLE_KERNEL_MAX_ROWS
    (4-bit), STACKED_KERNEL_MAX_ROWS elsewhere.

    Example:
        >>> stacked_max_rows(jnp.uint8) >= stacked_max_rows(jnp.int8) > 32
        True
    """
    if not intel_avx512_host():
        return STACKED_KERNEL_MAX_ROWS
    if jnp.dtype(codes_dtype) == jnp.uint8:
        return INTEL_AVX512_STACKED_NIBBLE_KERNEL_MAX_ROWS
    return INTEL_AVX512_STACKED_KERNEL_MAX_ROWS


def runs(k: int, codes_dtype, groups: int) -> bool:
    """True when the kernel takes a matrix of K inputs in `groups` scale groups: groups of a
    multiple of 8 inputs (int8 codes) or of 32 (4-bit codes)."""
    if groups < 1 or k < 1 or k % groups:
        return False
    step = NIBBLE_BLOCK if jnp.dtype(codes_dtype) == jnp.uint8 else 8
    return (k // groups) % step == 0


def rounded_rows(x: jax.Array, groups: int) -> jax.Array:
    """x [..., K] as the kernel sees it against a matrix of `groups` scale groups: each
    32-input block of a row rounded to int16 codes of max |block| / 32767 where the kernel does
    so (at most `rounded_row_limit()` rows, groups of a multiple of 32), else unchanged.

    Example:
        >>> x = jnp.array([[1.0, -0.25] + [0.0] * 30])               # [1, 32]
        >>> bool(jnp.abs(rounded_rows(x, 1) - x).max() <= 1.0 / 65534)
        True
    """
    *lead, k = x.shape
    rows = int(np.prod(lead, dtype=np.int64))
    if rows > rounded_row_limit() or (k // groups) % 32 != 0:
        return x
    blocks = x.reshape(*lead, k // 32, 32)  # [..., K / 32, 32]
    if not bool(jnp.isfinite(blocks).all()):  # the kernel's float path, for the whole call
        return x
    return int16_rounded(blocks).reshape(x.shape)


def expand(codes: jax.Array, scale: jax.Array, offset: jax.Array | None = None,
           code_offset: int = 0) -> jax.Array:
    """The float32 matrix [..., N, K] the codes [..., N, K or K // 2] stand for (XLA ops)."""
    if codes.dtype == jnp.uint8:  # two 4-bit codes a byte, blocks of 32 inputs
        *lead, n, half = codes.shape
        packed = codes.reshape(*lead, n, half // (NIBBLE_BLOCK // 2), NIBBLE_BLOCK // 2)
        values = jnp.concatenate([packed & 0x0F, packed >> 4], axis=-1)  # [..., N, K // 32, 32]
        values = values.reshape(*lead, n, 2 * half)  # [..., N, K]
    else:
        values = codes
    *lead, n, k = values.shape
    groups = scale.shape[-1]
    grouped = values.reshape(*lead, n, groups, k // groups).astype(jnp.float32)  # [..., N, G, g]
    grouped = (grouped - float(code_offset)) * scale.astype(jnp.float32)[..., None]
    if offset is not None:
        grouped = grouped + offset.astype(jnp.float32)[..., None]
    return grouped.reshape(*lead, n, k)  # [..., N, K]


def quantized_product(x: jax.Array, codes: jax.Array, scale: jax.Array,
                      offset: jax.Array | None = None, code_offset: int = 0,
                      layer: int | None = None) -> jax.Array:
    """x [..., K] float32 @ w[N, K]^T -> [..., N] float32, w as in the module docstring; with
    layer, codes / scale / offset are stacks [L, ...] and layer `layer` is read in place.
    The kernel must be available and `runs` true for the matrix."""
    return _product(int(code_offset), layer)(x, codes, scale, offset)


@functools.cache
def _product(code_offset: int, layer: int | None):
    @jax.custom_batching.custom_vmap
    def product(x, codes, scale, offset):
        out = jax.ShapeDtypeStruct(x.shape[:-1] + (codes.shape[-2],), jnp.float32)  # [..., N]
        shifts = jnp.zeros((0,), scale.dtype) if offset is None else offset  # [0]: none
        return jax.ffi.ffi_call(quantized_target(), out)(
            x, codes, scale, shifts, layer=np.int64(layer or 0), code_offset=np.int64(code_offset))

    @product.def_vmap
    def product_vmap(axis_size, in_batched, x, codes, scale, offset):
        x_batched, *weight_batched = in_batched
        if not any(weight_batched):  # one weight: the mapped axis (axis 0 of x) is more rows
            return product(x, codes, scale, offset), x_batched
        if not x_batched:
            x = jnp.broadcast_to(x, (axis_size,) + x.shape)  # [A, ..., K]
        leaves = [a if a is None or batched else jnp.broadcast_to(a, (axis_size,) + a.shape)
                  for a, batched in zip((codes, scale, offset), weight_batched)]
        if layer is not None:
            leaves = [None if a is None else a[:, layer] for a in leaves]
        weight = expand(*leaves, code_offset=code_offset)  # [A, N, K]
        return jnp.einsum("a...k,ank->a...n", x, weight), True  # [A, ..., N]

    return product


__all__ = ["available", "expand", "quantized_product", "rounded_row_limit", "rounded_rows",
           "runs"]

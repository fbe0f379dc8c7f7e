"""Quantized weight matrices whose products with a few rows run the native quantized kernel
(`jaxgen/backends/cpu/kernels/quantized_rows.py`) on CPU.

`QuantizedKernelMatrix` holds an `Int8Matrix` (load(weights="int8")) or a GGUF `BlockMatrix`
(load(weights="gguf"): Q8_0, Q4_0, Q4_1) transposed to the kernel's layout: codes [N, Kc],
scales and offsets [N, G], one output row after another (the GGUF file's own order of a
row's blocks). `x @ m` (x [..., K] float32) runs the kernel for 1 to KERNEL_MAX_ROWS rows
(`quantized_rows.stacked_max_rows` for a layer of a stack: this host's bound), reading the
codes once, and otherwise XLA's product with the expanded float matrix (what the quantized
matrices do everywhere). `jaxgen/backends/cpu/layer_split.for_decoding` wraps each quantized
layer matrix and head this way when the kernel is available.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxgen.models.quantize import quantize_matrix
    >>> w = jax.random.normal(jax.random.key(0), (64, 8))        # [K, N]
    >>> m = QuantizedKernelMatrix.of(quantize_matrix(w, group=32))
    >>> m.shape, m.codes_nk.shape, m.scale_nk.shape               # [K, N]; [N, K]; [N, G]
    ((64, 8), (8, 64), (8, 2))
    >>> x = jnp.ones((2, 64))                                     # [M, K]
    >>> bool(jnp.allclose(x @ m, x @ quantize_matrix(w, group=32).dequantize(), atol=1e-4))
    True
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxgen.backends.cpu.kernels import quantized_rows
from jaxgen.backends.cpu.kernels.quantized_rows import (
    expand,
    quantized_product,
    stacked_max_rows,
)
from jaxgen.backends.cpu.tuning import KERNEL_MAX_ROWS
from jaxgen.models.gguf_blocks import BlockMatrix
from jaxgen.models.quantize import Int8Matrix

_CODE_OFFSETS = {"Q8_0": 0, "Q4_0": 8, "Q4_1": 0}  # subtracted from each code before scaling


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedKernelMatrix:
    """A quantized [K, N] weight in the kernel's layout (or layer `layer` of a stack of them);
    `x @ self` as x @ the float weight it stands for."""

    codes_nk: jax.Array  # int8 [(L,) N, K] or uint8 [(L,) N, K // 2] (two 4-bit codes a byte)
    scale_nk: jax.Array  # float32 / float16 [(L,) N, G]
    offset_nk: jax.Array | None  # like scale_nk (GGUF Q4_1), else None
    code_offset: int = dataclasses.field(default=0, metadata=dict(static=True))
    layer: int | None = dataclasses.field(default=None, metadata=dict(static=True))

    @classmethod
    def of(cls, matrix: Int8Matrix | BlockMatrix) -> "QuantizedKernelMatrix":
        """Transpose an Int8Matrix or BlockMatrix [(L,) K, N] once into the kernel's layout."""
        kind = getattr(matrix, "kind", None)  # a BlockMatrix's GGUF type; Int8Matrix: none
        code_offset, offset = (0, None) if kind is None else (_CODE_OFFSETS[kind], matrix.offset)
        swap = lambda a: None if a is None else jnp.swapaxes(a, -1, -2)  # noqa: E731
        return cls(swap(matrix.codes), swap(matrix.scale), swap(offset), code_offset)

    @property
    def shape(self) -> tuple[int, int]:
        """The shape of the [K, N] matrix it stands for."""
        n, width = self.codes_nk.shape[-2:]
        return (2 * width if self.codes_nk.dtype == jnp.uint8 else width, n)

    @property
    def dtype(self):
        return jnp.dtype(jnp.float32)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.codes_nk, self.scale_nk, self.offset_nk)
                   if a is not None)

    def _own(self, a: jax.Array | None) -> jax.Array | None:
        return a if a is None or self.layer is None else a[self.layer]

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """The float matrix [K, N] it stands for."""
        return expand(self._own(self.codes_nk), self._own(self.scale_nk),
                      self._own(self.offset_nk), self.code_offset).T.astype(dtype)

    def __rmatmul__(self, x: jax.Array) -> jax.Array:
        """x [..., K] @ self -> [..., N] in x's dtype."""
        rows = math.prod(x.shape[:-1])
        bound = (KERNEL_MAX_ROWS if self.layer is None
                 else stacked_max_rows(self.codes_nk.dtype))
        if 1 <= rows <= bound and x.dtype == jnp.float32 and quantized_rows.available():
            return quantized_product(x, self.codes_nk, self.scale_nk, self.offset_nk,
                                     self.code_offset, self.layer)  # [..., N]
        weight = expand(self._own(self.codes_nk), self._own(self.scale_nk),
                        self._own(self.offset_nk), self.code_offset)  # [N, K]
        return jnp.einsum("...k,nk->...n", x, weight.astype(x.dtype))  # [..., N]

    def columns(self, ids: jax.Array) -> "QuantizedKernelMatrix":
        """The matrix of output columns `ids` [V_d] only (codes, scales, offsets [(L,) V_d, ...])."""
        return jax.tree_util.tree_map(lambda a: jnp.take(a, ids, axis=-2), self)


def kernel_takes(matrix) -> bool:
    """True for an Int8Matrix or BlockMatrix [(L,) K, N] whose scale groups the kernel runs
    (int8: groups of a multiple of 8 inputs; 4-bit: of 32), with the kernel built."""
    if not isinstance(matrix, (Int8Matrix, BlockMatrix)) or not quantized_rows.available():
        return False
    return quantized_rows.runs(matrix.shape[-2], matrix.codes.dtype, matrix.scale.shape[-2])


__all__ = ["QuantizedKernelMatrix", "kernel_takes"]

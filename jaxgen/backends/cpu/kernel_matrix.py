"""Weight matrices whose products with up to `few_rows.max_rows()` rows run the native
few-row kernel (`jaxgen/backends/cpu/kernels/few_rows.py`) on CPU.

`KernelMatrix` holds a [K, N] weight as its transpose `weight_nk` [N, K] (the layout the
kernel streams row by row; a tied head is the embedding itself). `x @ m` (x [..., K]) runs the
kernel for 1 to `max_rows()` rows of float32 (tuning.KERNEL_MAX_ROWS, or
INTEL_AVX512_KERNEL_MAX_ROWS on Intel AVX-512 hosts; STACKED_KERNEL_MAX_ROWS for a layer of a
stack, which XLA would copy out first) and XLA's product with the transposed weight otherwise
(a long prefill). `jaxgen/backends/cpu/layer_split.for_decoding` wraps each layer matrix and the head
this way when the kernel is available; the model's forward does not change.

Example:
    >>> import jax.numpy as jnp
    >>> m = KernelMatrix.of(jnp.arange(12.0).reshape(3, 4))   # a [K, N] = [3, 4] weight
    >>> m.shape, m.weight_nk.shape
    ((3, 4), (4, 3))
    >>> x = jnp.ones((40, 1, 3))                              # 40 rows: XLA's product
    >>> bool(((x @ m) == x @ jnp.arange(12.0).reshape(3, 4)).all())
    True
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxgen.backends.cpu.kernels.few_rows import few_rows_product, max_rows
from jaxgen.backends.cpu.tuning import STACKED_KERNEL_MAX_ROWS


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KernelMatrix:
    """A [K, N] float weight kept as weight_nk [N, K] (or layer `layer` of a stack of them);
    `x @ self` as x @ weight."""

    weight_nk: jax.Array  # [N, K], or a stack [L, N, K] of which `layer` is this matrix
    layer: int | None = dataclasses.field(default=None, metadata=dict(static=True))

    @classmethod
    def of(cls, weight: jax.Array) -> "KernelMatrix":
        """Wrap a [K, N] weight (transposed once)."""
        return cls(weight.T)  # [N, K]

    @property
    def shape(self) -> tuple[int, int]:
        """The shape of the [K, N] matrix it stands for."""
        return tuple(self.weight_nk.shape[-1:-3:-1])

    @property
    def dtype(self):
        return self.weight_nk.dtype

    def __rmatmul__(self, x: jax.Array) -> jax.Array:
        """x [..., K] @ self -> [..., N]."""
        rows = math.prod(x.shape[:-1])
        bound = max_rows() if self.layer is None else STACKED_KERNEL_MAX_ROWS
        if (1 <= rows <= bound and x.dtype == jnp.float32
                and self.weight_nk.dtype == jnp.float32):
            return few_rows_product(x, self.weight_nk, self.layer)  # [..., N]
        weight = self.weight_nk if self.layer is None else self.weight_nk[self.layer]  # [N, K]
        return jnp.einsum("...k,nk->...n", x, weight)  # [..., N]

    def columns(self, ids: jax.Array) -> jax.Array:
        """The weight's output columns `ids` [V_d] only, as a [K, V_d] array."""
        weight = self.weight_nk if self.layer is None else self.weight_nk[self.layer]  # [N, K]
        return jnp.take(weight, ids, axis=0).T  # [K, V_d]


def kernel_stacks(layers: dict) -> tuple[dict, list[dict]]:
    """Stacked layer weights (each leaf [L, ...]) -> (every float32 matrix stack transposed
    once into a buffer per layer, {name: L x [N, K]} (XLA's products of more rows than the
    kernel takes then read a whole buffer, where a layer of a stack is copied out first: a
    512-token prefill 0.61 against 0.76 s on an Intel AVX-512 host), and every quantized stack
    the quantized kernel takes in its layout,
    {name: QuantizedKernelMatrix}; the other leaves (norms, biases, other dtypes) sliced per
    layer). Arrays only, each once: what a compiled call may return."""
    from jaxgen.backends.cpu.quantized_kernel_matrix import (
        QuantizedKernelMatrix,
        kernel_takes,
    )

    def is_float32_stack(value) -> bool:
        return isinstance(value, jax.Array) and value.ndim == 3 and value.dtype == jnp.float32

    count = jax.tree_util.tree_leaves(layers)[0].shape[0]
    transposed = {name: [value[i].T for i in range(value.shape[0])]  # L x [N, K]
                  if is_float32_stack(value) else QuantizedKernelMatrix.of(value)
                  for name, value in layers.items()
                  if is_float32_stack(value) or (kernel_takes(value) and len(value.shape) == 3)}
    others = [{name: jax.tree_util.tree_map(lambda a, i=i: a[i], value)
               for name, value in layers.items() if name not in transposed}
              for i in range(count)]
    return transposed, others


def kernel_layers(transposed: dict, others: list[dict]) -> list[dict]:
    """`kernel_stacks`' pieces -> one dict per layer in which every transposed matrix is a
    KernelMatrix over the layer's own buffer, or a QuantizedKernelMatrix over its stack (one
    buffer that every layer reads in place).

    Example:
        >>> import jax.numpy as jnp
        >>> stacks = kernel_stacks({"wq": jnp.ones((2, 4, 8)), "attn_norm": jnp.ones((2, 4))})
        >>> per_layer = kernel_layers(*stacks)
        >>> m = per_layer[1]["wq"]
        >>> len(per_layer), type(m).__name__, m.layer, m.shape, m.weight_nk.shape
        (2, 'KernelMatrix', None, (4, 8), (8, 4))
        >>> per_layer[1]["attn_norm"].shape
        (4,)
    """
    def layer_of(stack, i: int):
        if isinstance(stack, list):  # float32: the layer's own [N, K] buffer
            return KernelMatrix(stack[i])
        return dataclasses.replace(stack, layer=i)  # a QuantizedKernelMatrix

    return [dict(rest, **{name: layer_of(stack, i) for name, stack in transposed.items()})
            for i, rest in enumerate(others)]


__all__ = ["KernelMatrix", "kernel_layers", "kernel_stacks"]

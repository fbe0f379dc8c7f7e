"""Weight-only int8 quantization (`jaxgen.models.load(..., weights="int8")`).

Every decoder matrix (wq, wk, wv, wo, w_gate, w_up, w_down) and the LM head become an
`Int8Matrix`: int8 codes [..., K, N] with float32 scales [..., K // group, N], symmetric
(absmax / 127 per output channel, or per `group` consecutive inputs of each output
channel). Quantized once, at load; the forward multiplies by the codes and applies the
scales (`x @ m` works on an Int8Matrix), so the same code runs stacked (lax.scan slices
codes and scales alike) and unstacked. The embeddings stay float: a decode step reads one
row of them, and a tied head gets its own quantized [D, V] copy.

On XLA:CPU the int8 -> float conversion is not fused into the dot: the program converts
each matrix to float32 before the matmul. Compiled generate calls on a CPU therefore run
these products through the CPU backend's native quantized kernel (`jaxgen.runtime.backend`,
codes widened in registers: SmolLM2 batch 1 1.8-2.1x the fp32 tokens/s,
benchmarks/bench_speed.py); on accelerators the conversion fuses into the matmul.

Example:
    >>> import jax, jax.numpy as jnp
    >>> w = jax.random.normal(jax.random.key(0), (64, 8))            # [K, N]
    >>> m = quantize_matrix(w)
    >>> m.codes.dtype, m.codes.shape, m.scale.shape, m.shape
    (dtype('int8'), (64, 8), (1, 8), (64, 8))
    >>> x = jnp.ones((2, 64))                                        # [B, K]
    >>> bool(jnp.allclose(x @ m, x @ w, atol=0.1))
    True
    >>> quantize_matrix(w, group=16).scale.shape                     # 4 groups of 16 inputs
    (4, 8)
    >>> check_weights("int4")
    Traceback (most recent call last):
    ...
    ValueError: weights='int4' is not supported; allowed: 'float', 'int8', 'gguf'
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

WEIGHT_FORMATS = ("float", "int8", "gguf")  # the values load(weights=...) accepts
QUANTIZED_LAYER_KEYS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def check_weights(weights: str) -> str:
    """`weights` itself, or a ValueError naming the allowed values."""
    if not isinstance(weights, str) or weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights={weights!r} is not supported; allowed: "
                         f"{', '.join(repr(w) for w in WEIGHT_FORMATS)}")
    return weights


def check_group(weights: str, group) -> None:
    """A ValueError naming `group` unless it is None or a positive int with weights="int8".

    Example:
        >>> check_group("int8", 32); check_group("float", None)
        >>> check_group("gguf", 32)
        Traceback (most recent call last):
        ...
        ValueError: group=32 applies to weights='int8' only (got weights='gguf')
    """
    if group is None:
        return
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        raise ValueError(f"group={group!r} must be a positive int (inputs per int8 scale) "
                         f"or None (one scale per output channel)")
    if weights != "int8":
        raise ValueError(f"group={group} applies to weights='int8' only (got weights={weights!r})")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int8Matrix:
    """A [..., K, N] matrix as int8 codes and float32 scales [..., K // group, N].

    `x @ m` (x [..., K] float) gives x @ dequantize(m) in x's dtype. The leading axes (the
    stacked layers) slice like any PyTree leaf under lax.scan.
    """

    codes: jax.Array  # int8 [..., K, N]
    scale: jax.Array  # float32 [..., G, N], G = K // group (1: per output channel)

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical (float) matrix's shape, what check_params compares."""
        return tuple(self.codes.shape)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """The float matrix [..., K, N] the codes stand for."""
        *lead, k, n = self.codes.shape
        groups = self.scale.shape[-2]
        codes = self.codes.reshape(*lead, groups, k // groups, n).astype(jnp.float32)
        return (codes * self.scale[..., :, None, :]).reshape(*lead, k, n).astype(dtype)

    def __rmatmul__(self, x: jax.Array) -> jax.Array:
        """x [..., K] @ self -> [..., N] in x's dtype."""
        if self.scale.shape[-2] == 1:  # per output channel: scale the product, not the matrix
            out = x @ self.codes.astype(x.dtype)  # [..., N]
            return out * self.scale[..., 0, :].astype(x.dtype)  # [..., N]
        return x @ self.dequantize(x.dtype)  # [..., N]

    def columns(self, ids: jax.Array) -> "Int8Matrix":
        """The matrix of output columns `ids` [V_d] only: [..., K, V_d], still quantized."""
        return jax.tree_util.tree_map(lambda a: jnp.take(a, ids, axis=-1), self)


def dense(matrix):
    """The float array a weight stands for: an array as it is, a quantized matrix (Int8Matrix,
    jaxgen/models/gguf_blocks.BlockMatrix) expanded."""
    return matrix.dequantize() if hasattr(matrix, "dequantize") else matrix


def quantize_matrix(w: jax.Array, group: int | None = None) -> Int8Matrix:
    """Symmetric int8 codes of w [..., K, N]: scale = absmax / 127 over each output channel's
    K inputs (group=None) or over each run of `group` of them (group must divide K)."""
    *lead, k, n = w.shape
    group = k if group is None else int(group)
    if group < 1 or k % group:
        raise ValueError(f"group={group} must divide the matrix's input size {k}")
    w32 = jnp.asarray(w, jnp.float32).reshape(*lead, k // group, group, n)  # [..., G, g, N]
    absmax = jnp.max(jnp.abs(w32), axis=-2)  # [..., G, N]
    scale = jnp.where(absmax > 0, absmax / 127.0, 1.0)  # [..., G, N]
    codes = jnp.clip(jnp.round(w32 / scale[..., :, None, :]), -127, 127)  # [..., G, g, N]
    return Int8Matrix(codes=codes.astype(jnp.int8).reshape(*lead, k, n), scale=scale)


def quantize_params(config, params: dict, group: int | None = None) -> dict:
    """params (stacked or unstacked) with every decoder matrix and the LM head as an
    Int8Matrix; a tied head gets a quantized copy of embed.T as `lm_head` [D, V]."""
    def layer(p: dict) -> dict:
        return {key: quantize_matrix(value, group) if key in QUANTIZED_LAYER_KEYS else value
                for key, value in p.items()}

    layers = params["layers"]
    head = params.get("lm_head")
    if head is None and config.tie_word_embeddings:
        head = params["embed"].T  # [D, V]
    first = layers[0] if isinstance(layers, (list, tuple)) else layers
    _check_group_divides({**{f"layers.{k}": first[k] for k in QUANTIZED_LAYER_KEYS
                             if k in first}, "lm_head": head}, group)
    out = dict(params)
    out["layers"] = [layer(p) for p in layers] if isinstance(layers, (list, tuple)) \
        else layer(layers)
    out["lm_head"] = quantize_matrix(head, group)
    return out


def _check_group_divides(matrices: dict, group: int | None) -> None:
    """A ValueError naming the first matrix (params name -> [..., K, N]) whose input size K
    `group` does not divide, before anything is quantized."""
    for name, matrix in matrices.items():
        inputs = matrix.shape[-2]
        if group is not None and inputs % group:
            raise ValueError(f"group={group} must divide the matrix's input size: {name} has "
                             f"{inputs} inputs (every quantized matrix needs whole groups)")


def quantized_params(model, params: dict, weights: str, group: int | None = None) -> dict:
    """`params` in the `weights` format ("float": unchanged; "int8": quantize_params) for a
    model whose class lists the format in `weight_formats` (the Llama and Gemma 2/3 families);
    a ValueError naming `weights` and the allowed formats otherwise."""
    if check_weights(weights) == "float":
        return params
    if weights != "int8":
        raise ValueError(f"weights={weights!r} keeps a GGUF file's own blocks: load it with "
                         f"jaxgen.models.load(path_or_name, weights={weights!r})")
    formats = getattr(model, "weight_formats", ("float",))
    if weights not in formats or "layers" not in params:
        raise ValueError(f"weights={weights!r} is not available for {type(model).__name__} "
                         f"models; allowed: {', '.join(map(repr, formats))}")
    return quantize_params(model.config, params, group)

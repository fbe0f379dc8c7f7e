"""GGUF quantized blocks kept as integers (`jaxgen.models.load(path, weights="gguf")`).

A llama.cpp file stores each quantized matrix in blocks of 32 inputs of one output row:
Q8_0 = one float16 scale d and 32 int8 codes (w = d·q); Q4_0 = d and 32 four-bit codes
(w = d·(q − 8)); Q4_1 = d, a float16 offset m and 32 four-bit codes (w = d·q + m). The
float path (`jaxgen/models/gguf_checkpoint.py`) dequantizes them to float32 at load. Here they stay
as they are: a `BlockMatrix` holds the codes (4-bit codes two to a byte, as in the file) with
the file's float16 scales and offsets, 4.5 (Q4_0), 5 (Q4_1) or 8.5 (Q8_0) bits a weight
instead of 32, and `x @ m` expands the blocks before the dot. The expanded values are exactly
the float loader's (same float32 products), so logits agree with `weights="float"` to float
rounding.

The loader builds the float load first (config, norms, embeddings, the float head of a
file whose head is not Q4_0 / Q4_1 / Q8_0) and then swaps the matrices, so its peak host
memory is the float model's; the params it returns hold the blocks. On XLA:CPU the expansion
is not fused into the dot (the program writes the float matrix each step), so compiled
generate calls on a CPU run the CPU backend's native quantized kernel on the blocks instead
(`jaxgen.runtime.backend`); `benchmarks/bench_speed.py` measures it beside llama.cpp on the
same file.

Example:
    >>> import numpy as np, gguf
    >>> w = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)  # [out, in]
    >>> raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1)   # the file's bytes
    >>> m = block_matrix(raw, "Q4_1", (3, 64))
    >>> m.shape, m.codes.dtype, m.codes.shape, m.scale.shape                # [K, N] = [in, out]
    ((64, 3), dtype('uint8'), (32, 3), (2, 3))
    >>> m.nbytes * 8 / (64 * 3)                                             # bits a weight
    5.0
    >>> expanded = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_1)  # [out, in]
    >>> bool(np.array_equal(np.asarray(m.dequantize()), expanded.T))
    True
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 32  # inputs per block, for every kind below
BLOCK_KINDS = ("Q4_0", "Q4_1", "Q8_0")  # the GGUF tensor types kept as integers
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockMatrix:
    """A [..., K, N] matrix in GGUF blocks of 32 inputs: codes, float16 scales
    [..., K // 32, N] and, for Q4_1, float16 offsets [..., K // 32, N]. `x @ m` (x [..., K]
    float) gives x @ dequantize(m).

    codes: Q8_0 int8 [..., K, N]; Q4_0 / Q4_1 uint8 [..., K // 2, N], byte j of a block holding
    input j in its low nibble and input j + 16 in its high nibble (the file's own packing).
    The leading axes (stacked layers) slice like any PyTree leaf under lax.scan.
    """

    codes: jax.Array   # int8 [..., K, N] (Q8_0) or uint8 [..., K // 2, N] (Q4_*)
    scale: jax.Array   # float16 [..., K // 32, N]
    offset: jax.Array | None  # float16 [..., K // 32, N] for Q4_1, else None
    kind: str = dataclasses.field(metadata=dict(static=True), default="Q8_0")

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical (float) matrix's shape, what check_params compares."""
        *lead, rows, n = self.codes.shape
        return (*lead, rows if self.kind == "Q8_0" else 2 * rows, n)

    @property
    def nbytes(self) -> int:
        return sum(leaf.nbytes for leaf in (self.codes, self.scale, self.offset)
                   if leaf is not None)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """The float matrix [..., K, N] the blocks stand for (the float loader's values)."""
        *lead, k, n = self.shape
        groups = k // BLOCK
        if self.kind == "Q8_0":
            codes = self.codes.reshape(*lead, groups, BLOCK, n).astype(jnp.float32)
        else:
            packed = self.codes.reshape(*lead, groups, BLOCK // 2, n)  # [..., G, 16, N]
            low, high = packed & 0x0F, packed >> 4  # inputs j and j + 16 of each block
            codes = jnp.concatenate([low, high], axis=-2).astype(jnp.float32)  # [..., G, 32, N]
            if self.kind == "Q4_0":
                codes = codes - 8.0
        values = codes * self.scale.astype(jnp.float32)[..., :, None, :]  # [..., G, 32, N]
        if self.offset is not None:
            values = values + self.offset.astype(jnp.float32)[..., :, None, :]
        return values.reshape(*lead, k, n).astype(dtype)

    def __rmatmul__(self, x: jax.Array) -> jax.Array:
        """x [..., K] @ self -> [..., N] in x's dtype."""
        return x @ self.dequantize(x.dtype)  # [..., N]

    def columns(self, ids: jax.Array) -> "BlockMatrix":
        """The matrix of output columns `ids` [V_d] only: [..., K, V_d], still quantized."""
        return jax.tree_util.tree_map(lambda a: jnp.take(a, ids, axis=-1), self)


def block_matrix(raw: np.ndarray, kind: str, out_in: tuple[int, int]) -> BlockMatrix:
    """The BlockMatrix [in, out] of one GGUF tensor: `raw` its bytes (uint8 [out, in / 32 x
    block bytes], as `gguf.GGUFReader` gives them), `kind` its type name, `out_in` its
    numpy shape (rows = outputs)."""
    if kind not in BLOCK_KINDS:
        raise ValueError(f"GGUF tensor type {kind} cannot be kept as blocks; supported: "
                         f"{', '.join(BLOCK_KINDS)}")
    rows, inputs = (int(d) for d in out_in)
    if inputs % BLOCK:
        raise ValueError(f"a {kind} tensor's input size {inputs} is not a multiple of {BLOCK}")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(
        rows, inputs // BLOCK, _BLOCK_BYTES[kind])  # [out, G, bytes]
    scale = blocks[..., 0:2].copy().view(np.float16)[..., 0]  # [out, G]
    offset = None
    if kind == "Q4_1":
        offset = blocks[..., 2:4].copy().view(np.float16)[..., 0]  # [out, G]
        codes = blocks[..., 4:]  # [out, G, 16] uint8
    elif kind == "Q4_0":
        codes = blocks[..., 2:]  # [out, G, 16] uint8
    else:
        codes = blocks[..., 2:].view(np.int8)  # [out, G, 32] int8
    codes = codes.reshape(rows, -1).T  # [K or K // 2, out]
    return BlockMatrix(codes=jnp.asarray(np.ascontiguousarray(codes)),
                       scale=jnp.asarray(np.ascontiguousarray(scale.T)),
                       offset=None if offset is None
                       else jnp.asarray(np.ascontiguousarray(offset.T)),
                       kind=kind)


def permute_outputs(matrix: BlockMatrix, order: np.ndarray) -> BlockMatrix:
    """The same blocks with output channels (the N axis) taken in `order` (undoes
    llama.cpp's q/k row permutation; blocks never cross outputs)."""
    take = lambda a: None if a is None else jnp.take(a, jnp.asarray(order), axis=-1)  # noqa: E731
    return BlockMatrix(codes=take(matrix.codes), scale=take(matrix.scale),
                       offset=take(matrix.offset), kind=matrix.kind)


def stack(matrices: list[BlockMatrix]) -> BlockMatrix:
    """One BlockMatrix [L, K, N] from L same-kind matrices [K, N] (the stacked layers)."""
    kinds = {m.kind for m in matrices}
    if len(kinds) != 1:
        raise ValueError(f"layers of one matrix mix GGUF block types {sorted(kinds)}; "
                         f"weights='gguf' needs one type per matrix across layers")
    return jax.tree_util.tree_map(lambda *leaves: jnp.stack(leaves), *matrices)


def block_params(reader, config, params: dict, path: str = "<gguf>") -> dict:
    """`params` (the float load of the same file) with every decoder matrix and the LM head
    read again as BlockMatrix from `reader`'s quantized tensors. Float tensors (F32 / F16 /
    BF16 / F64) stay float; a layer matrix of a quantized type outside BLOCK_KINDS is a
    ValueError naming it, an LM head of such a type (Q6_K in llama.cpp's Q4_0 files) keeps
    its float load."""
    from jaxgen.models.gguf_checkpoint import _LAYER_NAMES, unpermute_rows

    tensors = {t.name: t for t in reader.tensors}

    def read(name: str, heads: int | None = None, strict: bool = True):
        tensor = tensors[name]
        kind = tensor.tensor_type.name
        if kind in ("F32", "F16", "BF16", "F64") or (kind not in BLOCK_KINDS and not strict):
            return None  # keep the float load's array
        if kind not in BLOCK_KINDS:
            raise ValueError(f"{path}: tensor {name} is {kind}; weights='gguf' keeps "
                             f"{', '.join(BLOCK_KINDS)} blocks (use weights='float' or "
                             f"'int8' for this file)")
        out_in = tuple(int(d) for d in reversed(tensor.shape))  # numpy order [out, in]
        matrix = block_matrix(tensor.data, kind, out_in)
        if heads is not None:  # llama.cpp's q/k row order -> HF's
            order = unpermute_rows(np.arange(out_in[0])[:, None], heads)[:, 0]  # [out]
            matrix = permute_outputs(matrix, order)
        return matrix

    heads = {"wq": config.num_heads, "wk": config.num_kv_heads}
    layers = dict(params["layers"])
    for key, (suffix, is_matrix) in _LAYER_NAMES.items():
        if not is_matrix:
            continue
        per_layer = [read(f"blk.{i}.{suffix}", heads.get(key)) for i in range(config.num_layers)]
        if all(m is None for m in per_layer):
            continue
        if any(m is None for m in per_layer):
            raise ValueError(f"{path}: {suffix} is quantized in some layers and float in "
                             f"others; weights='gguf' needs one type per matrix")
        layers[key] = stack(per_layer)
    out = dict(params, layers=layers)
    head_name = "token_embd.weight" if config.tie_word_embeddings else "output.weight"
    head = read(head_name, strict=False)  # llama-quantize often stores it as Q6_K: stays float
    if head is not None:
        out["lm_head"] = head  # [D, V]; a tied model keeps its float embeddings for lookup
    return out

"""Stacked layer weights split into one buffer per layer inside a compiled call.

XLA:CPU cannot hand a matmul a dynamic slice of a buffer: under `lax.scan` over stacked
weights ([L, ...] arrays) every layer's matrices are first copied out of the stack (a
`dynamic-slice` fusion before each dot), so a decode step reads and writes each weight twice
more than it multiplies with it. `split_layers`, traced at the top of a jitted call before
its decode loop, slices the stack once per call into per-layer buffers (the same layout as
`unstack_layers`, a tied head included: its own [D, V] copy, read by forwards of 1-2 rows;
for programs of 1 to ROWWISE_MAX_ROWS rows the matrices that share an input concatenated, see
`fuse_projections`), so the forward unrolls over layers and every step's matmuls read the
weights in place. The optimization barrier keeps
XLA from sinking the slices back into the loop body. Cost: one copy of the weights, and
that much extra memory; `jaxgen.runtime.compiled` makes it once per params with `split_pieces` as a
program of its own and keeps it between calls (params under a trace are split inside the
call). Compile time is above the unrolled forward's (every slice is a kernel of its own).

`for_decoding` is what the CPU backend's preparation (prepare.py) runs for every compiled
generate call: on the CPU backend jaxgen's Llama runs split weights by default, the layout
measured fastest there (batch 1 about 1.4x faster per step, equal from batch 2 on), at a longer
compile for batch-1 programs (XLA:CPU emits a matrix-vector kernel per layer matrix). The
call's `layout` chooses (jaxgen.runtime.backend.LAYOUTS): "auto" (split on a single CPU device
when the layer weights fill at least `SPLIT_MIN_BYTES`, stacked elsewhere: small models' steps
are bound by per-op overhead, not by weight reads, so they keep the scan's short compile) or
"split" (whatever the size); "portable" never reaches this module.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxgen.models import tiny_llama
    >>> model, params = tiny_llama()
    >>> split = jax.jit(split_layers)(params)
    >>> len(split["layers"]) == model.config.num_layers, split["layers"][0]["wq"].ndim
    (True, 2)
    >>> sorted(jax.jit(lambda p: split_layers(p, fuse=True))(params)["layers"][0])
    ['attn_norm', 'mlp_norm', 'w_down', 'w_gate_up', 'wo', 'wqkv']
    >>> split["lm_head"].shape                         # the tied head, [D, V]
    (16, 32)
    >>> split_layers(split) is split                   # already per layer: unchanged
    True
"""
from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

from jaxgen.backends.cpu.kernel_matrix import KernelMatrix, kernel_layers, kernel_stacks
from jaxgen.backends.cpu.kernels import few_rows
from jaxgen.backends.cpu.quantized_kernel_matrix import (
    QuantizedKernelMatrix,
    kernel_takes,
)
from jaxgen.backends.cpu.rowwise import rowwise_layer
from jaxgen.backends.cpu.tied_head import TiedHead
from jaxgen.backends.cpu.tuning import ROWWISE_MAX_ROWS, SPLIT_MIN_BYTES
from jaxgen.models.gguf_blocks import BlockMatrix
from jaxgen.models.quantize import Int8Matrix


def is_stacked(params) -> bool:
    """True when params["layers"] holds stacked [L, ...] arrays (a dict, not a list)."""
    return isinstance(params, Mapping) and isinstance(params.get("layers"), Mapping)


def split_layers(params, fuse: bool = False, rowwise: bool = False, kernel: bool = False):
    """params with stacked `layers` -> the same params with `layers` a list of per-layer
    dicts and, for tied embeddings, `lm_head` = embed.T [D, V] (sliced and transposed once,
    behind an optimization barrier): `unstack_layers`' layout. fuse: each layer's
    projections concatenated as well (`fuse_projections`; for programs whose forwards run
    1 to ROWWISE_MAX_ROWS rows). rowwise: each layer matrix wrapped in
    `jaxgen/backends/cpu/rowwise.RowwiseMatrix`, so forwards of 2 to ROWWISE_MAX_ROWS rows run a
    matrix-vector product per row (CPU). kernel: each float32 layer matrix and the head
    wrapped in `jaxgen/backends/cpu/kernel_matrix.KernelMatrix` instead (forwards of up to
    `few_rows.max_rows()` rows run the native few-row kernel; a tied head is the embedding
    [V, D] itself, no copy).
    Other params unchanged. It is `split_pieces`, the barrier, then `with_split_pieces`."""
    if not is_stacked(params) and not (kernel and _plain_per_layer(params)):
        return params
    pieces = split_pieces(params, fuse=fuse, rowwise=rowwise, kernel=kernel)
    return with_split_pieces(params, jax.lax.optimization_barrier(pieces), kernel=kernel)


def split_pieces(params, fuse: bool = False, rowwise: bool = False, kernel: bool = False):
    """The arrays `split_layers` computes from stacked params, each once (so a compiled call
    can return them without copies): {"layers": per-layer dicts, or with kernel
    `kernel_stacks`' (float32 matrices transposed into a buffer per layer, quantized stacks,
    other leaves per layer), "lm_head": the head's new layout, or None where the params' own
    is kept}."""
    layers = params["layers"]
    head = params.get("lm_head")
    if kernel and not is_stacked(params):  # per-layer params (unstack_layers): stacked once
        layers = jax.tree_util.tree_map(lambda *each: jnp.stack(each), *layers)  # [L, ...]
    if kernel:  # the stacks fused and transposed whole, read in place per layer
        stacks = kernel_stacks(fuse_projections(layers) if fuse else layers)
        if isinstance(head, jax.Array) and head.dtype == jnp.float32:
            head = head.T  # [V, D]
        elif kernel_takes(head):
            head = QuantizedKernelMatrix.of(head)  # codes [V, ...]
        else:
            head = None
        return {"layers": stacks, "lm_head": head}
    count = jax.tree_util.tree_leaves(layers)[0].shape[0]
    per_layer = [jax.tree_util.tree_map(lambda a, i=i: a[i], layers)  # each leaf [...]
                 for i in range(count)]
    if fuse:
        per_layer = [fuse_projections(layer) for layer in per_layer]
    if rowwise:
        per_layer = [rowwise_layer(layer) for layer in per_layer]
    return {"layers": per_layer, "lm_head": None if "lm_head" in params else params["embed"].T}


def with_split_pieces(params, pieces, kernel: bool = False):
    """params laid out as `split_pieces` computed them (no array work: host or traced)."""
    head = pieces["lm_head"]
    if kernel:
        if isinstance(head, QuantizedKernelMatrix):  # a quantized head in the kernel's layout
            pass
        elif head is not None:  # an untied float32 head, transposed
            head = KernelMatrix(head)  # [V, D]
        elif params.get("lm_head") is None:  # tied: the embedding itself
            head = KernelMatrix(params["embed"])  # [V, D]
        else:  # quantized or another dtype: as it is
            head = params["lm_head"]
        return dict(params, layers=kernel_layers(*pieces["layers"]), lm_head=head)
    if head is not None:  # a tied head: its [D, V] copy for few rows, the embedding for more
        head = TiedHead(head, params["embed"])
    return dict(params, layers=pieces["layers"], **({} if head is None else {"lm_head": head}))


def fuse_projections(layer: dict) -> dict:
    """One layer's weights with the matrices that read the same input side by side: `wqkv`
    = [wq | wk | wv] ([D, (H + 2K) Dh]) and `w_gate_up` = [w_gate | w_up] ([D, 2F]), so a
    forward runs 4 weight matmuls a layer instead of 7. On XLA:CPU this pays for one-row
    forwards, where each matmul is a matrix-vector kernel with a fixed cost of its own
    (SmolLM2 batch 1: 0.86x the time a step), and for 2-4 rows run row by row
    (`jaxgen/backends/cpu/rowwise.py`: greedy batch 2 / 4 and 4 beams 0.88 / 0.84 / 0.91x the time a
    step), not for plain matrix-matrix products (1.02-1.12x: their kernels run the wider
    matrices slower). Quantized matrices (Int8Matrix with one group size, BlockMatrix of one
    kind) are joined the same way: codes, scales and offsets side by side.

    Example:
        >>> import jax.numpy as jnp
        >>> layer = {"wq": jnp.ones((4, 8)), "wk": jnp.ones((4, 2)), "wv": jnp.ones((4, 2)),
        ...          "w_gate": jnp.ones((4, 6)), "w_up": jnp.ones((4, 6)), "attn_norm": jnp.ones(4)}
        >>> fused = fuse_projections(layer)
        >>> sorted(fused), fused["wqkv"].shape, fused["w_gate_up"].shape
        (['attn_norm', 'w_gate_up', 'wqkv'], (4, 12), (4, 12))
    """
    fused = dict(layer)
    for parts, name in ((("wq", "wk", "wv"), "wqkv"), (("w_gate", "w_up"), "w_gate_up")):
        matrices = [layer.get(part) for part in parts]
        if all(isinstance(m, jax.Array) for m in matrices):
            joined = jnp.concatenate(matrices, axis=-1)  # [..., D, sum of outputs]
        elif _same_quantization(matrices):  # codes, scales (and offsets) side by side
            joined = jax.tree_util.tree_map(lambda *leaves: jnp.concatenate(leaves, axis=-1),
                                            *matrices)  # [..., D (or D / 2, D / g), outputs]
        else:
            continue
        for part in parts:
            del fused[part]
        fused[name] = joined
    return fused


def _same_quantization(matrices) -> bool:
    """True for Int8Matrix's with one group size, or BlockMatrix's of one kind."""
    first = matrices[0]
    if isinstance(first, Int8Matrix):
        return all(isinstance(m, Int8Matrix) and m.scale.shape[-2] == first.scale.shape[-2]
                   for m in matrices)
    return isinstance(first, BlockMatrix) and all(
        isinstance(m, BlockMatrix) and m.kind == first.kind for m in matrices)


def _layer_bytes(params) -> int:
    """Bytes of the stacked layer weights (params["layers"])."""
    return sum(leaf.size * leaf.dtype.itemsize
               for leaf in jax.tree_util.tree_leaves(params["layers"]))


def for_decoding(model, params, rows: int | None = None, layout: str = "auto"):
    """The params a compiled generate call runs (rows: how many rows each decode forward of
    the program runs, None when that varies or is unknown): `split_layers(params, **plan)`
    with `decoding_plan`'s plan, or params unchanged when it has none.

    Example:
        >>> from jaxgen.models import tiny_llama
        >>> model, params = tiny_llama()               # a few KB of weights
        >>> for_decoding(model, params) is params      # "auto": too small to gain, stays stacked
        True
        >>> decoded = for_decoding(model, params, layout="split")
        >>> is_stacked(params), is_stacked(decoded)
        (True, False)
        >>> for_decoding(None, params) is params       # not a jaxgen Llama: left as it is
        True
    """
    plan = decoding_plan(model, params, rows, layout)
    return params if plan is None else split_layers(params, **plan)


def decoding_plan(model, params, rows: int | None = None, layout: str = "auto") -> dict | None:
    """`for_decoding`'s decision: None (params as they are) or `split_layers`' keywords. On
    one CPU device with float32 weights and the native kernel available (backends/cpu/kernels),
    the kernel's layout (`fuse=True, kernel=True`) for any `rows`; else split per layer,
    fused when decode forwards run few rows, row by row on CPU; both for jaxgen's Llama with
    stacked layers when `layout` is "split", or "auto" on a single CPU device with at least
    SPLIT_MIN_BYTES of layer weights (per-layer params of that size: the kernel's layout only);
    None otherwise (other models, params already laid out; under "auto" small models,
    accelerators and meshes)."""
    from jaxgen.models.llama import Llama

    if not isinstance(model, Llama):
        return None
    if not is_stacked(params):  # per-layer params: the kernel's layout, or as they are
        large = layout == "split" or _layer_bytes(params) >= SPLIT_MIN_BYTES
        return (dict(fuse=True, rowwise=False, kernel=True)
                if large and _plain_per_layer(params) and _kernel_runs(params) else None)
    if layout == "auto" and (jax.default_backend() != "cpu" or jax.device_count() > 1
                             or _layer_bytes(params) < SPLIT_MIN_BYTES):
        return None  # accelerators, CPU meshes (a test device's emulation), small models
    rowwise = jax.default_backend() == "cpu"
    if _kernel_runs(params):
        return dict(fuse=True, rowwise=False, kernel=True)
    fuse = rows is not None and (rows == 1 or (rowwise and rows <= ROWWISE_MAX_ROWS))
    return dict(fuse=fuse, rowwise=rowwise, kernel=False)


def _kernel_runs(params) -> bool:
    """The native kernel's layout applies: one CPU device, float32 weights (or quantized ones
    the quantized kernel takes) and the kernel built, whatever the rows. One row included:
    the kernel streams each weight row whole, and whole batch-1 SmolLM2 programs ran faster
    than on XLA's matrix-vector products on both kinds of host (AVX-512 Zen 4: 1.1x and more;
    AVX2 EPYC Zen 1, 4-row build: 40.4 against 45.3 ms a token in
    `benchmarks/bench_speed.py --layouts 08`);
    quantized weights gain most, since XLA expands them to float32 in memory before every
    product."""
    return (jax.default_backend() == "cpu" and jax.device_count() == 1
            and _kernel_weights(params) and few_rows.available())


def _layer_values(params) -> list:
    """Every value of params["layers"], stacked (a dict) or per layer (a list of dicts)."""
    layers = params["layers"]
    if isinstance(layers, Mapping):
        return list(layers.values())
    return [value for layer in layers for value in layer.values()]


def _plain_per_layer(params) -> bool:
    """True for per-layer params of plain arrays (`unstack_layers`' layout, not yet laid out
    for decoding) whose layers hold the same names and shapes (so they stack)."""
    layers = params.get("layers") if isinstance(params, Mapping) else None
    return (isinstance(layers, (list, tuple)) and len(layers) > 0
            and all(isinstance(layer, Mapping) and all(isinstance(v, jax.Array)
                                                       for v in layer.values())
                    for layer in layers)
            and all(jax.tree_util.tree_structure(layer) == jax.tree_util.tree_structure(layers[0])
                    and all(a.shape == b.shape for a, b in zip(jax.tree_util.tree_leaves(layer),
                                                              jax.tree_util.tree_leaves(layers[0])))
                    for layer in layers))


def _kernel_weights(params) -> bool:
    """True when every layer matrix and the embedding are float32 (the kernel's dtype) or
    quantized matrices the quantized kernel takes (load(weights="int8" / "gguf"))."""
    matrices = _layer_values(params)
    if any(isinstance(m, (Int8Matrix, BlockMatrix)) and not kernel_takes(m) for m in matrices):
        return False
    floats = [m for m in matrices if not isinstance(m, (Int8Matrix, BlockMatrix))]
    leaves = jax.tree_util.tree_leaves(floats) + [params["embed"]]
    return all(not isinstance(leaf, jax.Array) or leaf.ndim < 2 or leaf.dtype == jnp.float32
               for leaf in leaves)

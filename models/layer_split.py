"""Stacked layer weights split into one buffer per layer inside a compiled call.

XLA:CPU cannot hand a matmul a dynamic slice of a buffer: under `lax.scan` over stacked
weights ([L, ...] arrays) every layer's matrices are first copied out of the stack (a
`dynamic-slice` fusion before each dot), so a decode step reads and writes each weight twice
more than it multiplies with it. `split_layers`, traced at the top of a jitted call before
its decode loop, slices the stack once per call into per-layer buffers (the same layout as
`unstack_layers`, a tied head included: its own [D, V] copy), so the forward unrolls over
layers and every step's matmuls read the weights in place. The optimization barrier keeps
XLA from sinking the slices back into the loop body. Cost: one copy of the weights per call
and that much extra memory while the call runs; compile time is above the unrolled
forward's (every slice is a kernel of its own). Nothing calls it by default yet.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxgen.models import tiny_llama
    >>> model, params = tiny_llama()
    >>> split = jax.jit(split_layers)(params)
    >>> len(split["layers"]) == model.config.num_layers, split["layers"][0]["wq"].ndim
    (True, 2)
    >>> split["lm_head"].shape                         # the tied head, [D, V]
    (16, 32)
    >>> split_layers(split) is split                   # already per layer: unchanged
    True
"""
from __future__ import annotations

from collections.abc import Mapping

import jax


def is_stacked(params) -> bool:
    """True when params["layers"] holds stacked [L, ...] arrays (a dict, not a list)."""
    return isinstance(params, Mapping) and isinstance(params.get("layers"), Mapping)


def split_layers(params):
    """params with stacked `layers` -> the same params with `layers` a list of per-layer
    dicts and, for tied embeddings, `lm_head` = embed.T [D, V] (sliced and transposed once,
    behind an optimization barrier): `unstack_layers`' layout. Other params unchanged."""
    if not is_stacked(params):
        return params
    layers = params["layers"]
    count = jax.tree_util.tree_leaves(layers)[0].shape[0]
    per_layer = [jax.tree_util.tree_map(lambda a, i=i: a[i], layers)  # each leaf [...]
                 for i in range(count)]
    extra = {} if "lm_head" in params else {"lm_head": params["embed"].T}  # [D, V]
    per_layer, extra = jax.lax.optimization_barrier((per_layer, extra))
    return dict(params, layers=per_layer, **extra)

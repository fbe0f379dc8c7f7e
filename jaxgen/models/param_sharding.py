"""Tensor parallelism for the Llama family: parameters placed on a ("data", "model") mesh.

The Megatron layout, written as one rule per parameter name (the dimension that goes on the
mesh's "model" axis; every other dimension is whole, and parameters are replicated over
"data"):

    wq, wk, wv, bq, bk, bv   [.., D, H*Dh]   output dim: each device holds H/m query heads
                                             and Hkv/m KV heads (column parallel)
    w_gate, w_up             [.., D, F]      output dim: F/m hidden units (column parallel)
    wo                       [.., H*Dh, D]   input dim (row parallel: one all-reduce)
    w_down                   [.., F, D]      input dim (row parallel: one all-reduce)
    embed [V, D], lm_head [D, V]             the vocabulary (vocabulary parallel) when the
                                             "model" axis divides V, else replicated
                                             (`head="replicated"` forces it)
    exit_adapters/E/w_in [D, A], w_out [A, D]   column / row parallel when m divides A
    mtp/layers/*  [depths, ...]              the MTP depths' decoder blocks (jaxgen/models/mtp.py):
                                             the decoder layers' rules; mtp's norms and
                                             eh_proj [depths, 2D, D] replicated
    norms, biases of the output, and anything else (e.g. drafter sub-trees this module does
    not know)                                replicated

Another family states its own layer rules as `model.sharding_rules` ({name: dimension from
the end}, merged over the rules above: e.g. MoE experts [L, E, D, F] on "model" by expert;
they also place the family's top-level arrays they name, e.g. Gemma 4's per-layer-input table)
and its divisibility checks as `model.check_mesh_fits(mesh)` (a ValueError naming the size).

The rules count dimensions from the end, so the stacked layout ([L, ...] arrays) and the
unstacked one (`unstack_layers`: a list of per-layer dicts) shard alike. With the batch on
"data" and the KV cache on "model" (`jaxgen.init_state(..., mesh=mesh)`), `jaxgen.generate`
runs the same program under SPMD: XLA inserts the all-reduces, nothing else changes.

Example (one CPU device: a (1, 1) mesh; an 8-device mesh splits the same dimensions):
    >>> import jax
    >>> from jax.sharding import AxisType
    >>> from jaxgen.models import tiny_llama
    >>> model, params = tiny_llama()
    >>> mesh = jax.make_mesh((1, 1), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    >>> placed = shard(model, params, mesh)
    >>> placed["layers"]["wq"].sharding.spec, placed["layers"]["wo"].sharding.spec
    (P(None, None, 'model'), P(None, 'model', None))
"""
from __future__ import annotations

from collections.abc import Mapping

import jax
from jax.sharding import NamedSharding, PartitionSpec

from jaxgen.cache.sharding import MODEL, axis_size, check_divides, check_mesh

# Parameter name -> the dimension (from the end) that goes on "model".
LAYER_RULES = {"wq": -1, "wk": -1, "wv": -1, "bq": -1, "bk": -1, "bv": -1,
               "w_gate": -1, "w_up": -1, "wo": -2, "w_down": -2}
ADAPTER_RULES = {"w_in": -1, "w_out": -2}
HEAD_CHOICES = ("auto", "vocab", "replicated")


def _spec(ndim: int, dim: int | None) -> PartitionSpec:
    """PartitionSpec with "model" on dimension `dim` (negative: from the end) or nowhere."""
    spec = [None] * ndim
    if dim is not None:
        spec[dim] = MODEL
    return PartitionSpec(*spec)


def check_model_fits(config, mesh) -> None:
    """ValueError naming the sizes unless the "model" axis divides the query heads, the KV
    heads and the MLP's hidden size."""
    hint = "choose a model axis that divides it (the data axis may take the other devices)"
    check_divides("num_heads", config.num_heads, mesh, MODEL, hint)
    check_divides("num_kv_heads", config.num_kv_heads, mesh, MODEL, hint)
    check_divides("intermediate_size", config.intermediate_size, mesh, MODEL, hint)


def _vocab_parallel(config, mesh, head: str) -> bool:
    if head not in HEAD_CHOICES:
        raise ValueError(f"head={head!r}; allowed: {', '.join(map(repr, HEAD_CHOICES))}")
    divides = config.vocab_size % axis_size(mesh, MODEL) == 0
    if head == "vocab" and not divides:
        check_divides("vocab_size", config.vocab_size, mesh, MODEL,
                      "use head='replicated' or a model axis that divides the vocabulary")
    return head != "replicated" and divides


def param_shardings(model, params, mesh, *, head: str = "auto"):
    """The params' PyTree with a NamedSharding in place of every array (see the module docs).

    head: "auto" (vocabulary parallel when the model axis divides the vocabulary, else
    replicated), "vocab" (vocabulary parallel, an error if it does not divide) or
    "replicated". Raises ValueError when the model axis does not divide the heads, the KV
    heads or the MLP size.
    """
    mesh = check_mesh(mesh)
    config = getattr(model, "config", None)
    family_check = getattr(model, "check_mesh_fits", None)  # a family's own divisibility rules
    if family_check is not None:
        family_check(mesh)
    elif not all(hasattr(config, name) for name in ("num_heads", "num_kv_heads",
                                                     "intermediate_size", "vocab_size")):
        raise ValueError(f"shard() lays out the Llama family's parameters; "
                         f"{type(model).__name__} has no Llama config")
    else:
        check_model_fits(config, mesh)
    family_rules = dict(getattr(model, "sharding_rules", {}))
    rules = {**LAYER_RULES, **family_rules}
    vocab = _vocab_parallel(config, mesh, head)
    model_devices = axis_size(mesh, MODEL)

    def place(dim):
        def one(array):  # an array, or one leaf of a quantized matrix (codes, scales)
            fits = dim is None or array.shape[dim] % model_devices == 0
            return NamedSharding(mesh, _spec(array.ndim, dim if fits else None))
        return lambda value: jax.tree_util.tree_map(one, value)  # Int8Matrix / BlockMatrix too

    def layer(tree: Mapping):
        return {name: place(rules.get(name))(array) for name, array in tree.items()}

    def adapter(tree: Mapping):
        width = tree["w_in"].shape[-1] if "w_in" in tree else 0
        split = width % model_devices == 0
        return {name: place(ADAPTER_RULES.get(name) if split else None)(array)
                for name, array in tree.items()}

    out = {}
    for name, value in params.items():
        if name == "layers":
            out[name] = (layer(value) if isinstance(value, Mapping)
                         else [layer(one) for one in value])
        elif name == "embed":
            out[name] = place(0 if vocab else None)(value)  # [V, D]
        elif name == "lm_head":
            out[name] = place(-1 if vocab else None)(value)  # [D, V]
        elif name == "exit_adapters" and isinstance(value, Mapping):
            out[name] = {key: adapter(tree) for key, tree in value.items()}
        elif name == "mtp" and isinstance(value, Mapping):  # the checkpoint's MTP depths
            out[name] = {key: layer(tree) if key == "layers" else
                         jax.tree_util.tree_map(place(None), tree)
                         for key, tree in value.items()}
        elif name in family_rules and not isinstance(value, Mapping):  # e.g. Gemma 4's PLE
            out[name] = place(family_rules[name])(value)
        else:  # final_norm, and sub-trees this module does not know: whole on every device
            out[name] = jax.tree_util.tree_map(place(None), value)
    return out


def shard(model, params, mesh, *, head: str = "auto"):
    """`params` placed on `mesh` in the Megatron layout (see the module docs and
    `param_shardings` for `head`). mesh: a jax.sharding.Mesh with axes "data" and "model".
    Returns new arrays; `params` is left as it was."""
    return jax.device_put(params, param_shardings(model, params, mesh, head=head))

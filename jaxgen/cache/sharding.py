"""Placing a cache, and the decoding state around it, on a `jax.sharding.Mesh`.

jaxgen shards over a mesh with two named axes (either may have size 1):

    "data"    rows of the batch (data parallelism)
    "model"   attention heads / KV heads and the MLP's hidden units (tensor parallelism,
              jaxgen.models.shard places the parameters)

Every cache kind declares the logical axis of each array it holds (`field_axes`, a class
attribute: e.g. the static kind's k is ("layer", "batch", "kv_heads", "time", "head_dim"));
"batch" goes on "data", "kv_heads" on "model", every other axis is whole on each device. A
kind without `field_axes` cannot be sharded: `cache_shardings` raises a ValueError rather
than letting the cache be gathered onto every device. A composite kind (one holding inner
caches, e.g. Gemma 4's) names such a field `INNER_CACHES`: each inner cache is split by its own
`field_axes`.

Example (one CPU device: a (1, 1) mesh; the specs are what an 8-device mesh would use):
    >>> import jax
    >>> from jaxgen.cache import KVCache
    >>> mesh = jax.make_mesh((1, 1), ("data", "model"), axis_types=(AUTO, AUTO))
    >>> cache = KVCache.init(num_layers=2, batch=2, max_len=8, num_kv_heads=2, head_dim=4)
    >>> specs = cache_shardings(cache, mesh)
    >>> specs.k.spec, specs.length.spec
    (P(None, 'data', 'model', None, None), P('data',))
"""
from __future__ import annotations

import dataclasses

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

DATA, MODEL = "data", "model"
AUTO = AxisType.Auto
# Logical axis -> mesh axis; logical axes not listed are never split.
MESH_AXIS_OF = {"batch": DATA, "kv_heads": MODEL}
# The field_axes entry of a field that holds a tuple of inner caches (a composite kind, e.g.
# jaxgen.models.gemma4_cache: one inner cache per attention type).
INNER_CACHES = "inner caches"


def check_mesh(mesh) -> Mesh:
    """The mesh with "data" and "model" axes, as an Auto (compiler-propagated) mesh.

    A mesh from `jax.make_mesh` has Explicit axes by default (sharding in types); jaxgen
    lets the compiler propagate shardings through its loops, so the same devices and axis
    names are used with Auto axes. Raises TypeError / ValueError for anything else.
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    names = tuple(mesh.axis_names)
    if sorted(names) != sorted((DATA, MODEL)):
        raise ValueError(f"mesh axes must be named {DATA!r} and {MODEL!r} (either may have "
                         f"size 1), e.g. jax.make_mesh((1, 8), ('data', 'model')); got "
                         f"{names}")
    if any(kind != AUTO for kind in mesh.axis_types):
        mesh = Mesh(mesh.devices, names, axis_types=(AUTO,) * len(names))
    return mesh


def axis_size(mesh: Mesh, name: str) -> int:
    """Devices along one mesh axis."""
    return int(mesh.shape[name])


def check_divides(what: str, size: int, mesh: Mesh, axis: str, hint: str = "") -> None:
    """ValueError naming both sizes unless the mesh axis divides `size`."""
    devices = axis_size(mesh, axis)
    if size % devices:
        raise ValueError(f"{what} ({size}) is not a multiple of the mesh's {axis!r} axis "
                         f"({devices} devices){': ' + hint if hint else ''}")


def logical_spec(axes: tuple[str, ...]) -> PartitionSpec:
    """PartitionSpec for an array whose dimensions carry the logical names `axes`."""
    return PartitionSpec(*(MESH_AXIS_OF.get(name) for name in axes))


def cache_shardings(cache, mesh: Mesh):
    """The cache's PyTree with a NamedSharding in place of every array (same structure).

    Raises ValueError when the kind cannot be sharded (no `field_axes`), when the batch is
    not a multiple of the "data" axis, or the KV heads not a multiple of "model".
    """
    mesh = check_mesh(mesh)
    axes = getattr(type(cache), "field_axes", None)
    if axes is None:
        raise ValueError(f"the {getattr(cache, 'kind', type(cache).__name__)!r} cache "
                         f"({type(cache).__name__}) does not declare how its arrays split "
                         f"over a mesh (no field_axes), so it cannot be sharded; use "
                         f"cache_implementation='static'")
    memory_kind = getattr(cache, "memory_kind", None)  # the offloaded kind's host memory
    changes = {}
    for field in dataclasses.fields(cache):
        value = getattr(cache, field.name)
        if field.metadata.get("static") or value is None:
            continue
        names = axes[field.name]
        if names == INNER_CACHES:  # a tuple of caches, each split by its own field_axes
            changes[field.name] = tuple(cache_shardings(inner, mesh) for inner in value)
            continue
        if len(names) != value.ndim:
            raise ValueError(f"{type(cache).__name__}.field_axes[{field.name!r}] names "
                             f"{len(names)} axes for an array of shape {value.shape}")
        for dim, name in enumerate(names):
            if name == "batch":
                check_divides("the batch (rows, beams included)", value.shape[dim], mesh, DATA,
                              "pass a number of prompts the data axis divides, or a mesh "
                              "with a smaller data axis")
            elif name == "kv_heads":
                check_divides("the number of KV heads", value.shape[dim], mesh, MODEL,
                              "use a model axis that divides the KV heads")
        changes[field.name] = NamedSharding(mesh, logical_spec(names), memory_kind=memory_kind
                                            if "kv_heads" in names else None)
    return dataclasses.replace(cache, **changes)


def shard_cache(cache, mesh: Mesh):
    """The cache placed on the mesh: rows on "data", KV heads on "model" (see the module
    docs). Raises ValueError where it cannot be (see `cache_shardings`)."""
    return jax.device_put(cache, cache_shardings(cache, mesh))


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Rows [B, ...] split over "data", the other dimensions whole."""
    return NamedSharding(check_mesh(mesh), PartitionSpec(DATA, *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
    """The same whole array on every device of the mesh."""
    return NamedSharding(check_mesh(mesh), PartitionSpec())

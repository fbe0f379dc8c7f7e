"""A researcher's Flax module (NNX or Linen) as a jaxgen `Model`: `from_flax(...)`.

    model, params = from_flax(nnx_module, vocab_size=..., num_layers=..., ...)   # NNX
    model, params = from_flax(nnx_graphdef, nnx_state, ...)                     # NNX, split
    model, params = from_flax(linen_module, variables, ...)                     # Linen
    out = jaxgen.generate(params, jaxgen.init_state(model, prompts, cfg), cfg)

An NNX module is split with `nnx.split` into its graph definition (static: part of the model,
hashable, so jit keys on it) and its `nnx.State` (the params: a PyTree every program takes
as an argument, never baked into it as constants); each forward is `nnx.merge(graphdef,
params)(tokens, positions, cache)`. A Linen module runs through `module.apply(variables,
tokens, positions, cache)`; the params are its variables dict.

The protocol a module meets (checked by `from_flax` with `jax.eval_shape` on a one-token
input, before anything compiles; a module that breaks it gets a ValueError naming what is
missing):

    module(tokens [B, S] int32, positions [B, S] int32, cache)
        -> (logits [B, S, V], cache)   or an object with .logits, .cache (and optionally
                                       .hidden [B, S, D], the last layer's states)
    cache       jaxgen's own fixed-shape KV cache (jaxgen.cache): each attention layer i
                writes its keys / values and attends in one call,
                    out, cache = cached_attention(cache, i, q, k, v, positions)
                q [B, S, H, Dh], k / v [B, S, Hkv, Dh] (after RoPE), out [B, S, H, Dh]; the
                module returns the cache it got back from its last layer
    sizes       vocab_size, num_layers, num_kv_heads, head_dim (the cache's shape) and
                optionally max_position_embeddings, sliding_window: keywords of from_flax,
                else attributes of the module, else of `module.config`

The module never sets the cache's length, slices logits or handles padding: the adapter
sets the length to positions[:, -1] + 1 after the forward and picks `logits_index`'s
positions from the logits. What the base contract carries runs: greedy and sampling, beam
search, prompt lookup, draft models (a Flax model as the target, the draft or both), every
cache kind, the chunked driver. What needs more than the base contract is refused by the
mode itself: early exit needs a `LayeredModel`, token trees a `tree_mask` keyword, MTP
drafters the target's hidden states (return `.hidden`).

Example (a tiny NNX module: embedding, one attention layer through the cache, a head):
    >>> import jax, jax.numpy as jnp, jaxgen
    >>> from flax import nnx
    >>> class Tiny(nnx.Module):
    ...     vocab_size, num_layers, num_kv_heads, head_dim = 16, 1, 1, 4
    ...     def __init__(self, rngs):
    ...         self.embed = nnx.Embed(16, 4, rngs=rngs)
    ...         self.qkv = nnx.Linear(4, 12, use_bias=False, rngs=rngs)
    ...     def __call__(self, tokens, positions, cache):
    ...         x = self.embed(tokens)                                  # [B, S, 4]
    ...         q, k, v = jnp.split(self.qkv(x)[:, :, None], 3, -1)     # [B, S, 1, 4] each
    ...         out, cache = cached_attention(cache, 0, q, k, v, positions)
    ...         return self.embed.attend(x + out[:, :, 0]), cache      # [B, S, 16]
    >>> model, params = from_flax(Tiny(nnx.Rngs(0)), max_positions=32)
    >>> model.vocab_size, type(params).__name__
    (16, 'State')
    >>> rows = jaxgen.generate_ids(model, params, [[1, 2, 3]], max_new_tokens=4)
    >>> len(rows[0])
    7
"""
from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from jaxgen.cache import Cache
from jaxgen.models.llama import ModelOutput, uniform_cache

SIZES = ("vocab_size", "num_layers", "num_kv_heads", "head_dim")  # required: the cache's shape
PROTOCOL = ("module(tokens [B, S] int32, positions [B, S] int32, cache) -> (logits [B, S, V], "
            "cache) or an object with .logits and .cache")


@dataclasses.dataclass(frozen=True)
class FlaxModelConfig:
    """The sizes and special ids of an adapted Flax model (static, hashable)."""

    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int | None = None  # None: no position limit is checked
    sliding_window: int | None = None  # the window the module attends with (ring caches)
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    generation_defaults: tuple[tuple[str, Any], ...] = ()


@dataclasses.dataclass(frozen=True)
class FlaxModel:
    """A Flax module under the model contract: `graphdef` (NNX) or `module` (Linen) is static;
    params are the NNX State or the Linen variables, passed to every call."""

    config: FlaxModelConfig
    graphdef: Any = None  # nnx.GraphDef (NNX)
    module: Any = None  # flax.linen.Module (Linen)
    # ((path, shape), ...) of the params the model was adapted with (check_params)
    param_shapes: tuple = dataclasses.field(default=(), compare=False, hash=False, repr=False)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32, kind: str = "static",
                   cache_config: dict | None = None) -> Cache:
        """An empty cache of `kind` (jaxgen.cache.CACHE_KINDS): k, v [L, batch, Hkv, max_len,
        Dh] for the static kind."""
        return uniform_cache(self.config, kind, batch, max_len, dtype, cache_config)

    def run_module(self, params: Any, tokens: jax.Array, positions: jax.Array,
                   cache: Cache) -> Any:
        """The module's own forward, as it returns it (no contract applied)."""
        if self.graphdef is not None:
            from flax import nnx

            return nnx.merge(self.graphdef, params)(tokens, positions, cache)
        return self.module.apply(params, tokens, positions, cache)

    def __call__(self, params: Any, tokens: jax.Array, positions: jax.Array, cache: Cache, *,
                 logits_index: jax.Array | None = None) -> ModelOutput:
        """tokens, positions int32 [B, S] -> ModelOutput(logits [B, S', V] float32, hidden
        [B, S, D] or None (the module returns none), cache with length positions[:, -1] + 1).
        logits_index: optional int32 [B, S'], the positions that get logits."""
        logits, cache, hidden = unpack_output(self.run_module(params, tokens, positions, cache))
        if logits_index is not None:
            logits = jnp.take_along_axis(logits, logits_index[:, :, None].astype(jnp.int32),
                                         axis=1)  # [B, S', V]
        cache = cache.with_length(positions[:, -1] + 1)
        return ModelOutput(logits=logits.astype(jnp.float32), hidden=hidden, cache=cache)

    def check_params(self, params: Any) -> None:
        """ValueError naming the first parameter whose path or shape differs from the params
        the model was adapted with (host only: reads `.shape`)."""
        if not self.param_shapes:
            return
        got = param_signature(params)
        if len(got) != len(self.param_shapes):
            raise ValueError(f"params hold {len(got)} arrays, expected {len(self.param_shapes)} "
                             f"(the params from_flax adapted)")
        for (path, shape), (want_path, want_shape) in zip(got, self.param_shapes):
            if path != want_path:
                raise ValueError(f"params{path} is not in the adapted params (expected "
                                 f"params{want_path} there)")
            if shape != want_shape:
                raise ValueError(f"params{path} has shape {shape}, expected {want_shape} "
                                 f"(the params from_flax adapted)")


def cached_attention(cache: Cache, layer, q: jax.Array, k: jax.Array, v: jax.Array,
                     positions: jax.Array, *, scale: float | None = None,
                     window: int | None = None, softcap: float | None = None
                     ) -> tuple[jax.Array, Cache]:
    """One layer's attention through jaxgen's cache: writes k, v at `positions`, attends q
    over the layer's keys (causal by position, grouped-query). q [B, S, H, Dh]; k, v
    [B, S, Hkv, Dh]; positions int32 [B, S]; layer: the layer's index (an int, or traced
    under a scan). scale: default Dh ** -0.5. Returns (out [B, S, H, Dh], cache)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return cache.update_attend(layer, q, k, v, positions, scale=scale, window=window,
                               softcap=softcap)


def unpack_output(out: Any) -> tuple[Any, Any, Any]:
    """(logits, cache, hidden or None) of a module's return value; ValueError when it is
    neither a (logits, cache) pair nor an object with .logits and .cache."""
    if isinstance(out, (tuple, list)) and len(out) == 2 and not hasattr(out, "logits"):
        return out[0], out[1], None
    if isinstance(out, Mapping) and "logits" in out and "cache" in out:
        return out["logits"], out["cache"], out.get("hidden")
    if hasattr(out, "logits") and hasattr(out, "cache"):
        return out.logits, out.cache, getattr(out, "hidden", None)
    shape = f" of {len(out)} items" if isinstance(out, (tuple, list)) else ""
    raise ValueError(f"the module returned a {type(out).__name__}{shape}; the protocol: "
                     f"{PROTOCOL}")


def param_signature(params: Any) -> tuple:
    """((path, shape), ...) of every array in params, in PyTree order."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    return tuple((jax.tree_util.keystr(path), tuple(getattr(leaf, "shape", ())))
                 for path, leaf in leaves)


def from_flax(module_or_graphdef: Any, params: Any = None, *, vocab_size: int | None = None,
              num_layers: int | None = None, num_kv_heads: int | None = None,
              head_dim: int | None = None, max_positions: int | None = None,
              sliding_window: int | None = None, eos_token_id=None,
              pad_token_id: int | None = None, bos_token_id: int | None = None
              ) -> tuple[FlaxModel, Any]:
    """(model, params): a Flax module under jaxgen's `Model` contract (module docs).

    module_or_graphdef: an `nnx.Module` (params: None, it is split here), an `nnx.GraphDef`
    (params: its `nnx.State`) or a `flax.linen.Module` (params: its variables dict, e.g.
    `module.init(...)`). Sizes not given here are read from the module (or module.config):
    vocab_size, num_layers, num_kv_heads, head_dim, max_position_embeddings (max_positions),
    sliding_window. eos / pad / bos ids: what generate's default config uses.
    Raises TypeError for something that is not a Flax module, ValueError when the module
    breaks the protocol (checked with jax.eval_shape on one token: nothing compiles).
    """
    from flax import linen, nnx

    if isinstance(module_or_graphdef, nnx.Module):
        if params is not None:
            raise ValueError("params: pass None with an nnx.Module (from_flax splits it with "
                             "nnx.split), or pass nnx.split's (graphdef, state) instead")
        graphdef, params = nnx.split(module_or_graphdef)
        holder, kind = module_or_graphdef, "nnx"
    elif isinstance(module_or_graphdef, nnx.GraphDef):
        if not isinstance(params, nnx.State):
            raise ValueError(f"params: an nnx.GraphDef needs its nnx.State (graphdef, state = "
                             f"nnx.split(module)); got {type(params).__name__}")
        graphdef = module_or_graphdef
        holder, kind = nnx.merge(graphdef, params), "nnx"
    elif isinstance(module_or_graphdef, linen.Module):
        if not isinstance(params, Mapping):
            raise ValueError(f"params: a Linen module needs its variables dict (variables = "
                             f"module.init(key, tokens, positions, cache)); got "
                             f"{type(params).__name__}")
        graphdef, holder, kind = None, module_or_graphdef, "linen"
    else:
        raise TypeError(f"module_or_graphdef must be a Flax module: a flax.nnx.Module, an "
                        f"nnx.GraphDef (with params=its nnx.State) or a flax.linen.Module "
                        f"(with params=its variables); got {type(module_or_graphdef).__name__}")
    given = dict(vocab_size=vocab_size, num_layers=num_layers, num_kv_heads=num_kv_heads,
                 head_dim=head_dim, max_position_embeddings=max_positions,
                 sliding_window=sliding_window)
    sizes = {name: _size(holder, name, value, required=name in SIZES)
             for name, value in given.items()}
    eos = () if eos_token_id is None else tuple(
        eos_token_id if isinstance(eos_token_id, (list, tuple)) else (eos_token_id,))
    config = FlaxModelConfig(**sizes, bos_token_id=bos_token_id, eos_token_id=eos,
                             pad_token_id=pad_token_id)
    model = FlaxModel(config=config, graphdef=graphdef,
                      module=holder if kind == "linen" else None,
                      param_shapes=param_signature(params))
    try:
        hash(model)
    except TypeError as error:
        raise ValueError(f"the module must be hashable (it is static for jit; a Linen module's "
                         f"fields, an NNX module's static attributes): {error}") from None
    check_protocol(model, params, holder)
    return model, params


def _size(holder: Any, name: str, given: Any, required: bool) -> int | None:
    """A size from the keyword, else the module's attribute, else module.config's."""
    where = f"keyword {name if name != 'max_position_embeddings' else 'max_positions'}="
    value = given
    if value is None:
        value = getattr(holder, name, None)
        where = f"the module's {name}"
        if value is None:
            value = getattr(getattr(holder, "config", None), name, None)
            where = f"the module's config.{name}"
    if value is None:
        if required:
            raise ValueError(f"missing {name}: pass from_flax(..., {name}=...), or give the "
                             f"module (or module.config) a {name} attribute; the protocol "
                             f"needs {', '.join(SIZES)}")
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} (from {where}); allowed: an int >= 1")
    return int(value)


def check_protocol(model: FlaxModel, params: Any, holder: Any) -> None:
    """ValueError naming what a module lacks: its call signature, its output's kind, the
    logits' shape, the cache it returns (jax.eval_shape on tokens [1, 1]: no compile)."""
    call = type(holder).__call__ if model.graphdef is not None else holder.__call__
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)  # [1, 1]
    cache = jax.eval_shape(lambda: model.init_cache(1, 2))
    try:
        signature = inspect.signature(call)
    except (TypeError, ValueError):
        signature = None
    if signature is not None:
        try:
            bound = (tokens, tokens, cache) if model.graphdef is None else (None, tokens,
                                                                           tokens, cache)
            signature.bind(*bound)
        except TypeError:
            raise ValueError(f"the module's __call__{signature} does not take (tokens, "
                             f"positions, cache); the protocol: {PROTOCOL}") from None
    try:
        out = jax.eval_shape(model.run_module, params, tokens, tokens, cache)
    except Exception as error:  # the module's own failure, with the protocol beside it
        raise ValueError(f"the module failed on one token (tokens [1, 1] int32, positions "
                         f"[1, 1] int32, a jaxgen cache): {type(error).__name__}: {error}; "
                         f"the protocol: {PROTOCOL}") from error
    logits, new_cache, hidden = unpack_output(out)
    want = (1, 1, model.vocab_size)
    if tuple(getattr(logits, "shape", ())) != want or not jnp.issubdtype(
            getattr(logits, "dtype", jnp.int32), jnp.floating):
        raise ValueError(f"the module's logits are {getattr(logits, 'shape', logits)} "
                         f"{getattr(logits, 'dtype', '')} for tokens [1, 1]; expected float "
                         f"[1, 1, vocab_size={model.vocab_size}]")
    if jax.tree_util.tree_structure(new_cache) != jax.tree_util.tree_structure(cache) or any(
            a.shape != b.shape for a, b in zip(jax.tree_util.tree_leaves(new_cache),
                                               jax.tree_util.tree_leaves(cache))):
        raise ValueError(f"the module returned a {type(new_cache).__name__} as its cache; it "
                         f"must return the jaxgen cache it was given, written by "
                         f"cached_attention (cache.update_attend) in each layer")
    if hidden is not None and (getattr(hidden, "ndim", 0) != 3
                               or tuple(hidden.shape[:2]) != (1, 1)):
        raise ValueError(f"the module's hidden states are {getattr(hidden, 'shape', hidden)}; "
                         f"expected [B, S, D] = [1, 1, D] (or no .hidden)")


__all__ = ["FlaxModel", "FlaxModelConfig", "cached_attention", "check_protocol", "from_flax"]

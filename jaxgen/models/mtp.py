"""A checkpoint's multi-token-prediction (MTP) layers (DeepSeek-V3, GLM-4.5, ...): the math of
one depth, random weights, and the depths' KV cache.

Written for the Llama family and reused by any family whose model offers the same hooks: a
decoder block `model._block(p, index, x, cos, sin, positions, cache)`, its RoPE tables
`model.rope_tables(positions, dtype)` (absent: Llama's full-width RoPE from the config) and
the shapes of one depth's block `model.mtp_block_shapes()` ({key: (1, ...)}; absent: one
layer of `model.init_params`' "layers"), plus config.num_mtp_layers, hidden_size,
num_kv_heads, head_dim, rms_norm_eps, tie_word_embeddings and params' "final_norm".

Depth k (0 <= k < D) at position q, as transformers' `MtpModel` computes it:

    x      = eh_proj([enorm(embed(t_q)) ; hnorm(g_prev)])     embedding first, [2H] -> [H]
    g      = norm(block_k(x))                                 one decoder block of the model's
                                                              own kind, then `shared_head.norm`
    logits = g @ lm_head                                      the target's shared LM head
    g_prev = the target's final-normed hidden state at q - 1 (k = 0), or depth k-1's g at q - 1

so depth k at q predicts t_{q+1}. Weights live in params["mtp"], stacked over the depths
(jaxgen/models/mtp_layout.py). Each depth keeps its own KV cache, indexed by slot = q - k - 1 (the
position of the target hidden state its chain starts from): slot s of every depth holds the
chain that starts at the target's hidden state s, so a depth's first entry is slot 0 (there is
no hidden state before the prompt's first token) and the mask "key slot <= query slot" is HF's
per-depth offset. RoPE uses the true positions q.

Example:
    >>> from jaxgen.models import tiny_llama
    >>> model, params = tiny_llama(num_layers=2)
    >>> model, params = with_mtp(model, params, jax.random.key(1), depths=2)
    >>> tokens = jnp.array([[3, 1, 4, 1, 5, 9]])                       # [B, S]
    >>> hidden = model(params, tokens[:, :4], jnp.arange(4)[None], model.init_cache(1, 8)).hidden
    >>> logits = teacher_forced_logits(model, params, tokens, hidden)  # one per depth
    >>> [tuple(l.shape) for l in logits]                              # depth k: positions 1+k ..
    [(1, 4, 32), (1, 4, 32)]
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxgen.cache import make_cache
from jaxgen.models import rope as rope_lib
from jaxgen.models.mtp_layout import mtp_shapes
from jaxgen.models.norms import rms_norm

__all__ = ["MtpLayers", "block_shapes", "init_mtp_params", "mtp_cache", "mtp_depth",
           "rope_tables", "shared_head", "target_normed", "teacher_forced_logits", "with_mtp"]

Llama = Any  # models.llama.Llama (imports this module: not imported here), or another family


def block_shapes(model: Llama) -> dict:
    """One depth's decoder-block shapes {key: (n, ...)} (the leading axis is replaced by the
    depth count): the model's `mtp_block_shapes()`, else its stacked "layers" shapes."""
    own = getattr(model, "mtp_block_shapes", None)
    if own is not None:
        return own()
    return jax.tree_util.tree_map(
        lambda a: tuple(a.shape), jax.eval_shape(model.init_params, jax.random.key(0))["layers"])


def rope_tables(model: Llama, positions: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """cos, sin for `positions` [B, S] as the model's block expects them: the model's own
    `rope_tables`, else Llama's full-width RoPE from the config."""
    own = getattr(model, "rope_tables", None)
    if own is not None:
        return own(positions, dtype)
    config = model.config
    return rope_lib.cos_sin(positions, config.head_dim, config.rope_theta, config.rope_scaling,
                            config.max_position_embeddings, dtype)  # [B, S, Dh] each


def init_mtp_params(model: Llama, key: jax.Array, dtype=jnp.float32) -> dict:
    """Random params["mtp"] for model.config.num_mtp_layers depths (normal, std 0.02; norms 1)."""
    config = model.config
    if config.num_mtp_layers < 1:
        raise ValueError("init_mtp_params needs a config with num_mtp_layers >= 1")
    shapes = mtp_shapes(config, block_shapes(model))
    flat, tree = jax.tree_util.tree_flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
        shapes, is_leaf=lambda x: isinstance(x, tuple))[0]]
    keys = jax.random.split(key, len(flat))
    leaves = [jnp.ones(shape, dtype) if "norm" in path
              else (0.02 * jax.random.normal(k, shape)).astype(dtype)
              for k, shape, path in zip(keys, flat, paths)]
    return jax.tree_util.tree_unflatten(tree, leaves)


def with_mtp(model: Llama, params: dict, key: jax.Array, depths: int = 1,
             dtype=jnp.float32) -> tuple[Llama, dict]:
    """(model with num_mtp_layers=depths, params with random MTP weights): for tests and
    benchmarks."""
    model = type(model)(dataclasses.replace(model.config, num_mtp_layers=int(depths)))
    return model, {**params, "mtp": init_mtp_params(model, key, dtype)}


def mtp_cache(model: Llama, batch: int, max_len: int, dtype=jnp.float32):
    """The depths' KV caches: a dense cache with one "layer" per depth, max_len slots."""
    config = model.config
    return make_cache("static", num_layers=config.num_mtp_layers, batch=batch, max_len=max_len,
                      num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, dtype=dtype,
                      sliding_window=config.sliding_window)


def target_normed(model: Llama, params: dict, hidden: jax.Array) -> jax.Array:
    """The target's final norm on its pre-norm hidden states [..., H] (what depth 0 reads:
    transformers hands MtpModel the last hidden state after the final norm)."""
    return rms_norm(hidden, params["final_norm"], model.config.rms_norm_eps)


def shared_head(model: Llama, params: dict, normed: jax.Array) -> jax.Array:
    """The target's LM head alone (no final norm): [B, S, H] -> float32 [B, S, V]."""
    if model.config.tie_word_embeddings and "lm_head" not in params:
        return jnp.einsum("bsd,vd->bsv", normed, params["embed"],
                          preferred_element_type=jnp.float32)  # [B, S, V]
    head = params["lm_head"]
    if not isinstance(head, jax.Array):  # a quantized matrix (load(weights="int8"))
        return (normed @ head).astype(jnp.float32)  # [B, S, V]
    return jnp.einsum("bsd,dv->bsv", normed, head, preferred_element_type=jnp.float32)


def mtp_depth(model: Llama, params: dict, depth: int, tokens: jax.Array, previous: jax.Array,
              positions: jax.Array, slots: jax.Array, cache) -> tuple[jax.Array, object]:
    """Depth `depth` (static) over tokens [B, S] at `positions` [B, S] (RoPE), writing and
    reading its cache at `slots` [B, S] (slots outside [0, max_len) are not written).
    previous [B, S, H]: the normed hidden state each position chains from. Returns (g [B, S, H]
    after the depth's norm, cache)."""
    config = model.config
    weights = params["mtp"]
    eps = config.rms_norm_eps
    embedded = rms_norm(model.embed(params, tokens), weights["enorm"][depth], eps)  # [B, S, H]
    chained = rms_norm(previous.astype(embedded.dtype), weights["hnorm"][depth], eps)  # [B, S, H]
    x = jnp.concatenate([embedded, chained], axis=-1) @ weights["eh_proj"][depth]  # [B, S, H]
    cos, sin = rope_tables(model, positions, x.dtype)  # [B, S, Dh] each
    block = {key: value[depth] for key, value in weights["layers"].items()}
    x, cache = model._block(block, jnp.int32(depth), x, cos, sin, slots, cache)  # [B, S, H]
    return rms_norm(x, weights["norm"][depth], eps), cache


def teacher_forced_logits(model: Llama, params: dict, tokens: jax.Array,
                          hidden: jax.Array) -> list[jax.Array]:
    """Every depth's logits on a known sequence (the MtpModel chain, without drafting).

    tokens [B, S] with S >= P + D; hidden [B, P, H]: the target's pre-norm hidden states at
    positions 0 .. P-1. Depth k runs at positions 1+k .. P+k (tokens t_{1+k} .. t_{P+k}) and
    predicts t_{2+k} .. t_{P+k+1}: logits [B, P, V] per depth.
    """
    batch, count = hidden.shape[:2]
    cache = mtp_cache(model, batch, count, hidden.dtype)
    slots = jnp.broadcast_to(jnp.arange(count, dtype=jnp.int32), (batch, count))  # [B, P]
    previous = target_normed(model, params, hidden)  # [B, P, H]
    out = []
    for depth in range(model.config.num_mtp_layers):
        window = tokens[:, 1 + depth:1 + depth + count]  # [B, P]
        previous, cache = mtp_depth(model, params, depth, window, previous,
                                    slots + 1 + depth, slots, cache)  # [B, P, H]
        out.append(shared_head(model, params, previous))  # [B, P, V]
    return out


@dataclasses.dataclass(frozen=True)
class MtpLayers:
    """A target's MTP layers as the MTP drafter sees them (hashable: part of the compiled
    program). `Llama.mtp_layers()` builds it; the functions above do the work.

    depths                                            D = config.num_mtp_layers
    cache(batch, max_len, dtype)                      the depths' KV caches (empty)
    depth(params, k, tokens, previous, positions, slots, cache) -> (g, cache)
    logits(params, g [B, S, H]) -> float32 [B, S, V]  the shared LM head
    normed(params, hidden [B, S, H])                  the target's final norm (depth 0's input)
    """

    model: Any

    @property
    def depths(self) -> int:
        return self.model.config.num_mtp_layers

    def cache(self, batch: int, max_len: int, dtype=jnp.float32):
        return mtp_cache(self.model, batch, max_len, dtype)

    def depth(self, params, depth, tokens, previous, positions, slots, cache):
        return mtp_depth(self.model, params, depth, tokens, previous, positions, slots, cache)

    def logits(self, params, normed):
        return shared_head(self.model, params, normed)

    def normed(self, params, hidden):
        return target_normed(self.model, params, hidden)

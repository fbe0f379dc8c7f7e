"""DeepSeek-V3's multi-token-prediction (MTP) layers: the MtpLayers interface of
jaxgen/models/mtp.py (what `use_mtp=True` drafts with) over MLA blocks with the MoE MLP.

Depth k (0 <= k < Dm = num_nextn_predict_layers) at position q, as transformers' MtpModel
computes it (its block is a full DeepSeek-V3 decoder layer, always with the MoE MLP):

    x      = eh_proj([enorm(embed(t_q)) ; hnorm(g_prev)])
    g      = shared_head.norm(block_k(x))
    logits = g @ lm_head                       the target's own head
    g_prev = the target's final-normed hidden state at q - 1 (k = 0), or depth k-1's g at q - 1

Each depth keeps a latent cache of its own (one "layer" per depth, jaxgen/cache/latent.py)
indexed by slot = q - k - 1, as jaxgen/models/mtp.py describes; RoPE uses the true positions.
Weights: params["mtp"] (jaxgen/models/deepseek_v3.py's layout, stacked over the depths).

Example:
    >>> from jaxgen.models.deepseek_v3 import DeepseekV3, DeepseekV3Config
    >>> from jaxgen.models.moe import MoeConfig
    >>> model = DeepseekV3(DeepseekV3Config(
    ...     vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
    ...     kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4,
    ...     num_mtp_layers=1, moe=MoeConfig(4, 2, 8, 1, 2, 1, True, 2.5)))
    >>> params = model.init_params(jax.random.key(0))
    >>> tokens = jnp.array([[3, 1, 4, 1, 5]])                           # [B, S]
    >>> hidden = model(params, tokens[:, :4], jnp.arange(4)[None], model.init_cache(1, 4)).hidden
    >>> [l.shape for l in teacher_forced_logits(model.mtp_layers(), params, tokens, hidden)]
    [(1, 4, 32)]
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxgen.cache.latent import LatentCache
from jaxgen.models.mla import rope_cos_sin
from jaxgen.models.moe import moe_shapes
from jaxgen.models.mtp import shared_head, target_normed
from jaxgen.models.norms import rms_norm

__all__ = ["DeepseekMtpLayers", "mtp_param_shapes", "teacher_forced_logits"]


def mtp_param_shapes(config, block_shapes: dict) -> dict:
    """params["mtp"]'s shapes, stacked over the Dm depths. block_shapes: one decoder block's
    norms and attention (no layer axis); the MoE keys are added."""
    depths, hidden = config.num_mtp_layers, config.hidden_size
    block = {**block_shapes, **moe_shapes(config.moe, hidden)}
    return {"enorm": (depths, hidden), "hnorm": (depths, hidden),
            "eh_proj": (depths, 2 * hidden, hidden), "norm": (depths, hidden),
            "layers": {key: (depths, *shape) for key, shape in block.items()}}


@dataclasses.dataclass(frozen=True)
class DeepseekMtpLayers:
    """A DeepSeek-V3 target's MTP layers as the MTP drafter sees them (hashable).

    depths                                            Dm = config.num_mtp_layers
    cache(batch, max_len, dtype)                      the depths' latent caches (empty)
    depth(params, k, tokens, previous, positions, slots, cache) -> (g, cache)
    logits(params, g [B, S, D]) -> float32 [B, S, V]  the shared LM head
    normed(params, hidden [B, S, D])                  the target's final norm (depth 0's input)
    """

    model: Any  # the DeepseekV3 target

    @property
    def depths(self) -> int:
        return self.model.config.num_mtp_layers

    def cache(self, batch: int, max_len: int, dtype=jnp.float32) -> LatentCache:
        config = self.model.config
        return LatentCache.init(num_layers=config.num_mtp_layers, batch=batch, max_len=max_len,
                                kv_lora_rank=config.kv_lora_rank,
                                rope_dim=config.qk_rope_head_dim, dtype=dtype)

    def depth(self, params: dict, depth: int, tokens: jax.Array, previous: jax.Array,
              positions: jax.Array, slots: jax.Array, cache) -> tuple[jax.Array, Any]:
        """Depth `depth` (static) over tokens [B, S] at `positions` [B, S] (RoPE), writing and
        reading its cache at `slots` [B, S] (outside [0, max_len): not written). previous
        [B, S, D]: the normed hidden state each position chains from. Returns (g [B, S, D]
        after the depth's norm, cache)."""
        model = self.model
        config = model.config
        weights = params["mtp"]
        eps = config.rms_norm_eps
        embedded = rms_norm(model.embed(params, tokens), weights["enorm"][depth], eps)  # [B,S,D]
        chained = rms_norm(previous.astype(embedded.dtype), weights["hnorm"][depth],
                           eps)  # [B, S, D]
        x = jnp.concatenate([embedded, chained], axis=-1) @ weights["eh_proj"][depth]  # [B,S,D]
        cos, sin = rope_cos_sin(positions, config, x.dtype)  # [B, S, P] each
        block = {key: value[depth] for key, value in weights["layers"].items()}
        x, cache = model.block(block, jnp.int32(depth), x, cos, sin, slots, cache,
                               is_moe=True)  # [B, S, D]
        return rms_norm(x, weights["norm"][depth], eps), cache

    def logits(self, params: dict, normed: jax.Array) -> jax.Array:
        return shared_head(self.model, params, normed)

    def normed(self, params: dict, hidden: jax.Array) -> jax.Array:
        return target_normed(self.model, params, hidden)


def teacher_forced_logits(layers: DeepseekMtpLayers, params: dict, tokens: jax.Array,
                          hidden: jax.Array) -> list[jax.Array]:
    """Every depth's logits on a known sequence (the MtpModel chain, without drafting).

    tokens [B, S] with S >= P + Dm; hidden [B, P, D]: the target's pre-norm hidden states at
    positions 0 .. P-1. Depth k runs at positions 1+k .. P+k: logits [B, P, V] per depth.
    """
    batch, count = hidden.shape[:2]
    cache = layers.cache(batch, count, hidden.dtype)
    slots = jnp.broadcast_to(jnp.arange(count, dtype=jnp.int32), (batch, count))  # [B, P]
    previous = layers.normed(params, hidden)  # [B, P, D]
    out = []
    for depth in range(layers.depths):
        window = tokens[:, 1 + depth:1 + depth + count]  # [B, P]
        previous, cache = layers.depth(params, depth, window, previous, slots + 1 + depth,
                                       slots, cache)  # [B, P, D]
        out.append(layers.logits(params, previous))  # [B, P, V]
    return out

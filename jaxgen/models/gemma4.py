"""Gemma 4's text model (Hugging Face's Gemma4ForCausalLM / the text part of
Gemma4ForConditionalGeneration) under the model contract.

What differs from a Llama: per-layer attention type ("sliding_attention" with a window,
"full_attention"), each with its own head_dim, kv heads and RoPE (default RoPE for sliding
layers, "proportional" RoPE with a partial rotary factor for full ones); RMSNorm on q, k and
(without a weight) v; attention scale 1; norms after attention and after the MLP as well as
before; embeddings scaled by sqrt(hidden_size); a GELU (tanh) MLP, twice as wide on KV-shared
layers with `use_double_wide_mlp`; per-layer input embeddings (PLE: a token table and a
projection of the embeddings, gated into every layer's residual); `attention_k_eq_v` (full
layers take their values from the key projection); KV-shared layers (`num_kv_shared_layers`:
the last layers reuse the K/V of the last earlier layer of their type); a learned per-layer
scalar; `final_logit_softcapping`. Gemma 4's norm is x / rms(x) * w (not Gemma 2/3's 1 + w).
The MoE block (`enable_moe_block`) and bidirectional attention are refused.

Layers run unrolled (their shapes differ); the cache is a `Gemma4Cache` (one inner cache per
layer type: jaxgen/models/gemma4_cache.py).

Params layout (per-layer dicts in a list; D hidden, H heads, Dh / K a layer's head dim and kv
heads, F its MLP width, P the PLE width, V / Vp the vocabularies, L layers):

    embed               [V, D]
    final_norm          [D]
    lm_head             [D, V]        (only when tie_word_embeddings is False)
    ple_embed           [Vp, L*P]     (hidden_size_per_layer_input > 0)
    ple_projection      [D, L*P]
    ple_projection_norm [P]
    layers[i]/
      attn_norm [D]  wq [D, H*Dh]  q_norm [Dh]  wo [H*Dh, D]  post_attn_norm [D]
      wk [D, K*Dh]  k_norm [Dh]  wv [D, K*Dh]   (not on KV-shared layers; no wv with k_eq_v)
      mlp_norm [D]  w_gate [D, F]  w_up [D, F]  w_down [F, D]  post_mlp_norm [D]
      layer_scalar [1]
      ple_gate [D, P]  ple_up [P, D]  ple_norm [D]      (hidden_size_per_layer_input > 0)

Example:
    >>> config = Gemma4Config(vocab_size=32, hidden_size=16, intermediate_size=32,
    ...     num_heads=2, layer_types=("sliding_attention", "full_attention"),
    ...     head_dims=(4, 8), kv_heads=(1, 1), sliding_window=4, hidden_size_per_layer_input=4,
    ...     vocab_size_per_layer_input=32)
    >>> model = Gemma4(config)
    >>> params = model.init_params(jax.random.key(0))
    >>> out = model(params, jnp.zeros((1, 3), jnp.int32), jnp.arange(3)[None],
    ...             model.init_cache(1, 8))
    >>> out.logits.shape, out.hidden.shape, int(out.cache.length[0])
    ((1, 3, 32), (1, 3, 16), 3)
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.cache import make_cache
from jaxgen.cache.sharding import MODEL, check_divides
from jaxgen.models.gemma4_cache import Gemma4Cache

LAYER_TYPES = ("sliding_attention", "full_attention")
ROPE_TYPES = ("default", "proportional")
CACHE_KINDS = ("static", "dynamic")

__all__ = ["CACHE_KINDS", "Gemma4", "Gemma4Config", "Gemma4Output", "LAYER_TYPES",
           "gemma4_norm", "gelu_tanh", "rope_cos_sin", "apply_rope"]


class Gemma4Output(NamedTuple):
    """logits [B, S', V] float32, hidden [B, S, D] (before the final norm), the cache."""

    logits: jax.Array
    hidden: jax.Array
    cache: Any


def gemma4_norm(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    """Gemma 4's RMSNorm: x * (mean(x^2) + eps)^-0.5 in fp32, times weight (fp32; none for
    the weightless v norm), cast back to x's dtype."""
    x32 = x.astype(jnp.float32)  # [..., N]
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if weight is not None:
        normed = normed * weight.astype(jnp.float32)
    return normed.astype(x.dtype)  # [..., N]


def gelu_tanh(x: jax.Array) -> jax.Array:
    """HF's gelu_pytorch_tanh."""
    return jax.nn.gelu(x, approximate=True)


def rope_inv_freq(head_dim: int, rope: tuple) -> np.ndarray:
    """Inverse frequencies [Dh/2] of one layer type's RoPE. rope: (rope_type, theta,
    partial_rotary_factor, factor). "proportional" rotates the first
    int(factor_p * Dh // 2) frequency pairs (exponents over the whole Dh), the rest stay 0."""
    rope_type, theta, fraction, factor = rope
    if rope_type == "default":
        return 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    angles = int(fraction * head_dim // 2)
    rotated = 1.0 / (theta ** (np.arange(0, 2 * angles, 2).astype(np.float32) / head_dim))
    inv = np.concatenate([rotated, np.zeros(head_dim // 2 - angles, np.float32)])
    return (inv / factor).astype(np.float32)


def rope_cos_sin(positions: jax.Array, head_dim: int, rope: tuple, dtype) -> tuple:
    """cos, sin [B, S, Dh] in `dtype` for int32 positions [B, S] (fp32 angles, as HF)."""
    inv = jnp.asarray(rope_inv_freq(head_dim, rope), jnp.float32)  # [Dh/2]
    freqs = positions.astype(jnp.float32)[..., None] * inv  # [B, S, Dh/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # [B, S, Dh]
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, S, N, Dh] with cos, sin [B, S, Dh] (HF's rotate_half convention)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)  # [B, S, N, Dh]
    return x * cos[:, :, None] + rotated * sin[:, :, None]


@dataclasses.dataclass(frozen=True)
class Gemma4Config:
    """Static, hashable description of a Gemma 4 text model (HF's Gemma4TextConfig, with the
    per-layer values resolved: head_dims / kv_heads per layer, rope per layer type)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    layer_types: tuple[str, ...]
    head_dims: tuple[int, ...]  # per layer
    kv_heads: tuple[int, ...]  # per layer
    sliding_window: int = 512
    rms_norm_eps: float = 1e-6
    # layer type -> (rope_type, rope_theta, partial_rotary_factor, factor)
    rope: tuple = (("full_attention", ("proportional", 1e6, 0.25, 1.0)),
                   ("sliding_attention", ("default", 1e4, 1.0, 1.0)))
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = True
    final_logit_softcapping: float | None = None
    hidden_size_per_layer_input: int = 0
    vocab_size_per_layer_input: int = 0
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int = 0
    use_double_wide_mlp: bool = False
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    generation_defaults: tuple = ()

    def __post_init__(self):
        n = len(self.layer_types)
        for name in ("head_dims", "kv_heads"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} must list one value per layer ({n})")
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ValueError(f"layer_types holds {bad}; allowed: {', '.join(LAYER_TYPES)}")
        for kind in set(self.layer_types):
            shapes = {(d, k) for t, d, k in zip(self.layer_types, self.head_dims, self.kv_heads)
                      if t == kind}
            if len(shapes) > 1:
                raise ValueError(f"per_layer_config gives {kind} layers different head_dim / "
                                 f"num_key_value_heads {sorted(shapes)}; allowed: one shape "
                                 f"per layer type")
            if kind not in self.rope_dict:
                raise ValueError(f"rope_parameters has no entry for {kind!r}")
        for heads, dim in zip(self.kv_heads, self.head_dims):
            if self.num_heads % heads or dim % 2:
                raise ValueError(f"num_attention_heads={self.num_heads} must be a multiple of "
                                 f"num_key_value_heads={heads}, and head_dim={dim} even")
        if not 0 <= self.num_kv_shared_layers < n:
            raise ValueError(f"num_kv_shared_layers={self.num_kv_shared_layers}; allowed: an int "
                             f"in [0, num_hidden_layers={n})")
        self.producers  # raises when a shared layer's type has no producer

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def rope_dict(self) -> dict:
        return dict(self.rope)

    @property
    def generation_defaults_dict(self) -> dict:
        return dict(self.generation_defaults)

    @property
    def first_shared(self) -> int:
        return self.num_layers - self.num_kv_shared_layers

    @property
    def producers(self) -> tuple[int, ...]:
        """Per layer: the layer whose cached K/V it attends over (itself, or for a KV-shared
        layer the last earlier non-shared layer of its type: HF's "store" layer)."""
        out = []
        for i, kind in enumerate(self.layer_types):
            if i < self.first_shared:
                out.append(i)
                continue
            earlier = [j for j in range(self.first_shared) if self.layer_types[j] == kind]
            if not earlier:
                raise ValueError(f"num_kv_shared_layers={self.num_kv_shared_layers}: layer {i} "
                                 f"({kind}) has no earlier {kind} layer to share K/V with")
            out.append(earlier[-1])
        return tuple(out)

    def mlp_width(self, layer: int) -> int:
        wide = self.use_double_wide_mlp and layer >= self.first_shared
        return self.intermediate_size * (2 if wide else 1)

    def window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def type_shape(self, kind: str) -> tuple[int, int]:
        """(head_dim, kv heads) of the layers of type `kind`."""
        index = self.layer_types.index(kind)
        return self.head_dims[index], self.kv_heads[index]


@dataclasses.dataclass(frozen=True)
class Gemma4:
    """Gemma 4 text decoder. Hashable; usable as a static jit argument."""

    config: Gemma4Config

    # param name -> dimension from the end on the mesh's "model" axis (jaxgen.models.shard,
    # merged over the Llama rules: wq / wk / wv / w_gate / w_up on -1, wo / w_down on -2):
    # the per-layer-input gate column parallel and its up-projection row parallel, the PLE
    # table [Vp, L*P] and projection [D, L*P] by column (each array stays whole where the
    # model axis does not divide its dimension).
    sharding_rules: ClassVar[dict] = {"ple_gate": -1, "ple_up": -2, "ple_embed": -1,
                                      "ple_projection": -1}

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def check_mesh_fits(self, mesh) -> None:
        """ValueError naming the config.json size the mesh's "model" axis does not divide:
        the heads, each layer type's KV heads (the cache splits them) and the MLP width."""
        cfg = self.config
        hint = "choose a model axis that divides it (the data axis may take the other devices)"
        check_divides("num_attention_heads", cfg.num_heads, mesh, MODEL, hint)
        for kind in LAYER_TYPES:
            if kind in cfg.layer_types[:cfg.first_shared]:
                _, heads = cfg.type_shape(kind)
                field = ("num_key_value_heads" if kind == "sliding_attention" else
                         "num_key_value_heads of the full_attention layers "
                         "(num_global_key_value_heads / per_layer_config)")
                check_divides(field, heads, mesh, MODEL, hint)
        check_divides("intermediate_size", cfg.intermediate_size, mesh, MODEL, hint)

    def _groups(self) -> tuple[list[str], tuple]:
        """(group kinds, per-layer (group, slot) for the layers that own a cache slot)."""
        cfg = self.config
        kinds = [k for k in LAYER_TYPES if k in cfg.layer_types[:cfg.first_shared]]
        counts = {k: 0 for k in kinds}
        slots = []
        for i in range(cfg.num_layers):
            kind = cfg.layer_types[i]
            if i < cfg.first_shared:
                slots.append((kinds.index(kind), counts[kind]))
                counts[kind] += 1
            else:
                slots.append(slots[cfg.producers[i]])
        return kinds, tuple(slots)

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32, kind: str = "static",
                   cache_config: dict | None = None) -> Gemma4Cache:
        """One inner cache per layer type (its own head_dim / kv heads) for `max_len`
        positions. kind: "static" or "dynamic" (dense caches; sliding layers mask by window)."""
        if kind not in CACHE_KINDS:
            raise ValueError(f"cache_implementation={kind!r} is not supported by Gemma 4 in "
                             f"jaxgen; allowed: {', '.join(CACHE_KINDS)}")
        cfg = self.config
        kinds, slots = self._groups()
        groups = []
        for layer_kind in kinds:
            head_dim, heads = cfg.type_shape(layer_kind)
            count = sum(1 for i in range(cfg.first_shared) if cfg.layer_types[i] == layer_kind)
            groups.append(make_cache(kind, num_layers=count, batch=batch, max_len=max_len,
                                     num_kv_heads=heads, head_dim=head_dim, dtype=dtype,
                                     cache_config=cache_config))
        return Gemma4Cache(groups=tuple(groups), slots=slots)

    def param_shapes(self) -> dict:
        """The expected shape of every parameter (per-layer list)."""
        cfg = self.config
        D, H, V = cfg.hidden_size, cfg.num_heads, cfg.vocab_size
        P, L = cfg.hidden_size_per_layer_input, cfg.num_layers
        layers = []
        for i in range(L):
            dh, kh, F = cfg.head_dims[i], cfg.kv_heads[i], cfg.mlp_width(i)
            layer = {"attn_norm": (D,), "wq": (D, H * dh), "q_norm": (dh,), "wo": (H * dh, D),
                     "post_attn_norm": (D,), "mlp_norm": (D,), "w_gate": (D, F),
                     "w_up": (D, F), "w_down": (F, D), "post_mlp_norm": (D,),
                     "layer_scalar": (1,)}
            if i < cfg.first_shared:
                layer.update(wk=(D, kh * dh), k_norm=(dh,))
                if not self._k_eq_v(i):
                    layer["wv"] = (D, kh * dh)
            if P:
                layer.update(ple_gate=(D, P), ple_up=(P, D), ple_norm=(D,))
            layers.append(layer)
        shapes = {"embed": (V, D), "final_norm": (D,), "layers": layers}
        if not cfg.tie_word_embeddings:
            shapes["lm_head"] = (D, V)
        if P:
            shapes.update(ple_embed=(cfg.vocab_size_per_layer_input, L * P),
                          ple_projection=(D, L * P), ple_projection_norm=(P,))
        return shapes

    def _k_eq_v(self, layer: int) -> bool:
        return self.config.attention_k_eq_v and self.config.layer_types[layer] == "full_attention"

    def init_params(self, key: jax.Array, dtype=jnp.float32) -> dict:
        """Random parameters (normal, std 0.02; norms and scalars at 1)."""
        shapes = self.param_shapes()
        leaves, treedef = jax.tree_util.tree_flatten(shapes, is_leaf=lambda s: isinstance(s, tuple))
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
            shapes, is_leaf=lambda s: isinstance(s, tuple))[0]]
        keys = jax.random.split(key, len(leaves))
        values = []
        for k, shape, path in zip(keys, leaves, paths):
            ones = "norm" in path or "scalar" in path
            values.append(jnp.ones(shape, dtype) if ones
                          else (0.02 * jax.random.normal(k, shape)).astype(dtype))
        return jax.tree_util.tree_unflatten(treedef, values)

    def check_params(self, params: Any) -> None:
        """ValueError naming the first parameter missing, unexpected or of the wrong shape."""
        expected = self.param_shapes()
        optional = {"lm_head": (self.config.hidden_size, self.vocab_size)}
        if not isinstance(params, Mapping):
            raise ValueError(f"params is a {type(params).__name__}, expected a dict")
        _check_tree(params, expected, optional, "params")

    def __call__(self, params: dict, tokens: jax.Array, positions: jax.Array, cache, *,
                 logits_index: jax.Array | None = None) -> Gemma4Output:
        """One forward over S new tokens per row (int32 tokens, positions [B, S]), writing
        their K/V at `positions`. Returns Gemma4Output(logits [B, S', V] f32, hidden [B, S, D]
        before the final norm, cache with length positions[:, -1] + 1)."""
        x = self.embed(params, tokens)  # [B, S, D]
        per_layer = self.per_layer_inputs(params, tokens, x)  # [B, S, L, P] or None
        x, cache = self.run_all_layers(params, x, per_layer, positions, cache)  # [B, S, D]
        hidden = x
        if logits_index is not None:
            x = jnp.take_along_axis(x, logits_index[:, :, None].astype(jnp.int32), axis=1)
        logits = self.head(params, x)  # [B, S', V]
        return Gemma4Output(logits=logits, hidden=hidden,
                            cache=cache.with_length(positions[:, -1] + 1))

    def embed(self, params: dict, tokens: jax.Array) -> jax.Array:
        """Scaled input embeddings: tokens [B, S] -> [B, S, D] (times sqrt(D) in the
        embedding's dtype, as HF)."""
        table = params["embed"]
        scale = jnp.asarray(self.config.hidden_size ** 0.5, table.dtype)
        return jnp.take(table, tokens, axis=0) * scale  # [B, S, D]

    def per_layer_inputs(self, params: dict, tokens: jax.Array, x: jax.Array):
        """PLE: (norm(x @ ple_projection / sqrt(D)) + ple_embed[tokens] * sqrt(P)) / sqrt(2),
        [B, S, L, P]; None when the model has no per-layer inputs."""
        cfg = self.config
        P = cfg.hidden_size_per_layer_input
        if not P:
            return None
        batch, seq = tokens.shape
        table = params["ple_embed"]
        ids = jnp.take(table, tokens, axis=0) * jnp.asarray(P ** 0.5, table.dtype)
        ids = ids.reshape(batch, seq, cfg.num_layers, P)  # [B, S, L, P]
        projected = (x @ params["ple_projection"]) * jnp.asarray(cfg.hidden_size ** -0.5,
                                                                 x.dtype)  # [B, S, L*P]
        projected = gemma4_norm(projected.reshape(batch, seq, cfg.num_layers, P),
                                params["ple_projection_norm"], cfg.rms_norm_eps)
        return (projected + ids) * jnp.asarray(2.0 ** -0.5, x.dtype)  # [B, S, L, P]

    def run_all_layers(self, params, x, per_layer, positions, cache):
        """Every decoder layer (unrolled) over x [B, S, D]; returns (x, cache)."""
        cfg = self.config
        rope = {}
        for kind in set(cfg.layer_types):
            head_dim, _ = cfg.type_shape(kind)
            rope[kind] = rope_cos_sin(positions, head_dim, cfg.rope_dict[kind], x.dtype)
        for i, layer in enumerate(params["layers"]):
            ple = None if per_layer is None else per_layer[:, :, i]  # [B, S, P]
            x, cache = self.block(layer, i, x, ple, rope[cfg.layer_types[i]], positions, cache)
        return x, cache

    def head(self, params: dict, hidden: jax.Array) -> jax.Array:
        """Final norm, LM head and soft-capping: hidden [B, S, D] -> logits [B, S, V] f32."""
        cfg = self.config
        normed = gemma4_norm(hidden, params["final_norm"], cfg.rms_norm_eps)  # [B, S, D]
        head = params.get("lm_head")
        if head is None:
            logits = jnp.einsum("bsd,vd->bsv", normed, params["embed"],
                                preferred_element_type=jnp.float32)  # [B, S, V]
        else:
            logits = jnp.einsum("bsd,dv->bsv", normed, head,
                                preferred_element_type=jnp.float32)  # [B, S, V]
        cap = cfg.final_logit_softcapping
        if cap is not None:
            logits = jnp.tanh(logits / cap) * cap
        return logits

    def block(self, p: dict, index: int, x, ple, cos_sin, positions, cache):
        """One decoder layer: attention, MLP and the PLE gate, each normed before and after,
        residual; then the layer scalar."""
        cfg = self.config
        eps = cfg.rms_norm_eps
        batch, seq, _ = x.shape
        dh, kh = cfg.head_dims[index], cfg.kv_heads[index]
        cos, sin = cos_sin
        h = gemma4_norm(x, p["attn_norm"], eps)  # [B, S, D]
        q = (h @ p["wq"]).reshape(batch, seq, cfg.num_heads, dh)  # [B, S, H, Dh]
        q = apply_rope(gemma4_norm(q, p["q_norm"], eps), cos, sin)  # [B, S, H, Dh]
        window = cfg.window(index)
        if index >= cfg.first_shared:  # KV-shared: the producer's cached K/V
            attn = cache.attend(cfg.producers[index], q, positions, scale=1.0, window=window)
        else:
            k_raw = (h @ p["wk"]).reshape(batch, seq, kh, dh)  # [B, S, K, Dh]
            v = k_raw if "wv" not in p else (h @ p["wv"]).reshape(batch, seq, kh, dh)
            k = apply_rope(gemma4_norm(k_raw, p["k_norm"], eps), cos, sin)  # [B, S, K, Dh]
            v = gemma4_norm(v, None, eps)  # [B, S, K, Dh]
            attn, cache = cache.update_attend(index, q, k, v, positions, scale=1.0,
                                              window=window)  # [B, S, H, Dh]
        out = attn.reshape(batch, seq, cfg.num_heads * dh) @ p["wo"]  # [B, S, D]
        x = x + gemma4_norm(out, p["post_attn_norm"], eps)  # [B, S, D]
        h = gemma4_norm(x, p["mlp_norm"], eps)  # [B, S, D]
        mlp = (gelu_tanh(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]  # [B, S, D]
        x = x + gemma4_norm(mlp, p["post_mlp_norm"], eps)  # [B, S, D]
        if ple is not None:
            gate = gelu_tanh(x @ p["ple_gate"]) * ple  # [B, S, P]
            x = x + gemma4_norm(gate @ p["ple_up"], p["ple_norm"], eps)  # [B, S, D]
        return x * p["layer_scalar"].astype(x.dtype), cache  # [B, S, D]


def _check_tree(tree: Any, expected: Any, optional: dict, path: str) -> None:
    """ValueError for the first missing / unexpected key or wrong shape under `path`."""
    if isinstance(expected, list):
        if not isinstance(tree, (list, tuple)) or len(tree) != len(expected):
            raise ValueError(f"{path} must be a list of {len(expected)} per-layer dicts")
        for i, (sub, shapes) in enumerate(zip(tree, expected)):
            _check_tree(sub, shapes, {}, f"{path}[{i}]")
        return
    if isinstance(expected, dict):
        if not isinstance(tree, Mapping):
            raise ValueError(f"{path} is a {type(tree).__name__}, expected a dict")
        for key in expected:
            if key not in tree:
                raise ValueError(f"{path} has no key {key!r} for this model")
        for key in tree:
            if key not in expected and key not in optional:
                raise ValueError(f"{path} has an unexpected key {key!r}; this model uses "
                                 f"{', '.join(sorted((*expected, *optional)))}")
        for key, value in tree.items():
            _check_tree(value, expected.get(key, optional.get(key)), {}, f"{path}[{key!r}]")
        return
    shape = getattr(tree, "shape", None)
    if shape is None or tuple(shape) != tuple(expected):
        raise ValueError(f"{path} has shape {None if shape is None else tuple(shape)}, "
                         f"expected {tuple(expected)} for this model")

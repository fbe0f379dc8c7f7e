"""The Gemma 2 and Gemma 3 (text) family under the model and LayeredModel contracts.

What differs from the Llama family (jaxgen/models/llama.py), as transformers computes it:

- the input embeddings are scaled by sqrt(hidden_size), cast to the params' dtype;
- Gemma's RMSNorm, x * (1 + w) computed in fp32, four per layer: before and after the
  attention, before and after the MLP (the "post" norms are applied to the branch before
  the residual add);
- the MLP is GeGLU: act(x @ w_gate) * (x @ w_up) @ w_down with `hidden_activation`
  (gelu_pytorch_tanh: the tanh approximation);
- the attention scale is query_pre_attn_scalar ** -0.5; Gemma 2 soft-caps the attention
  scores (attn_logit_softcapping: c * tanh(s / c), in the cache's attention kernel) and both
  soft-cap the final logits (final_logit_softcapping); transformers' Gemma 3 attention does
  not read attn_logit_softcapping, so a gemma3_text config.json's value is not applied either;
- layers alternate local (sliding window) and global attention (`layer_types`); Gemma 3
  adds a q / k RMSNorm over head_dim and its own RoPE per layer type (local layers
  rope_local_base_freq, global layers rope_theta with their rope scaling, e.g. linear 8);
- the head is tied to the embeddings.

Layers of different windows run under one `lax.scan` with each layer's window a traced
int32 (global layers: GLOBAL_WINDOW, larger than any position), so the dense, quantized and
offloaded caches serve every layer; the ring-buffer "sliding_window" cache (one window for
every layer) is refused for a model that mixes local and global layers.

Params layout (L layers, D hidden, H heads, K kv heads, Dh head dim, F mlp, V vocab):

    embed          [V, D]
    layers/
      attn_norm      [L, D]        input_layernorm
      wq [L, D, H*Dh]  wk [L, D, K*Dh]  wv [L, D, K*Dh]  wo [L, H*Dh, D]
      q_norm, k_norm [L, Dh]       (Gemma 3)
      post_attn_norm [L, D]        post_attention_layernorm
      mlp_norm       [L, D]        pre_feedforward_layernorm
      w_gate [L, D, F]  w_up [L, D, F]  w_down [L, F, D]
      post_mlp_norm  [L, D]        post_feedforward_layernorm
    final_norm     [D]
    lm_head        [D, V]          (optional: a quantized copy of the tied head)

Example:
    >>> cfg = GemmaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2,
    ...                   num_heads=2, num_kv_heads=1, head_dim=8, sliding_window=4,
    ...                   layer_types=("sliding_attention", "full_attention"),
    ...                   attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    >>> model = Gemma(cfg)
    >>> params = model.init_params(jax.random.key(0))
    >>> out = model(params, jnp.zeros((1, 6), jnp.int32), jnp.arange(6)[None],
    ...             model.init_cache(1, 8))
    >>> out.logits.shape, int(out.cache.length[0]), bool(jnp.abs(out.logits).max() < 30)
    ((1, 6, 32), 6, True)
    >>> model.init_cache(1, 8, kind="sliding_window")
    Traceback (most recent call last):
    ...
    ValueError: cache_implementation='sliding_window' keeps one window for every layer, but this model mixes sliding-window and global layers (layer_types); allowed: static, dynamic, quantized, offloaded
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.cache import CACHE_KINDS, Cache, make_cache
from jaxgen.cache.layer_forms import computed_once, holds_layer_tuples
from jaxgen.models import rope as rope_lib
from jaxgen.models.config_checks import (
    FLOAT32_MAX,
    FLOAT_LIMITS,
    INT_LIMITS,
    check_float,
    check_int,
    check_llama_numbers,
    generation_fields,
    refuse_quantization,
    special_token_ids,
)
from jaxgen.models.llama import ModelOutput, apply_rope, freeze

__all__ = ["Gemma", "GemmaConfig", "GEMMA_ARCHITECTURES", "gemma_rms_norm"]

GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
LAYER_TYPES = ("sliding_attention", "full_attention")
ACTIVATIONS = {"gelu_pytorch_tanh": True, "gelu_tanh": True, "gelu_new": True,
               "gelu_fast": True, "gelu": False}  # name -> jax.nn.gelu(approximate=...)
GLOBAL_WINDOW = 2 ** 30  # a global layer's traced window: larger than any age


def gemma_rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Gemma's RMSNorm: normalize and scale by (1 + weight) in fp32, then cast to x's dtype.

    >>> gemma_rms_norm(jnp.array([[3.0, 4.0]]), jnp.array([0.0, 1.0]), 0.0) * 50 ** 0.5 / 2
    Array([[3., 8.]], dtype=float32)
    """
    x32 = x.astype(jnp.float32)  # [..., D]
    variance = jnp.mean(x32 * x32, axis=-1, keepdims=True)  # [..., 1]
    normed = x32 * jax.lax.rsqrt(variance + eps)  # [..., D]
    return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)  # [..., D]


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(x / cap) (None: x)."""
    return x if cap is None else cap * jnp.tanh(x / cap)


@dataclasses.dataclass(frozen=True)
class GemmaConfig:
    """Static, hashable description of a Gemma 2 / Gemma 3 text model (HF field meanings).

    layer_types: one of LAYER_TYPES per layer ("sliding_attention": keys p - W < j <= p with
    W = sliding_window). rope_theta / rope_scaling: the global layers' RoPE;
    rope_local_theta / rope_local_scaling: the sliding layers' (Gemma 2: the same).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    query_pre_attn_scalar: float = 256.0
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    qk_norm: bool = False
    hidden_activation: str = "gelu_pytorch_tanh"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple | None = None
    rope_local_theta: float = 10000.0
    rope_local_scaling: tuple | None = None
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    generation_defaults: tuple[tuple[str, Any], ...] = ()
    architecture: str = "Gemma2ForCausalLM"
    num_mtp_layers: int = 0  # no MTP layers (the MTP drafter asks)

    def __post_init__(self):
        check_llama_numbers({f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                             if f.name in INT_LIMITS or f.name in FLOAT_LIMITS
                             or f.name.endswith("token_id")})
        types = tuple(self.layer_types) or ("full_attention",) * self.num_layers
        if len(types) != self.num_layers or any(t not in LAYER_TYPES for t in types):
            raise ValueError(f"layer_types={list(types)} must list num_hidden_layers="
                             f"{self.num_layers} entries, each one of {', '.join(LAYER_TYPES)}")
        object.__setattr__(self, "layer_types", types)
        if "sliding_attention" in types and self.sliding_window is None:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is "
                             "null; allowed: an int >= 1")
        if not self.tie_word_embeddings:
            raise ValueError("tie_word_embeddings=False: Gemma ties its head to the embeddings;"
                             " allowed: true")
        if self.hidden_activation not in ACTIVATIONS:
            raise ValueError(f"hidden_activation={self.hidden_activation!r}; allowed: "
                             f"{', '.join(ACTIVATIONS)}")
        check_float("query_pre_attn_scalar", self.query_pre_attn_scalar, 0.0, FLOAT32_MAX)
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(self, name) is not None:
                check_float(name, getattr(self, name), 0.0, FLOAT32_MAX)
        check_float("rope_local_base_freq", self.rope_local_theta, 0.0, FLOAT32_MAX)
        for scaling in (self.rope_scaling, self.rope_local_scaling):
            if scaling is not None:
                rope_lib.validate(dict(scaling))
                if dict(scaling).get("rope_type") == "dynamic" and self.head_dim <= 2:
                    raise ValueError(f"head_dim={self.head_dim} with rope_type 'dynamic'; "
                                     f"allowed: head_dim > 2")
        if self.num_mtp_layers:
            raise ValueError("num_mtp_layers: Gemma checkpoints carry no MTP layers; allowed: 0")

    @property
    def local_layers(self) -> tuple[bool, ...]:
        """Per layer: True for a sliding-window layer."""
        return tuple(t == "sliding_attention" for t in self.layer_types)

    @property
    def mixed_windows(self) -> bool:
        """Whether some layers slide and others attend globally."""
        return len(set(self.layer_types)) > 1

    def layer_window(self, index: int) -> int | None:
        """Layer `index`'s sliding window (None: global attention)."""
        return self.sliding_window if self.local_layers[index] else None

    @property
    def generation_defaults_dict(self) -> dict:
        return dict(self.generation_defaults)

    @classmethod
    def from_hf_dict(cls, config: dict, generation_config: dict | None = None,
                     where: str = "") -> "GemmaConfig":
        """From a parsed HF config.json of model_type "gemma2" or "gemma3_text" (and the
        optional generation_config.json). ValueError naming the config.json field and the
        allowed values for anything malformed or not implemented."""
        prefix = f"{where}: " if where else ""
        model_type = config.get("model_type")
        arch = {"gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}.get(model_type)
        if arch is None:
            raise ValueError(f"{prefix}model_type={model_type!r}; allowed: 'gemma2', "
                             f"'gemma3_text'")
        refuse_quantization(config, where)
        if config.get("use_bidirectional_attention"):
            raise ValueError(f"{prefix}use_bidirectional_attention=true is not supported; "
                             f"allowed: false (causal decoding)")
        for key in ("attention_bias", "mlp_bias"):
            if config.get(key):
                raise ValueError(f"{prefix}{key}=true is not supported; allowed: false")
        if config.get("tie_word_embeddings", True) is not True:
            raise ValueError(f"{prefix}tie_word_embeddings={config['tie_word_embeddings']!r}; "
                             f"allowed: true")
        numbers = {}
        names = {"vocab_size": "vocab_size", "hidden_size": "hidden_size",
                 "intermediate_size": "intermediate_size", "num_layers": "num_hidden_layers",
                 "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads",
                 "head_dim": "head_dim", "max_position_embeddings": "max_position_embeddings"}
        for field, key in names.items():
            value = config.get(key)
            if value is None:
                if field in ("num_kv_heads", "head_dim", "max_position_embeddings"):
                    continue
                low, high = INT_LIMITS[field]
                raise ValueError(f"{prefix}config.json has no {key!r}; allowed: an int in "
                                 f"[{low}, {high}]")
            numbers[field] = check_int(key, value, *INT_LIMITS[field], where)
        numbers.setdefault("num_kv_heads", numbers["num_heads"])
        if "head_dim" not in numbers:
            if numbers["hidden_size"] % numbers["num_heads"]:
                raise ValueError(f"{prefix}hidden_size is not a multiple of num_attention_heads "
                                 f"and there is no head_dim; allowed: an explicit head_dim")
            numbers["head_dim"] = numbers["hidden_size"] // numbers["num_heads"]
        layers = numbers["num_layers"]
        activation = config.get("hidden_activation") or config.get("hidden_act") \
            or "gelu_pytorch_tanh"
        if activation not in ACTIVATIONS:
            raise ValueError(f"{prefix}hidden_activation={activation!r}; allowed: "
                             f"{', '.join(ACTIVATIONS)}")
        floats = {"rms_norm_eps": config.get("rms_norm_eps", 1e-6),
                  "query_pre_attn_scalar": config.get("query_pre_attn_scalar", 256)}
        for key, value in floats.items():
            floats[key] = check_float(key, value, 0.0, FLOAT32_MAX, where)
        caps = {}
        defaults = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0} \
            if model_type == "gemma2" else {}
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            value = config.get(key, defaults.get(key))
            caps[key] = None if value is None else check_float(key, value, 0.0, FLOAT32_MAX,
                                                                 where)
        if model_type == "gemma3_text":  # transformers' Gemma 3 attention never applies it
            caps["attn_logit_softcapping"] = None
        types = _layer_types(config, model_type, layers, where)
        window = config.get("sliding_window", 4096)
        window = None if window is None else check_int("sliding_window", window,
                                                       *INT_LIMITS["sliding_window"], where)
        rope = _rope(config, model_type, where)
        gen = generation_fields(generation_config)
        if gen.get("cache_implementation") == "hybrid":  # HF's per-layer-window cache: the
            gen.pop("cache_implementation")  # static cache computes the same (module docs)
        ids, id_names = special_token_ids(config, gen)
        check_llama_numbers({**numbers, "sliding_window": window, **ids},
                            {**names, "sliding_window": "sliding_window", **id_names}, where)
        try:
            return cls(**numbers, layer_types=types, sliding_window=window,
                       qk_norm=model_type == "gemma3_text", hidden_activation=activation,
                       **floats, **caps, **rope, **ids, generation_defaults=freeze(gen),
                       architecture=arch)
        except ValueError as error:
            raise ValueError(f"{prefix}{error}") from None


def _layer_types(config: dict, model_type: str, layers: int, where: str) -> tuple[str, ...]:
    """config.json's layer_types, else the family's pattern: Gemma 2 slides on even layers,
    Gemma 3 on all but every sliding_window_pattern-th (default 6)."""
    prefix = f"{where}: " if where else ""
    types = config.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != layers \
                or any(t not in LAYER_TYPES for t in types):
            raise ValueError(f"{prefix}layer_types={types!r}; allowed: a list of "
                             f"num_hidden_layers={layers} entries from {', '.join(LAYER_TYPES)}")
        return tuple(types)
    period = 2 if model_type == "gemma2" else check_int(
        "sliding_window_pattern", config.get("sliding_window_pattern", 6), 1,
        INT_LIMITS["num_layers"][1], where)
    return tuple("sliding_attention" if (i + 1) % period else "full_attention"
                 for i in range(layers))


def _rope(config: dict, model_type: str, where: str) -> dict:
    """The global and local layers' RoPE (theta, frozen scaling) from rope_parameters (per
    layer type in Gemma 3's transformers 5 form, one dict in Gemma 2's) or the older
    rope_theta / rope_scaling / rope_local_base_freq keys."""
    prefix = f"{where}: " if where else ""
    params = config.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"{prefix}rope_parameters={params!r}; allowed: an object or null")
    params = dict(params or {})
    per_type = any(t in params for t in LAYER_TYPES)
    legacy = config.get("rope_scaling")
    if legacy is not None and not isinstance(legacy, dict):
        raise ValueError(f"{prefix}rope_scaling={legacy!r}; allowed: an object or null")
    if per_type:
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
    else:
        full, local = dict(params), {}
        if model_type == "gemma2":
            local = dict(params)
    if legacy:
        full.update(legacy)
    global_default = 1_000_000.0 if model_type == "gemma3_text" else 10000.0
    full_theta = full.pop("rope_theta", config.get("rope_theta", global_default))
    local_default = config.get("rope_local_base_freq", 10000.0) if model_type == "gemma3_text" \
        else full_theta
    local_theta = local.pop("rope_theta", local_default)
    out = {}
    for key, theta, scaling, name in (("rope_theta", full_theta, full, "rope_theta"),
                                      ("rope_local_theta", local_theta, local,
                                       "rope_local_base_freq")):
        out[key] = check_float(name, theta, *FLOAT_LIMITS["rope_theta"], where)
        try:
            out[key.replace("theta", "scaling")] = rope_lib.normalize(scaling)
        except ValueError as error:
            raise ValueError(f"{prefix}{error}") from None
    return out


@dataclasses.dataclass(frozen=True)
class Gemma:
    """Gemma 2 / Gemma 3 text decoder. Hashable; usable as a static jit argument."""

    config: GemmaConfig
    weight_formats = ("float", "int8")  # what load(..., weights=) may give this family

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32,
                   kind: str = "static", cache_config: dict | None = None) -> Cache:
        """An empty cache of `kind` (HF's cache_implementation names). "sliding_window" (one
        ring of the window for every layer) only when every layer slides."""
        if kind not in CACHE_KINDS:
            raise ValueError(f"unknown cache kind {kind!r}; allowed: {', '.join(CACHE_KINDS)}")
        cfg = self.config
        if kind == "sliding_window" and set(cfg.layer_types) != {"sliding_attention"}:
            allowed = ", ".join(k for k in CACHE_KINDS if k != "sliding_window")
            what = ("mixes sliding-window and global layers" if cfg.mixed_windows
                    else "has global layers only")
            raise ValueError(f"cache_implementation='sliding_window' keeps one window for "
                             f"every layer, but this model {what} (layer_types); allowed: "
                             f"{allowed}")
        return make_cache(kind, num_layers=cfg.num_layers, batch=batch, max_len=max_len,
                          num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=dtype,
                          sliding_window=cfg.sliding_window, cache_config=cache_config)

    def init_params(self, key: jax.Array, dtype=jnp.float32) -> dict:
        """Random parameters (normal, std 0.02; norm weights 0, i.e. a scale of 1)."""
        cfg = self.config
        L, D, F, V = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
        qd, kd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        shapes = {"wq": (L, D, qd), "wk": (L, D, kd), "wv": (L, D, kd), "wo": (L, qd, D),
                  "w_gate": (L, D, F), "w_up": (L, D, F), "w_down": (L, F, D)}
        keys = jax.random.split(key, len(shapes) + 1)
        layers = {name: (0.02 * jax.random.normal(k, shape)).astype(dtype)
                  for k, (name, shape) in zip(keys[1:], sorted(shapes.items()))}
        for name in ("attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm"):
            layers[name] = jnp.zeros((L, D), dtype)
        if cfg.qk_norm:
            layers["q_norm"] = jnp.zeros((L, cfg.head_dim), dtype)
            layers["k_norm"] = jnp.zeros((L, cfg.head_dim), dtype)
        return {"embed": (0.02 * jax.random.normal(keys[0], (V, D))).astype(dtype),
                "layers": layers, "final_norm": jnp.zeros((D,), dtype)}

    def check_params(self, params: Any) -> None:
        """ValueError naming the first parameter that does not fit this model (stacked or
        per-layer `layers`; an optional `lm_head` [D, V], the quantized tied head)."""
        expected = gemma_param_shapes(self.config)
        if not isinstance(params, Mapping):
            raise ValueError(f"params is a {type(params).__name__}, expected a dict with keys "
                             f"{sorted(expected)}")
        optional = {"lm_head": (self.config.hidden_size, self.config.vocab_size)}
        _check_keys(params, expected, optional, "params")
        for key, shape in {**expected, **optional}.items():
            if key != "layers" and key in params:
                _check_shape(params[key], shape, f"params[{key!r}]")
        layers, per_layer = params["layers"], expected["layers"]
        if isinstance(layers, Mapping):
            _check_keys(layers, per_layer, {}, "params['layers']")
            for key, shape in per_layer.items():
                _check_shape(layers[key], shape, f"params['layers'][{key!r}]")
            return
        if not isinstance(layers, (list, tuple)) or len(layers) != self.config.num_layers:
            raise ValueError(f"params['layers'] must be a dict of stacked [L, ...] arrays or a "
                             f"list of {self.config.num_layers} per-layer dicts")
        for index, layer in enumerate(layers):
            where = f"params['layers'][{index}]"
            if not isinstance(layer, Mapping):
                raise ValueError(f"{where} is a {type(layer).__name__}, expected a dict")
            _check_keys(layer, per_layer, {}, where)
            for key, shape in per_layer.items():
                _check_shape(layer[key], shape[1:], f"{where}[{key!r}]")

    def mtp_layers(self):
        """None: Gemma checkpoints carry no MTP layers."""
        return None

    def __call__(self, params: dict, tokens: jax.Array, positions: jax.Array, cache: Cache, *,
                 exit_layer: int | None = None,
                 logits_index: jax.Array | None = None) -> ModelOutput:
        """One forward over S new tokens per row (tokens, positions int32 [B, S]), writing
        their K/V at `positions`. Returns ModelOutput(logits [B, S', V] f32, hidden [B, S, D]
        (before the final norm), cache with length positions[:, -1] + 1)."""
        cfg = self.config
        num_layers = cfg.num_layers if exit_layer is None else int(exit_layer)
        if not 1 <= num_layers <= cfg.num_layers:
            raise ValueError(f"exit_layer={exit_layer} must be in [1, {cfg.num_layers}]")
        x = self.embed(params, tokens)  # [B, S, D]
        x, cache = self.run_layers(params, x, positions, cache, 0, num_layers)  # [B, S, D]
        hidden = x  # [B, S, D]
        if logits_index is not None:
            x = jnp.take_along_axis(x, logits_index[:, :, None].astype(jnp.int32),
                                    axis=1)  # [B, S', D]
        logits = self.head(params, x)  # [B, S', V]
        return ModelOutput(logits=logits, hidden=hidden,
                           cache=cache.with_length(positions[:, -1] + 1))

    def embed(self, params: dict, tokens: jax.Array) -> jax.Array:
        """tokens int32 [B, S] -> embeddings times sqrt(hidden_size) (in their dtype) [B, S, D]."""
        table = params["embed"]
        scale = jnp.asarray(math.sqrt(self.config.hidden_size), table.dtype)
        return jnp.take(table, tokens, axis=0) * scale  # [B, S, D]

    def head(self, params: dict, hidden: jax.Array) -> jax.Array:
        """Final norm, tied head (or params["lm_head"], a [D, V] array or weight object),
        final logit soft-capping: hidden [B, S, D] -> logits [B, S, V] float32."""
        normed = gemma_rms_norm(hidden, params["final_norm"], self.config.rms_norm_eps)
        head = params.get("lm_head")
        if head is None:
            logits = jnp.einsum("bsd,vd->bsv", normed, params["embed"],
                                preferred_element_type=jnp.float32)  # [B, S, V]
        elif isinstance(head, jax.Array):
            logits = jnp.einsum("bsd,dv->bsv", normed, head,
                                preferred_element_type=jnp.float32)  # [B, S, V]
        else:
            logits = (normed @ head).astype(jnp.float32)  # [B, S, V]
        return softcap(logits, self.config.final_logit_softcapping)  # [B, S, V]

    def exit_head(self, params: dict, hidden: jax.Array, layer: int) -> jax.Array:
        """Early-exit logits from layer `layer`'s hidden [B, S, D]: the shared final norm and
        head (Gemma checkpoints have no exit adapters). [B, S, V] float32."""
        return self.head(params, hidden)

    def run_layers(self, params: dict, x: jax.Array, positions: jax.Array, cache: Cache,
                   start: int, stop: int) -> tuple[jax.Array, Cache]:
        """Decoder layers [start, stop) (static) over x [B, S, D] at positions [B, S],
        writing their K/V into `cache` (length unchanged)."""
        cfg = self.config
        if not 0 <= start <= stop <= cfg.num_layers:
            raise ValueError(f"layers [{start}, {stop}) are not inside [0, {cfg.num_layers}]")
        if start == stop:
            return x, cache
        ropes = computed_once(cache, functools.partial(self._ropes, dtype=x.dtype),
                              positions)  # {local: (cos, sin)} each [B, S, Dh]
        layers = params["layers"]
        per_layer = isinstance(layers, (list, tuple))
        if per_layer or holds_layer_tuples(cache):  # static indices and windows
            for index in range(start, stop):
                layer = layers[index] if per_layer else jax.tree_util.tree_map(
                    lambda a, i=index: a[i], layers)
                local = cfg.local_layers[index]
                x, cache = self._block(layer, index, x, *ropes[local], positions, cache,
                                       cfg.layer_window(index))
            return x, cache
        if (start, stop) != (0, cfg.num_layers):
            layers = jax.tree_util.tree_map(lambda a: a[start:stop], layers)
        kinds = cfg.local_layers[start:stop]
        uniform = len(set(kinds)) == 1
        local_ids = jnp.asarray(np.array(kinds, bool))  # [n]
        windows = jnp.asarray(np.array([cfg.layer_window(i) or GLOBAL_WINDOW
                                        for i in range(start, stop)], np.int32))  # [n]

        def layer_step(carry, scanned):
            h, kv = carry
            layer_params, index, is_local, window = scanned
            if uniform:  # one window for every layer here: static
                cos, sin = ropes[kinds[0]]
                window = cfg.layer_window(start)
            else:
                cos = jnp.where(is_local, ropes[True][0], ropes[False][0])  # [B, S, Dh]
                sin = jnp.where(is_local, ropes[True][1], ropes[False][1])  # [B, S, Dh]
            h, kv = self._block(layer_params, index, h, cos, sin, positions, kv, window)
            return (h, kv), None

        layer_ids = jnp.arange(start, stop, dtype=jnp.int32)  # [n]
        (x, cache), _ = jax.lax.scan(layer_step, (x, cache),
                                     (layers, layer_ids, local_ids, windows))
        return x, cache

    def _ropes(self, positions: jax.Array, dtype) -> dict:
        """{True: local layers' (cos, sin), False: global layers'}, each [B, S, Dh]."""
        cfg = self.config
        out = {False: rope_lib.cos_sin(positions, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                                       cfg.max_position_embeddings, dtype)}
        same = (cfg.rope_local_theta, cfg.rope_local_scaling) == (cfg.rope_theta,
                                                                  cfg.rope_scaling)
        out[True] = out[False] if same else rope_lib.cos_sin(
            positions, cfg.head_dim, cfg.rope_local_theta, cfg.rope_local_scaling,
            cfg.max_position_embeddings, dtype)
        return out

    def _block(self, p: dict, index, x: jax.Array, cos: jax.Array, sin: jax.Array,
               positions: jax.Array, cache: Cache, window) -> tuple[jax.Array, Cache]:
        """One decoder layer: normed attention and normed GeGLU MLP, each branch normed again
        before its residual add. window: an int, a traced int32 or None."""
        cfg = self.config
        eps = cfg.rms_norm_eps
        batch, seq, _ = x.shape
        h = gemma_rms_norm(x, p["attn_norm"], eps)  # [B, S, D]
        q = (h @ p["wq"]).reshape(batch, seq, cfg.num_heads, cfg.head_dim)  # [B, S, H, Dh]
        k = (h @ p["wk"]).reshape(batch, seq, cfg.num_kv_heads, cfg.head_dim)  # [B, S, K, Dh]
        v = (h @ p["wv"]).reshape(batch, seq, cfg.num_kv_heads, cfg.head_dim)  # [B, S, K, Dh]
        if cfg.qk_norm:
            q = gemma_rms_norm(q, p["q_norm"], eps)  # [B, S, H, Dh]
            k = gemma_rms_norm(k, p["k_norm"], eps)  # [B, S, K, Dh]
        q = apply_rope(q, cos, sin)  # [B, S, H, Dh]
        k = apply_rope(k, cos, sin)  # [B, S, K, Dh]
        attn, cache = cache.update_attend(index, q, k, v, positions,
                                          scale=cfg.query_pre_attn_scalar ** -0.5,
                                          window=window, softcap=cfg.attn_logit_softcapping)
        out = attn.reshape(batch, seq, cfg.num_heads * cfg.head_dim) @ p["wo"]  # [B, S, D]
        x = x + gemma_rms_norm(out, p["post_attn_norm"], eps)  # [B, S, D]
        h = gemma_rms_norm(x, p["mlp_norm"], eps)  # [B, S, D]
        gate = jax.nn.gelu(h @ p["w_gate"], approximate=ACTIVATIONS[cfg.hidden_activation])
        mlp = (gate * (h @ p["w_up"])) @ p["w_down"]  # [B, S, D]
        return x + gemma_rms_norm(mlp, p["post_mlp_norm"], eps), cache  # [B, S, D]


@functools.lru_cache(maxsize=64)
def _shapes(config: GemmaConfig) -> dict:
    model = Gemma(config)
    return jax.tree_util.tree_map(lambda a: tuple(a.shape),
                                  jax.eval_shape(lambda: model.init_params(jax.random.key(0))))


def gemma_param_shapes(config: GemmaConfig) -> dict:
    """The expected shape of every parameter, stacked layout (a fresh copy)."""
    shapes = _shapes(config)
    return {key: dict(value) if isinstance(value, dict) else value
            for key, value in shapes.items()}


def _check_keys(tree: Mapping, expected: Mapping, optional: Mapping, path: str) -> None:
    for key, shape in expected.items():
        if key not in tree:
            raise ValueError(f"{path} has no key {key!r} for this model")
    for key in tree:
        if key not in expected and key not in optional:
            raise ValueError(f"{path} has an unexpected key {key!r}; this model uses "
                             f"{', '.join(sorted((*expected, *optional)))}")


def _check_shape(value: Any, shape: tuple, path: str) -> None:
    got = getattr(value, "shape", None)
    if got is None or tuple(got) != tuple(shape):
        raise ValueError(f"{path} has shape {None if got is None else tuple(got)}, expected "
                         f"{tuple(shape)} for this model")

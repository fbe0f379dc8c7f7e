"""GLM-4.5 (`glm4_moe`, transformers' Glm4MoeForCausalLM) under the model contract.

A Llama-like decoder with: partial RoPE (the first rotary_dim = head_dim * partial_rotary_factor
dimensions of each head rotate, in transformers 5.25's half-split `rotate_half` pairing; the
rest pass through), q/k/v biases (`attention_bias`; the output projection has none), optional
per-head q/k RMSNorm (`use_qk_norm`), `first_k_dense_replace` dense SwiGLU layers and then
mixture-of-experts layers (jaxgen/models/moe.py: sigmoid router, group-limited top-k, shared
experts), and optional MTP layers (`num_nextn_predict_layers`: jaxgen/models/mtp.py, whose
blocks are MoE layers of this kind).

Params layout (L layers: Ld = first_k_dense_replace dense, Lm = L - Ld MoE; D hidden, H heads,
K kv heads, Dh head dim, F dense MLP, E experts, Fe expert size, Fs = shared * Fe, V vocab):

    embed          [V, D]
    layers/        every layer:
      attn_norm    [L, D]          mlp_norm [L, D]
      wq [L, D, H*Dh]  wk, wv [L, D, K*Dh]  wo [L, H*Dh, D]
      bq [L, H*Dh]  bk, bv [L, K*Dh]        (attention_bias)
      q_norm, k_norm [L, Dh]                 (use_qk_norm)
                   the dense layers (Ld > 0):
      w_gate, w_up [Ld, D, F]  w_down [Ld, F, D]
                   the MoE layers (Lm > 0; moe.moe_shapes with a leading Lm):
      router [Lm, D, E]  router_bias [Lm, E]  experts_gate, experts_up [Lm, E, D, Fe]
      experts_down [Lm, E, Fe, D]  shared_gate, shared_up [Lm, D, Fs]  shared_down [Lm, Fs, D]
    final_norm     [D]
    lm_head        [D, V]          (tie_word_embeddings False)
    mtp/           (num_mtp_layers > 0) enorm, hnorm, eh_proj, norm and layers/ (the attention
                   and MoE keys above with a leading num_mtp_layers): jaxgen/models/mtp_layout.py

The layers run as two `jax.lax.scan`s (dense, then MoE) with the KV cache in the carry.

Example:
    >>> config = Glm4MoeConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
    ...     num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8, rotary_dim=4,
    ...     moe=MoeConfig(num_experts=4, experts_per_token=2, expert_size=8, shared_experts=1,
    ...                   groups=2, groups_per_token=1, normalize_weights=True, scaling=1.0))
    >>> model = Glm4Moe(config)
    >>> params = model.init_params(jax.random.key(0))
    >>> model.check_params(params)
    >>> out = model(params, jnp.zeros((1, 3), jnp.int32), jnp.arange(3)[None], model.init_cache(1, 8))
    >>> out.logits.shape, out.hidden.shape, int(out.cache.length[0])
    ((1, 3, 32), (1, 3, 16), 3)
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from jaxgen.cache import CACHE_KINDS, Cache, make_cache
from jaxgen.cache.layer_forms import computed_once, holds_layer_tuples
from jaxgen.cache.sharding import MODEL, check_divides
from jaxgen.models import rope as rope_lib
from jaxgen.models.config_checks import (
    FLOAT_LIMITS,
    INT_LIMITS,
    check_activation,
    check_float,
    check_int,
    check_llama_numbers,
    generation_fields,
    refuse_quantization,
    special_token_ids,
)
from jaxgen.models.llama import ModelOutput, _check_keys, _check_shape
from jaxgen.models.moe import MOE_SHARDING_RULES, MoeConfig, moe_mlp, moe_shapes
from jaxgen.models.mtp import MtpLayers
from jaxgen.models.mtp_layout import mtp_shapes
from jaxgen.models.norms import rms_norm
from jaxgen.models.rope import freeze

__all__ = ["Glm4Moe", "Glm4MoeConfig", "GLM4_MOE_ARCHITECTURE"]

GLM4_MOE_ARCHITECTURE = "Glm4MoeForCausalLM"
ATTENTION_KEYS = ("attn_norm", "mlp_norm", "wq", "wk", "wv", "wo", "bq", "bk", "bv",
                  "q_norm", "k_norm")
DENSE_KEYS = ("w_gate", "w_up", "w_down")
_MOE_KEYS = ("router", "router_bias", "experts_gate", "experts_up", "experts_down",
             "shared_gate", "shared_up", "shared_down")

# Glm4MoeConfig field -> config.json key (the names error messages show)
HF_NAMES = {"vocab_size": "vocab_size", "hidden_size": "hidden_size",
            "intermediate_size": "intermediate_size", "num_layers": "num_hidden_layers",
            "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads",
            "head_dim": "head_dim", "rms_norm_eps": "rms_norm_eps", "rope_theta": "rope_theta",
            "max_position_embeddings": "max_position_embeddings",
            "num_mtp_layers": "num_nextn_predict_layers",
            "dense_layers": "first_k_dense_replace"}


@dataclasses.dataclass(frozen=True)
class Glm4MoeConfig:
    """Static, hashable description of a GLM-4.5 model (HF field meanings; `dense_layers` is
    first_k_dense_replace, `rotary_dim` head_dim * partial_rotary_factor)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    moe: MoeConfig
    dense_layers: int = 1
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: tuple | None = None
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    generation_defaults: tuple[tuple[str, Any], ...] = ()
    num_mtp_layers: int = 0
    architecture: str = GLM4_MOE_ARCHITECTURE
    sliding_window: None = None  # full attention everywhere (the MTP cache reads it)

    def __post_init__(self):
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        check_llama_numbers(values)
        check_int("first_k_dense_replace", self.dense_layers, 0, self.num_layers)
        check_int("rotary_dim", self.rotary_dim, 2, self.head_dim)
        if self.rotary_dim % 2:
            raise ValueError(f"rotary_dim={self.rotary_dim} (head_dim * partial_rotary_factor) "
                             f"is odd; allowed: an even number (RoPE rotates pairs)")
        if not isinstance(self.moe, MoeConfig):
            raise ValueError(f"moe={self.moe!r}; allowed: a MoeConfig")
        if self.rope_scaling is not None:
            rope_lib.validate(dict(self.rope_scaling))

    @property
    def moe_layers(self) -> int:
        return self.num_layers - self.dense_layers

    @property
    def generation_defaults_dict(self) -> dict:
        return dict(self.generation_defaults)

    @classmethod
    def from_hf_dict(cls, config: dict, generation_config: dict | None = None,
                     where: str = "") -> "Glm4MoeConfig":
        """From a parsed config.json (model_type "glm4_moe") and generation_config.json.
        Raises ValueError naming the config.json field for a bad or unsupported value."""
        prefix = f"{where}: " if where else ""
        if not isinstance(config, dict):
            raise ValueError(f"{prefix}config.json holds a {type(config).__name__}, expected "
                             f"an object")
        if config.get("model_type") != "glm4_moe":
            raise ValueError(f"{prefix}model_type={config.get('model_type')!r}; allowed: "
                             f"'glm4_moe'")
        check_activation(config, where=where)
        refuse_quantization(config, where)
        for key in ("tie_word_embeddings", "attention_bias", "use_qk_norm", "norm_topk_prob"):
            if not isinstance(config.get(key, False), bool):
                raise ValueError(f"{prefix}{key}={config[key]!r}; allowed: true or false")
        numbers = {}
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                      "num_heads"):
            key = HF_NAMES[field]
            if config.get(key) is None:
                low, high = INT_LIMITS[field]
                raise ValueError(f"{prefix}config.json has no {key!r}; allowed: an int in "
                                 f"[{low}, {high}]")
            numbers[field] = check_int(key, config[key], *INT_LIMITS[field], where)
        heads = numbers["num_heads"]
        numbers["num_kv_heads"] = check_int("num_key_value_heads",
                                            config.get("num_key_value_heads", heads),
                                            *INT_LIMITS["num_kv_heads"], where)
        head_dim = config.get("head_dim")
        if head_dim is None:
            if numbers["hidden_size"] % heads:
                raise ValueError(f"{prefix}hidden_size={numbers['hidden_size']} is not a "
                                 f"multiple of num_attention_heads={heads} and there is no "
                                 f"head_dim; allowed: a multiple, or an explicit head_dim")
            head_dim = numbers["hidden_size"] // heads
        numbers["head_dim"] = check_int("head_dim", head_dim, *INT_LIMITS["head_dim"], where)
        numbers["max_position_embeddings"] = check_int(
            "max_position_embeddings", config.get("max_position_embeddings", 131072),
            *INT_LIMITS["max_position_embeddings"], where)
        numbers["rms_norm_eps"] = check_float("rms_norm_eps", config.get("rms_norm_eps", 1e-5),
                                              *FLOAT_LIMITS["rms_norm_eps"], where)
        mtp_key = "num_mtp_layers" if config.get("num_mtp_layers") is not None \
            else "num_nextn_predict_layers"
        numbers["num_mtp_layers"] = check_int(mtp_key, config.get(mtp_key) or 0,
                                              *INT_LIMITS["num_mtp_layers"], where)
        numbers["dense_layers"] = check_int("first_k_dense_replace",
                                            config.get("first_k_dense_replace", 1), 0,
                                            numbers["num_layers"], where)
        rope = _rope_fields(config, numbers["head_dim"], where)
        gen = generation_fields(generation_config)
        ids, id_names = special_token_ids(config, gen)
        check_llama_numbers({**numbers, "rope_theta": rope["rope_theta"], **ids},
                            {**HF_NAMES, **id_names}, where)
        return cls(**numbers, **rope, **ids,
                   moe=MoeConfig.from_hf_dict(config, where),
                   tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                   attention_bias=bool(config.get("attention_bias", False)),
                   qk_norm=bool(config.get("use_qk_norm", False)),
                   generation_defaults=freeze(gen))


def _rope_fields(config: dict, head_dim: int, where: str) -> dict:
    """rope_theta, rope_scaling and rotary_dim from `rope_parameters` (transformers 5) or the
    older top-level rope_theta / rope_scaling / partial_rotary_factor keys."""
    prefix = f"{where}: " if where else ""
    params = config.get("rope_parameters") or {}
    legacy = config.get("rope_scaling")
    for key, value in (("rope_parameters", params), ("rope_scaling", legacy)):
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"{prefix}{key}={value!r}; allowed: an object or null")
    params = dict(params)
    if legacy:
        params.update(legacy)
    theta = check_float("rope_theta", params.pop("rope_theta", config.get("rope_theta", 10000.0)),
                        *FLOAT_LIMITS["rope_theta"], where)
    factor = params.pop("partial_rotary_factor", config.get("partial_rotary_factor", 0.5))
    factor = check_float("partial_rotary_factor", factor, 0.0, 1.0, where)
    rotary = int(head_dim * factor)
    if rotary < 2 or rotary % 2:
        raise ValueError(f"{prefix}partial_rotary_factor={factor} gives {rotary} rotary "
                         f"dimensions of head_dim={head_dim}; allowed: a factor giving an even "
                         f"number >= 2")
    try:
        scaling = rope_lib.normalize(params)
    except ValueError as error:
        raise ValueError(f"{prefix}{error}") from None
    return {"rope_theta": theta, "rope_scaling": scaling, "rotary_dim": rotary}


def _rotate_half(x: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)  # [..., R]


def apply_partial_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, S, N, Dh]; cos, sin [B, S, R] (R <= Dh): the first R dimensions rotate (half-split
    pairs), the rest pass through."""
    rotary = cos.shape[-1]
    turned, kept = x[..., :rotary], x[..., rotary:]  # [B, S, N, R], [B, S, N, Dh - R]
    turned = turned * cos[:, :, None] + _rotate_half(turned) * sin[:, :, None]
    return jnp.concatenate([turned, kept], axis=-1)  # [B, S, N, Dh]


@dataclasses.dataclass(frozen=True)
class Glm4Moe:
    """GLM-4.5 decoder. Hashable; usable as a static jit argument."""

    config: Glm4MoeConfig

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def sharding_rules(self) -> dict:
        """MoE experts on the mesh's "model" axis by expert (param_sharding merges these over
        the Llama rules, which place attention and the dense MLP)."""
        return dict(MOE_SHARDING_RULES)

    def check_mesh_fits(self, mesh) -> None:
        """ValueError naming the size unless the "model" axis divides the heads, the KV heads,
        the dense MLP, the experts and the shared experts' width."""
        cfg = self.config
        hint = "choose a model axis that divides it (the data axis may take the other devices)"
        check_divides("num_attention_heads", cfg.num_heads, mesh, MODEL, hint)
        check_divides("num_key_value_heads", cfg.num_kv_heads, mesh, MODEL, hint)
        if cfg.dense_layers:
            check_divides("intermediate_size", cfg.intermediate_size, mesh, MODEL, hint)
        if cfg.moe_layers or cfg.num_mtp_layers:
            check_divides("n_routed_experts", cfg.moe.num_experts, mesh, MODEL, hint)
            if cfg.moe.shared_experts:
                check_divides("n_shared_experts * moe_intermediate_size",
                              cfg.moe.shared_experts * cfg.moe.expert_size, mesh, MODEL, hint)

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32,
                   kind: str = "static", cache_config: dict | None = None) -> Cache:
        """An empty cache of `kind` (jaxgen.cache.CACHE_KINDS) for `max_len` positions: every
        layer's K and V [L, batch, Hkv, max_len, Dh] in the static kind."""
        if kind not in CACHE_KINDS:
            raise ValueError(f"unknown cache kind {kind!r}; allowed: {', '.join(CACHE_KINDS)}")
        cfg = self.config
        return make_cache(kind, num_layers=cfg.num_layers, batch=batch, max_len=max_len,
                          num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=dtype,
                          sliding_window=None, cache_config=cache_config)

    # ------------------------------------------------------------------ parameters
    def layer_shapes(self) -> dict:
        """params["layers"]'s shapes (see the module docs)."""
        return _layer_shapes(self.config)

    def mtp_block_shapes(self) -> dict:
        """One MTP depth's decoder block, as {key: (1, ...)}: a MoE layer of this model."""
        cfg = self.config
        return {key: (1, *shape[1:]) for key, shape in _layer_shapes(cfg).items()
                if key not in DENSE_KEYS} | {
            key: (1, *shape) for key, shape in moe_shapes(cfg.moe, cfg.hidden_size).items()}

    def param_shapes(self) -> dict:
        """Every parameter's shape (stacked layout), params["mtp"] included when the config has
        MTP layers."""
        cfg = self.config
        shapes = {"embed": (cfg.vocab_size, cfg.hidden_size), "layers": self.layer_shapes(),
                  "final_norm": (cfg.hidden_size,)}
        if not cfg.tie_word_embeddings:
            shapes["lm_head"] = (cfg.hidden_size, cfg.vocab_size)
        if cfg.num_mtp_layers:
            shapes["mtp"] = mtp_shapes(cfg, self.mtp_block_shapes())
        return shapes

    def init_params(self, key: jax.Array, dtype=jnp.float32) -> dict:
        """Random parameters (normal, std 0.02; norms at 1; router bias 0) without MTP layers
        (jaxgen.models.mtp.with_mtp adds them)."""
        shapes = {k: v for k, v in self.param_shapes().items() if k != "mtp"}
        flat = [(path, shape) for path, shape in _leaves(shapes)]
        keys = jax.random.split(key, len(flat))
        out: dict = {}
        for k, (path, shape) in zip(keys, flat):
            name = path[-1]
            if "norm" in name:
                value = jnp.ones(shape, dtype)
            elif name == "router_bias":
                value = jnp.zeros(shape, dtype)
            else:
                value = (0.02 * jax.random.normal(k, shape)).astype(dtype)
            tree = out
            for part in path[:-1]:
                tree = tree.setdefault(part, {})
            tree[name] = value
        return out

    def check_params(self, params: Any) -> None:
        """Raises ValueError naming the first parameter that does not fit this model (a
        missing or unexpected key, a wrong shape). Host-only: reads `.shape`."""
        expected = self.param_shapes()
        if not isinstance(params, Mapping):
            raise ValueError(f"params is a {type(params).__name__}, expected a dict with keys "
                             f"{sorted(expected)}")
        if "mtp" in params and not self.config.num_mtp_layers:
            raise ValueError("params carry 'mtp' (MTP layers) but the model's config has "
                             "num_mtp_layers=0; set it to the number of MTP depths")
        if "mtp" not in params and self.config.num_mtp_layers:
            raise ValueError(f"params have no 'mtp' entry, but the model has num_mtp_layers="
                             f"{self.config.num_mtp_layers}: add its MTP layers' weights "
                             f"(jaxgen.models.mtp.init_mtp_params, or load the checkpoint)")
        optional = {"lm_head": (self.config.hidden_size, self.config.vocab_size)} \
            if self.config.tie_word_embeddings else {}

        def check(tree, shapes, where, extra=None):
            if not isinstance(tree, Mapping):
                raise ValueError(f"{where} is a {type(tree).__name__}, expected a dict with "
                                 f"keys {sorted(shapes)}")
            _check_keys(tree, shapes, extra or {}, where)
            for key, shape in {**shapes, **(extra or {})}.items():
                if key not in tree:
                    continue
                if isinstance(shape, dict):
                    check(tree[key], shape, f"{where}[{key!r}]")
                else:
                    _check_shape(tree[key], shape, f"{where}[{key!r}]")

        check(params, expected, "params", optional)

    # ------------------------------------------------------------------ forward
    def __call__(self, params: dict, tokens: jax.Array, positions: jax.Array, cache: Cache, *,
                 exit_layer: int | None = None,
                 logits_index: jax.Array | None = None) -> ModelOutput:
        """One forward over S new tokens per row, writing their K/V into `cache` at `positions`.

        tokens, positions: int32 [B, S]. exit_layer (static): run only the first exit_layer
        layers. logits_index: optional int32 [B, S'] of sequence indices that get logits.
        Returns ModelOutput(logits [B, S', V] f32, hidden [B, S, D] (pre final norm), cache)."""
        cfg = self.config
        stop = cfg.num_layers if exit_layer is None else int(exit_layer)
        if not 1 <= stop <= cfg.num_layers:
            raise ValueError(f"exit_layer={exit_layer} must be in [1, {cfg.num_layers}]")
        x = self.embed(params, tokens)  # [B, S, D]
        x, cache = self.run_layers(params, x, positions, cache, 0, stop)  # [B, S, D]
        hidden = x
        if logits_index is not None:
            x = jnp.take_along_axis(x, logits_index[:, :, None].astype(jnp.int32),
                                    axis=1)  # [B, S', D]
        logits = self.head(params, x)  # [B, S', V]
        return ModelOutput(logits=logits, hidden=hidden,
                           cache=cache.with_length(positions[:, -1] + 1))

    def embed(self, params: dict, tokens: jax.Array) -> jax.Array:
        """Input embeddings: tokens int32 [B, S] -> [B, S, D]."""
        return jnp.take(params["embed"], tokens, axis=0)  # [B, S, D]

    def rope_tables(self, positions: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
        """cos, sin [B, S, rotary_dim] for int positions [B, S] (the MTP depths use it too)."""
        cfg = self.config
        return rope_lib.cos_sin(positions, cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling,
                                cfg.max_position_embeddings, dtype)

    def run_layers(self, params: dict, x: jax.Array, positions: jax.Array, cache: Cache,
                   start: int, stop: int) -> tuple[jax.Array, Cache]:
        """Decoder layers [start, stop) (static) over x [B, S, D] at `positions` [B, S],
        writing those layers' K/V into `cache` (its length unchanged)."""
        cfg = self.config
        if not 0 <= start <= stop <= cfg.num_layers:
            raise ValueError(f"layers [{start}, {stop}) are not inside [0, {cfg.num_layers}]")
        if start == stop:
            return x, cache
        cos, sin = computed_once(cache, functools.partial(self.rope_tables, dtype=x.dtype),
                                 positions)  # [B, S, R] each
        layers = params["layers"]
        first_moe = cfg.dense_layers
        for lo, hi, mlp_keys, offset in ((start, min(stop, first_moe), DENSE_KEYS, 0),
                                         (max(start, first_moe), stop, _MOE_KEYS, first_moe)):
            if lo >= hi:
                continue
            attn = {k: v[lo:hi] for k, v in layers.items() if k in ATTENTION_KEYS}
            mlp = {k: v[lo - offset:hi - offset] for k, v in layers.items() if k in mlp_keys}
            stacked = {**attn, **mlp}  # [hi - lo, ...] each
            if holds_layer_tuples(cache):  # per-layer buffers need static indices
                for i in range(hi - lo):
                    layer = {k: v[i] for k, v in stacked.items()}
                    x, cache = self._block(layer, lo + i, x, cos, sin, positions, cache)
                continue

            def layer_step(carry, scanned):
                h, kv = carry
                layer, index = scanned
                h, kv = self._block(layer, index, h, cos, sin, positions, kv)
                return (h, kv), None

            ids = jnp.arange(lo, hi, dtype=jnp.int32)  # [hi - lo]
            (x, cache), _ = jax.lax.scan(layer_step, (x, cache), (stacked, ids))
        return x, cache

    def head(self, params: dict, hidden: jax.Array) -> jax.Array:
        """Final norm + LM head: hidden [B, S, D] -> logits [B, S, V] float32."""
        normed = rms_norm(hidden, params["final_norm"], self.config.rms_norm_eps)  # [B, S, D]
        head = params.get("lm_head")
        if head is None:
            return jnp.einsum("bsd,vd->bsv", normed, params["embed"],
                              preferred_element_type=jnp.float32)  # [B, S, V]
        return jnp.einsum("bsd,dv->bsv", normed, head,
                          preferred_element_type=jnp.float32)  # [B, S, V]

    def exit_head(self, params: dict, hidden: jax.Array, layer: int) -> jax.Array:
        """Early-exit logits from layer `layer`'s hidden [B, S, D]: the shared final norm and
        head (GLM checkpoints carry no exit adapters)."""
        return self.head(params, hidden)

    def mtp_layers(self) -> MtpLayers | None:
        """The checkpoint's MTP layers (jaxgen/models/mtp.py; weights in params["mtp"]), or
        None when num_nextn_predict_layers is 0. use_mtp=True drafts with them."""
        return MtpLayers(self) if self.config.num_mtp_layers > 0 else None

    def _block(self, p: dict, index: jax.Array, x: jax.Array, cos: jax.Array, sin: jax.Array,
               positions: jax.Array, cache: Cache) -> tuple[jax.Array, Cache]:
        """One decoder layer: pre-norm attention, then a pre-norm dense SwiGLU MLP or (when p
        holds a router) the MoE MLP; both residual."""
        cfg = self.config
        batch, seq, _ = x.shape
        h = rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)  # [B, S, D]
        q, k, v = h @ p["wq"], h @ p["wk"], h @ p["wv"]  # [B, S, H*Dh], [B, S, K*Dh] x2
        if cfg.attention_bias:
            q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
        q = q.reshape(batch, seq, cfg.num_heads, cfg.head_dim)  # [B, S, H, Dh]
        k = k.reshape(batch, seq, cfg.num_kv_heads, cfg.head_dim)  # [B, S, K, Dh]
        v = v.reshape(batch, seq, cfg.num_kv_heads, cfg.head_dim)  # [B, S, K, Dh]
        if cfg.qk_norm:
            q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)  # [B, S, H, Dh]
            k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)  # [B, S, K, Dh]
        q = apply_partial_rope(q, cos, sin)  # [B, S, H, Dh]
        k = apply_partial_rope(k, cos, sin)  # [B, S, K, Dh]
        attn, cache = cache.update_attend(index, q, k, v, positions,
                                          scale=cfg.head_dim ** -0.5)  # [B, S, H, Dh]
        x = x + attn.reshape(batch, seq, cfg.num_heads * cfg.head_dim) @ p["wo"]  # [B, S, D]
        h = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)  # [B, S, D]
        if "router" in p:
            return x + moe_mlp(p, h, cfg.moe), cache  # [B, S, D]
        gated = jax.nn.silu(h @ p["w_gate"]) * (h @ p["w_up"])  # [B, S, F]
        return x + gated @ p["w_down"], cache  # [B, S, D]


@functools.lru_cache(maxsize=64)
def _layer_shapes_cached(config: Glm4MoeConfig) -> tuple:
    cfg = config
    L, D = cfg.num_layers, cfg.hidden_size
    qd, kd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"attn_norm": (L, D), "mlp_norm": (L, D), "wq": (L, D, qd), "wk": (L, D, kd),
              "wv": (L, D, kd), "wo": (L, qd, D)}
    if cfg.attention_bias:
        shapes.update(bq=(L, qd), bk=(L, kd), bv=(L, kd))
    if cfg.qk_norm:
        shapes.update(q_norm=(L, cfg.head_dim), k_norm=(L, cfg.head_dim))
    if cfg.dense_layers:
        ld, f = cfg.dense_layers, cfg.intermediate_size
        shapes.update(w_gate=(ld, D, f), w_up=(ld, D, f), w_down=(ld, f, D))
    if cfg.moe_layers:
        shapes.update({key: (cfg.moe_layers, *shape)
                       for key, shape in moe_shapes(cfg.moe, D).items()})
    return tuple(shapes.items())


def _layer_shapes(config: Glm4MoeConfig) -> dict:
    return dict(_layer_shapes_cached(config))


def _leaves(tree: dict, path: tuple = ()):
    """(path, shape) of every shape in a nested dict of shapes, in sorted key order."""
    for key in sorted(tree):
        value = tree[key]
        if isinstance(value, dict):
            yield from _leaves(value, (*path, key))
        else:
            yield (*path, key), value

"""DeepSeek-V3 (`model_type` "deepseek_v3") under the model contract: multi-head latent
attention over a latent KV cache (jaxgen/models/mla.py, jaxgen/cache/latent.py), the first
`first_k_dense_replace` layers with a dense SwiGLU MLP and the rest with the shared
mixture of experts (jaxgen/models/moe.py), and the checkpoint's MTP layers
(jaxgen/models/deepseek_mtp.py, `use_mtp=True`).

A model is a frozen, hashable `DeepseekV3(config)`; parameters are a plain nested dict passed
in. Every layer's attention is stacked over the L layers; the dense MLPs over the Ld =
first_k_dense_replace first layers and the MoE MLPs over the Lm = L - Ld others. The layers
run under `jax.lax.scan`, one scan per kind of MLP, with the latent cache in the carry.

Params layout (names of mla.py's and moe.py's one-layer shapes, with a leading layer axis):

    embed        [V, D]
    layers/
      attn_norm, mlp_norm   [L, D]
      wq_a, q_a_norm, wq_b (or wq), wkv_a, kv_a_norm, wkv_b, wo (bq_a, bkv_a, bo)   [L, ...]
      w_gate, w_up [Ld, D, F]   w_down [Ld, F, D]                (first_k_dense_replace > 0)
      router, router_bias, experts_*, shared_*   [Lm, ...]        (L > first_k_dense_replace)
    final_norm   [D]
    lm_head      [D, V]           (only when tie_word_embeddings is False)
    mtp/         (num_mtp_layers = Dm > 0) enorm, hnorm [Dm, D], eh_proj [Dm, 2D, D],
                 norm [Dm, D], layers/ {attn_norm, mlp_norm, attention and MoE keys} [Dm, ...]

Example:
    >>> model = DeepseekV3(DeepseekV3Config(
    ...     vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
    ...     q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4,
    ...     v_head_dim=4, first_k_dense_replace=1,
    ...     moe=MoeConfig(num_experts=4, experts_per_token=2, expert_size=8, shared_experts=1,
    ...                   groups=2, groups_per_token=1, normalize_weights=True, scaling=2.5)))
    >>> params = model.init_params(jax.random.key(0))
    >>> cache = model.init_cache(1, 8)
    >>> out = model(params, jnp.zeros((1, 3), jnp.int32), jnp.arange(3)[None], cache)
    >>> out.logits.shape, out.cache.latent.shape       # the cache: [L, B, 1, T, R + P]
    ((1, 3, 32), (2, 1, 1, 8, 12))
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.cache import CACHE_KINDS, validate_cache_config
from jaxgen.cache.latent import LATENT_KINDS, LatentCache
from jaxgen.cache.layer_forms import holds_layer_tuples
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
from jaxgen.models.deepseek_mtp import DeepseekMtpLayers, mtp_param_shapes
from jaxgen.models.llama import ModelOutput, freeze
from jaxgen.models.mla import (
    ROPE_TYPES,
    expanded_kv_bytes_per_token,
    latent_bytes_per_token,
    mla_attention,
    mla_shapes,
    rope_cos_sin,
)
from jaxgen.models.moe import MOE_SHARDING_RULES, MoeConfig, moe_mlp, moe_shapes
from jaxgen.models.norms import rms_norm

__all__ = ["DeepseekV3", "DeepseekV3Config", "LATENT_CACHE_KINDS", "param_shapes"]

LATENT_CACHE_KINDS = tuple(LATENT_KINDS)  # the cache_implementation values MLA runs
DENSE_MLP_KEYS = ("w_gate", "w_up", "w_down")

# DeepseekV3Config field -> config.json key (the names the checks' messages show)
HF_NAMES = {"vocab_size": "vocab_size", "hidden_size": "hidden_size",
            "intermediate_size": "intermediate_size", "num_layers": "num_hidden_layers",
            "num_heads": "num_attention_heads", "q_lora_rank": "q_lora_rank",
            "kv_lora_rank": "kv_lora_rank", "qk_nope_head_dim": "qk_nope_head_dim",
            "qk_rope_head_dim": "qk_rope_head_dim", "v_head_dim": "v_head_dim",
            "first_k_dense_replace": "first_k_dense_replace", "rms_norm_eps": "rms_norm_eps",
            "rope_theta": "rope_theta", "max_position_embeddings": "max_position_embeddings",
            "num_mtp_layers": "num_nextn_predict_layers"}
_DIM_LIMIT = (1, 2**16)  # each MLA width (ranks, head dims)


@dataclasses.dataclass(frozen=True)
class DeepseekV3Config:
    """Static, hashable description of a DeepSeek-V3 model (HF field meanings; see HF_NAMES).

    rope_scaling: HF's `rope_parameters` without rope_theta, frozen into sorted items, or None
    for plain RoPE. q_lora_rank None: the query is one projection (q_proj).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    moe: MoeConfig
    q_lora_rank: int | None = None
    first_k_dense_replace: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple | None = None
    rope_interleave: bool = True
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    generation_defaults: tuple[tuple[str, Any], ...] = ()
    architecture: str = "DeepseekV3ForCausalLM"
    num_mtp_layers: int = 0  # num_nextn_predict_layers: MTP depths at layers L + k

    def __post_init__(self):
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        check_llama_numbers({k: v for k, v in values.items() if k in INT_LIMITS
                             or k in FLOAT_LIMITS or k.endswith("token_id")}, HF_NAMES)
        for field in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            check_int(HF_NAMES[field], values[field], *_DIM_LIMIT)
        check_int("qk_rope_head_dim", self.qk_rope_head_dim, 2, _DIM_LIMIT[1])
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} is odd; allowed: an "
                             f"even int (RoPE rotates pairs of dimensions)")
        if self.q_lora_rank is not None:
            check_int("q_lora_rank", self.q_lora_rank, *_DIM_LIMIT)
        check_int("first_k_dense_replace", self.first_k_dense_replace, 0, self.num_layers)
        if not isinstance(self.moe, MoeConfig):
            raise ValueError(f"moe must be a MoeConfig, got {type(self.moe).__name__}")
        if self.rope_scaling is not None:
            check_rope(dict(self.rope_scaling))

    @property
    def rope_scaling_dict(self) -> dict | None:
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    @property
    def generation_defaults_dict(self) -> dict:
        return dict(self.generation_defaults)

    @property
    def dense_layers(self) -> int:
        """Ld: layers [0, Ld) have a dense MLP, [Ld, L) the MoE."""
        return self.first_k_dense_replace

    @classmethod
    def from_hf_dict(cls, config: dict, generation_config: dict | None = None,
                     where: str = "") -> "DeepseekV3Config":
        """From a parsed HF `config.json` (model_type "deepseek_v3") and optional
        generation_config.json. ValueError naming the config.json key and the allowed values
        for anything missing, malformed, or not implemented."""
        prefix = f"{where}: " if where else ""
        if not isinstance(config, dict):
            raise ValueError(f"{prefix}config.json holds a {type(config).__name__}, expected "
                             f"an object")
        if config.get("model_type") != "deepseek_v3":
            raise ValueError(f"{prefix}model_type={config.get('model_type')!r}; allowed: "
                             f"'deepseek_v3'")
        check_activation(config, where=where)
        # DeepSeek's own config.json fields that would change the math if they differed
        for key, allowed in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"),
                             ("moe_layer_freq", 1)):
            if config.get(key, allowed) != allowed:
                raise ValueError(f"{prefix}{key}={config[key]!r}; allowed: {allowed!r}")
        refuse_quantization(config, where)
        for key in ("tie_word_embeddings", "attention_bias", "rope_interleave"):
            if not isinstance(config.get(key, False), bool):
                raise ValueError(f"{prefix}{key}={config[key]!r}; allowed: true or false")
        numbers = {}
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                    "num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                    "v_head_dim")
        for field in required:
            key = HF_NAMES[field]
            if config.get(key) is None:
                raise ValueError(f"{prefix}config.json has no {key!r}; allowed: a positive int")
            limits = INT_LIMITS.get(field, _DIM_LIMIT)
            numbers[field] = check_int(key, config[key], *limits, where)
        heads = numbers["num_heads"]
        kv_heads = config.get("num_key_value_heads")
        if kv_heads is not None and kv_heads != heads:
            raise ValueError(f"{prefix}num_key_value_heads={kv_heads!r}: MLA expands one latent "
                             f"into every head's keys and values; allowed: null or "
                             f"num_attention_heads={heads}")
        q_lora = config.get("q_lora_rank")
        numbers["q_lora_rank"] = None if q_lora is None else check_int(
            "q_lora_rank", q_lora, *_DIM_LIMIT, where)
        numbers["first_k_dense_replace"] = check_int(
            "first_k_dense_replace", config.get("first_k_dense_replace") or 0, 0,
            numbers["num_layers"], where)
        numbers["max_position_embeddings"] = check_int(
            "max_position_embeddings", config.get("max_position_embeddings", 4096),
            *INT_LIMITS["max_position_embeddings"], where)
        numbers["rms_norm_eps"] = check_float("rms_norm_eps", config.get("rms_norm_eps", 1e-6),
                                              *FLOAT_LIMITS["rms_norm_eps"], where)
        mtp_key = "num_nextn_predict_layers" if "num_nextn_predict_layers" in config \
            else "num_mtp_layers"
        numbers["num_mtp_layers"] = check_int(mtp_key, config.get(mtp_key) or 0,
                                              *INT_LIMITS["num_mtp_layers"], where)
        if config.get("pretraining_tp", 1) not in (1, None):
            raise ValueError(f"{prefix}pretraining_tp={config['pretraining_tp']!r}; allowed: 1")
        numbers["rope_theta"], scaling = _hf_rope(config, where)
        gen = generation_fields(generation_config)
        ids, id_names = special_token_ids(config, gen)
        check_llama_numbers({**{k: v for k, v in numbers.items() if k in INT_LIMITS
                                or k in FLOAT_LIMITS}, **ids}, {**HF_NAMES, **id_names}, where)
        moe = MoeConfig.from_hf_dict(config, where)
        try:  # the checks __post_init__ makes (qk_rope_head_dim even ...), with the path
            return cls(**numbers, moe=moe, rope_scaling=scaling,
                       rope_interleave=bool(config.get("rope_interleave", True)),
                       tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                       attention_bias=bool(config.get("attention_bias", False)), **ids,
                       generation_defaults=freeze(gen))
        except ValueError as error:
            raise ValueError(f"{prefix}{error}") from None


def check_rope(scaling: dict, where: str = "") -> None:
    """ValueError unless `rope_parameters` (without rope_theta) is a kind MLA runs."""
    prefix = f"{where}: " if where else ""
    rope_type = scaling.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"{prefix}rope_parameters.rope_type={rope_type!r}; allowed: "
                         f"{', '.join(ROPE_TYPES)}")
    factor = scaling.get("partial_rotary_factor", 1.0)
    if factor != 1.0:
        raise ValueError(f"{prefix}rope_parameters.partial_rotary_factor={factor!r}; allowed: "
                         f"1.0 (MLA rotates all qk_rope_head_dim dimensions)")
    if rope_type == "yarn":
        for key in ("factor", "mscale", "mscale_all_dim", "attention_factor", "beta_fast",
                    "beta_slow"):
            if scaling.get(key) is not None:
                check_float(f"rope_parameters.{key}", scaling[key], 0.0, 1e9, where,
                            low_included=key in ("mscale", "mscale_all_dim"))
        if scaling.get("original_max_position_embeddings") is not None:
            check_int("rope_parameters.original_max_position_embeddings",
                      scaling["original_max_position_embeddings"], 1,
                      INT_LIMITS["max_position_embeddings"][1], where)
        if not isinstance(scaling.get("truncate", True), bool):
            raise ValueError(f"{prefix}rope_parameters.truncate={scaling['truncate']!r}; "
                             f"allowed: true or false")
    elif rope_type != "default":
        rope_lib.validate(scaling)


def _hf_rope(config: dict, where: str) -> tuple[float, tuple | None]:
    """(rope_theta, frozen scaling or None) from rope_parameters / rope_scaling / rope_theta.
    YaRN's original_max_position_embeddings defaults to max_position_embeddings (as
    transformers' standardize_rope_params sets it)."""
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
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type == "default" and params.get("partial_rotary_factor", 1.0) == 1.0:
        return theta, None
    params["rope_type"] = rope_type
    if rope_type == "yarn":
        params.setdefault("original_max_position_embeddings",
                          config.get("max_position_embeddings", 4096))
    check_rope(params, where)
    return theta, freeze(params)


def param_shapes(config: DeepseekV3Config) -> dict:
    """The expected shape of every parameter (see the module docs); "mtp" when the config has
    MTP layers."""
    expected = _expected_shapes(config)
    out = {key: dict(value) if isinstance(value, dict) else value
           for key, value in expected.items()}
    if "mtp" in out:
        out["mtp"] = {k: dict(v) if isinstance(v, dict) else v for k, v in out["mtp"].items()}
    return out


def attention_layer_shapes(config: DeepseekV3Config) -> dict:
    """One decoder block's norms and attention (no layer axis)."""
    d = config.hidden_size
    return {"attn_norm": (d,), "mlp_norm": (d,), **mla_shapes(config)}


@functools.lru_cache(maxsize=64)
def _expected_shapes(config: DeepseekV3Config) -> dict:
    """param_shapes, computed once per config (shared: callers must not modify it)."""
    L, Ld = config.num_layers, config.dense_layers
    Lm = L - Ld
    d, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    layers = {k: (L, *s) for k, s in attention_layer_shapes(config).items()}
    if Ld:
        layers.update(w_gate=(Ld, d, f), w_up=(Ld, d, f), w_down=(Ld, f, d))
    if Lm:
        layers.update({k: (Lm, *s) for k, s in moe_shapes(config.moe, d).items()})
    shapes = {"embed": (v, d), "layers": layers, "final_norm": (d,)}
    if not config.tie_word_embeddings:
        shapes["lm_head"] = (d, v)
    if config.num_mtp_layers:
        shapes["mtp"] = mtp_param_shapes(config, attention_layer_shapes(config))
    return shapes


def _check_tree(tree: Any, expected: Mapping, path: str) -> None:
    """ValueError naming the first missing, unexpected or mis-shaped entry of `tree`."""
    if not isinstance(tree, Mapping):
        raise ValueError(f"{path} is a {type(tree).__name__}, expected a dict with keys "
                         f"{sorted(expected)}")
    for key, shape in expected.items():
        if key not in tree:
            wanted = "" if isinstance(shape, Mapping) else f" (expected shape {tuple(shape)})"
            raise ValueError(f"{path} has no key {key!r}{wanted} for this model")
    for key in tree:
        if key not in expected:
            raise ValueError(f"{path} has an unexpected key {key!r}; this model uses "
                             f"{', '.join(sorted(expected))}")
    for key, shape in expected.items():
        where = f"{path}[{key!r}]"
        if isinstance(shape, Mapping):
            _check_tree(tree[key], shape, where)
            continue
        got = getattr(tree[key], "shape", None)
        if got is not None and not isinstance(tree[key], (jax.Array, np.ndarray,
                                                          jax.ShapeDtypeStruct)):
            raise ValueError(f"{where} is a {type(tree[key]).__name__}: DeepSeek-V3 runs float "
                             f"weights only (allowed: weights='float', in float32 or bfloat16)")
        if got is None:
            raise ValueError(f"{where} is a {type(tree[key]).__name__}, expected an array of "
                             f"shape {tuple(shape)} for this model")
        if tuple(got) != tuple(shape):
            raise ValueError(f"{where} has shape {tuple(got)}, expected {tuple(shape)} for "
                             f"this model")


@functools.partial(jax.jit, static_argnames=("model", "dtype"))
def _random_params(model: "DeepseekV3", key: jax.Array, dtype) -> dict:
    return model._random_params(key, dtype)


def _swiglu(p: Mapping, x: jax.Array) -> jax.Array:
    """The dense MLP: x [B, S, D] -> [B, S, D]."""
    return (jax.nn.silu(x @ p["w_gate"]) * (x @ p["w_up"])) @ p["w_down"]


@dataclasses.dataclass(frozen=True)
class DeepseekV3:
    """DeepSeek-V3 decoder. Hashable; usable as a static jit argument."""

    config: DeepseekV3Config

    # param name -> dimension from the end on the mesh's "model" axis (jaxgen.models.shard,
    # merged over the Llama rules, which already put wq / w_gate / w_up on -1 and wo /
    # w_down on -2): the heads of the up-projections, the experts by expert. The down
    # projections wq_a, wkv_a (and the latent they produce) are replicated.
    sharding_rules = {"wq_b": -1, "wkv_b": -1, **MOE_SHARDING_RULES}

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def check_mesh_fits(self, mesh) -> None:
        """ValueError naming the size the mesh's "model" axis does not divide: the heads, the
        dense MLP width, the routed experts, the shared experts' width."""
        cfg = self.config
        hint = "choose a model axis that divides it (the data axis may take the other devices)"
        check_divides("num_attention_heads", cfg.num_heads, mesh, MODEL, hint)
        if cfg.dense_layers:
            check_divides("intermediate_size", cfg.intermediate_size, mesh, MODEL, hint)
        if cfg.dense_layers < cfg.num_layers or cfg.num_mtp_layers:
            check_divides("n_routed_experts", cfg.moe.num_experts, mesh, MODEL, hint)
            if cfg.moe.shared_experts:
                check_divides("n_shared_experts * moe_intermediate_size",
                              cfg.moe.shared_experts * cfg.moe.expert_size, mesh, MODEL, hint)

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32,
                   kind: str = "static", cache_config: dict | None = None) -> LatentCache:
        """An empty latent cache (jaxgen/cache/latent.py) for `max_len` positions: latent
        [L, batch, 1, max_len, R + P]. kind: "static" or "dynamic" (the other
        cache_implementation values store per-head K/V, which MLA does not have)."""
        if kind not in LATENT_KINDS:
            known = f"; allowed: {', '.join(LATENT_CACHE_KINDS)}"
            if kind in CACHE_KINDS:
                raise ValueError(f"cache_implementation={kind!r} is not supported by "
                                 f"DeepSeek-V3's latent cache (MLA caches one latent per "
                                 f"token, not per-head keys and values){known}")
            raise ValueError(f"unknown cache kind {kind!r}{known}")
        validate_cache_config(kind, cache_config)
        cfg = self.config
        return LATENT_KINDS[kind].init(num_layers=cfg.num_layers, batch=batch, max_len=max_len,
                                       kv_lora_rank=cfg.kv_lora_rank,
                                       rope_dim=cfg.qk_rope_head_dim, dtype=dtype)

    def cache_bytes_per_token(self, dtype=jnp.float32) -> dict:
        """{"latent": what the latent cache holds per position and row, "expanded": what
        per-head K/V of the same layers would hold} in bytes."""
        cfg = self.config
        return {"latent": latent_bytes_per_token(cfg, cfg.num_layers, dtype),
                "expanded": expanded_kv_bytes_per_token(cfg, cfg.num_layers, dtype)}

    def init_params(self, key: jax.Array, dtype=jnp.float32) -> dict:
        """Random parameters (normal, std 0.02; norms at 1; router bias 0) in the layout
        above (one compiled program, not one per leaf shape)."""
        return _random_params(self, key, dtype=jnp.dtype(dtype))

    def _random_params(self, key: jax.Array, dtype) -> dict:
        shapes = _expected_shapes(self.config)
        flat, tree = jax.tree_util.tree_flatten_with_path(
            shapes, is_leaf=lambda x: isinstance(x, tuple))
        keys = jax.random.split(key, len(flat))
        leaves = []
        for k, (path, shape) in zip(keys, flat):
            name = str(getattr(path[-1], "key", path[-1]))
            if "norm" in name:
                leaves.append(jnp.ones(shape, dtype))
            elif name == "router_bias":
                leaves.append(jnp.zeros(shape, dtype))
            else:
                leaves.append((0.02 * jax.random.normal(k, shape)).astype(dtype))
        return jax.tree_util.tree_unflatten(tree, leaves)

    def check_params(self, params: Any) -> None:
        """Raises ValueError naming the first parameter that does not fit this model (a
        missing or unexpected key, a wrong shape). `lm_head` is optional when the embeddings
        are tied. Host-only: reads `.shape`.

        Example:
            >>> model = DeepseekV3(DeepseekV3Config(
            ...     vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2,
            ...     num_heads=2, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4,
            ...     v_head_dim=4, first_k_dense_replace=2, moe=MoeConfig(4, 2, 8, 0, 1, 1,
            ...     True, 1.0)))
            >>> params = model.init_params(jax.random.key(0))
            >>> model.check_params(params)
            >>> model.check_params({**params, "layers": {**params["layers"],
            ...                     "wkv_b": params["layers"]["wkv_b"][:, :4]}})
            ...                                             # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            ValueError: params['layers']['wkv_b'] has shape (2, 4, 16), expected (2, 8, 16) ...
        """
        expected = dict(_expected_shapes(self.config))
        if not isinstance(params, Mapping):
            raise ValueError(f"params is a {type(params).__name__}, expected a dict with keys "
                             f"{sorted(expected)}")
        if "mtp" in params and not self.config.num_mtp_layers:
            raise ValueError("params carry 'mtp' (MTP layers) but the model's config has "
                             "num_mtp_layers=0; set num_nextn_predict_layers")
        if "mtp" not in params and self.config.num_mtp_layers:
            raise ValueError(f"params have no 'mtp' entry, but the model has num_mtp_layers="
                             f"{self.config.num_mtp_layers}: add its MTP layers' weights "
                             f"(load the checkpoint, or init_params)")
        if self.config.tie_word_embeddings and "lm_head" in params:
            expected["lm_head"] = (self.config.hidden_size, self.config.vocab_size)
        if isinstance(params.get("layers"), (list, tuple)):
            raise ValueError("params['layers'] is a list: DeepSeek-V3 runs stacked layers "
                             "only (a dict of [L, ...] arrays)")
        _check_tree(params, expected, "params")

    def __call__(self, params: dict, tokens: jax.Array, positions: jax.Array, cache, *,
                 exit_layer: int | None = None,
                 logits_index: jax.Array | None = None) -> ModelOutput:
        """One forward over S new tokens per row, writing their latents into `cache` at
        `positions` (int32 [B, S]). Returns ModelOutput(logits [B, S', V] f32, hidden
        [B, S, D] (pre final norm), cache with length = positions[:, -1] + 1)."""
        cfg = self.config
        num_layers = cfg.num_layers if exit_layer is None else int(exit_layer)
        if not 1 <= num_layers <= cfg.num_layers:
            raise ValueError(f"exit_layer={exit_layer} must be in [1, {cfg.num_layers}]")
        x = self.embed(params, tokens)  # [B, S, D]
        x, cache = self.run_layers(params, x, positions, cache, 0, num_layers)  # [B, S, D]
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
        """Early-exit logits from layer `layer`'s hidden [B, S, D]: the final norm and head
        (DeepSeek-V3 checkpoints carry no exit adapters)."""
        return self.head(params, hidden)

    def mtp_layers(self) -> DeepseekMtpLayers | None:
        """The checkpoint's MTP layers (params["mtp"]), or None without them; use_mtp=True
        drafts with them."""
        return DeepseekMtpLayers(self) if self.config.num_mtp_layers > 0 else None

    def run_layers(self, params: dict, x: jax.Array, positions: jax.Array, cache,
                   start: int, stop: int) -> tuple[jax.Array, Any]:
        """Decoder layers [start, stop) (static) over x [B, S, D] at `positions` [B, S],
        writing those layers' latents into `cache` (its length unchanged)."""
        cfg = self.config
        if not 0 <= start <= stop <= cfg.num_layers:
            raise ValueError(f"layers [{start}, {stop}) are not inside [0, {cfg.num_layers}]")
        if start == stop:
            return x, cache
        cos, sin = rope_cos_sin(positions, cfg, x.dtype)  # [B, S, P] each
        layers = params["layers"]
        attention = {k: layers[k] for k in attention_layer_shapes(cfg)}
        dense = cfg.dense_layers
        segments = ((start, min(stop, dense), False), (max(start, dense), stop, True))
        for first, last, is_moe in segments:
            if first >= last:
                continue
            offset = dense if is_moe else 0
            mlp_keys = [k for k in layers if k not in attention
                        and (k not in DENSE_MLP_KEYS) == is_moe]
            scanned = {**{k: v[first:last] for k, v in attention.items()},
                       **{k: layers[k][first - offset:last - offset] for k in mlp_keys}}
            x, cache = self._scan(scanned, first, last, is_moe, x, cos, sin, positions, cache)
        return x, cache

    def _scan(self, scanned: dict, first: int, last: int, is_moe: bool, x, cos, sin,
              positions, cache):
        """Layers [first, last) of one MLP kind: a lax.scan over their stacked params (or an
        unrolled loop when the cache holds one buffer per layer)."""
        if holds_layer_tuples(cache):  # per-layer buffers need static layer indices
            for index in range(first, last):
                layer = {k: v[index - first] for k, v in scanned.items()}
                x, cache = self.block(layer, index, x, cos, sin, positions, cache, is_moe)
            return x, cache

        def step(carry, inputs):
            h, kv = carry
            layer, index = inputs
            return self.block(layer, index, h, cos, sin, positions, kv, is_moe), None

        layer_ids = jnp.arange(first, last, dtype=jnp.int32)  # [last - first]
        (x, cache), _ = jax.lax.scan(step, (x, cache), (scanned, layer_ids))
        return x, cache

    def block(self, p: dict, index, x: jax.Array, cos: jax.Array, sin: jax.Array,
              positions: jax.Array, cache, is_moe: bool) -> tuple[jax.Array, Any]:
        """One decoder layer: pre-norm MLA then a pre-norm dense or MoE MLP, both residual.
        x [B, S, D]; the latent goes to layer `index` of `cache` at `positions`."""
        cfg = self.config
        h = rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)  # [B, S, D]
        out, cache = mla_attention(p, h, index, positions, cos, sin, cache, cfg)  # [B, S, D]
        x = x + out  # [B, S, D]
        h = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)  # [B, S, D]
        mlp = moe_mlp(p, h, cfg.moe) if is_moe else _swiglu(p, h)  # [B, S, D]
        return x + mlp, cache

"""The Llama family (Llama 2/3, SmolLM/SmolLM2, Mistral, Qwen2, Qwen3) under the model contract.

A model is a frozen, hashable `Llama(config)`; parameters are a plain nested dict passed in
(never closed over). Per-layer parameters are stacked on axis 0 and the layers run under
`jax.lax.scan`, with the KV cache in the scan carry.

Params layout (L layers, D hidden, H heads, K kv heads, Dh head dim, F mlp, V vocab):

    embed        [V, D]
    layers/
      attn_norm  [L, D]
      wq         [L, D, H*Dh]     bq [L, H*Dh]  (attention_bias)
      wk         [L, D, K*Dh]     bk [L, K*Dh]  (attention_bias)
      wv         [L, D, K*Dh]     bv [L, K*Dh]  (attention_bias)
      wo         [L, H*Dh, D]     bo [L, D]     (attention_out_bias)
      q_norm     [L, Dh]          k_norm [L, Dh] (qk_norm)
      mlp_norm   [L, D]
      w_gate     [L, D, F]
      w_up       [L, D, F]
      w_down     [L, F, D]
    final_norm   [D]
    lm_head      [D, V]           (only when tie_word_embeddings is False)

Example:
    >>> model = Llama(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
    ...                           num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8))
    >>> params = model.init_params(jax.random.key(0))
    >>> cache = model.init_cache(1, 8)
    >>> out = model(params, jnp.zeros((1, 3), jnp.int32), jnp.arange(3)[None], cache)
    >>> out.logits.shape, out.hidden.shape, int(out.cache.length[0])
    ((1, 3, 32), (1, 3, 16), 3)
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.cache import CACHE_KINDS, Cache, make_cache
from jaxgen.cache.layer_forms import computed_once, holds_layer_tuples
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
from jaxgen.models.exit_adapter import apply_exit_adapter, exit_adapter_shapes
from jaxgen.models.mtp import MtpLayers
from jaxgen.models.mtp_layout import mtp_shapes
from jaxgen.models.norms import rms_norm  # re-exported (models import it from here)
from jaxgen.models.rope import freeze  # re-exported for loaders

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

__all__ = ["Llama", "LlamaConfig", "ModelOutput", "SUPPORTED_ARCHITECTURES", "freeze", "rms_norm"]


class ModelOutput(NamedTuple):
    """What a forward returns: logits [B, S', V] float32, hidden [B, S, D], the updated cache."""

    logits: jax.Array
    hidden: jax.Array
    cache: Any


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Static, hashable description of a Llama-family model (HF field meanings).

    rope_scaling is HF's `rope_scaling` / `rope_parameters` dict (without rope_theta) frozen
    into a sorted tuple of (key, value) items, or None for plain RoPE.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # biases on q/k/v projections (Qwen2; Llama attention_bias)
    attention_out_bias: bool = False  # bias on the output projection (Llama/Qwen3 attention_bias)
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    generation_defaults: tuple[tuple[str, Any], ...] = ()
    architecture: str = "LlamaForCausalLM"
    sliding_window: int | None = None  # Mistral: every layer sees keys p - W < j <= p
    # exit layers E whose trained adapter the loader attached (params["exit_adapters"][str(E)];
    # assistant_early_exit=E uses it), e.g. (15,) for the embedded SmolLM2
    exit_adapter_layers: tuple[int, ...] = ()
    # multi-token-prediction depths the checkpoint carries at layer indices num_layers + k
    # (HF's num_mtp_layers / DeepSeek's num_nextn_predict_layers; params["mtp"], jaxgen/models/mtp.py)
    num_mtp_layers: int = 0

    def __post_init__(self):
        check_llama_numbers({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        if self.rope_scaling is not None:
            rope_lib.validate(dict(self.rope_scaling))
            if dict(self.rope_scaling).get("rope_type") == "dynamic" and self.head_dim <= 2:
                raise ValueError(f"head_dim={self.head_dim} with rope_type 'dynamic'; allowed: "
                                 f"head_dim > 2 (NTK scaling divides by head_dim - 2)")
        layers = tuple(self.exit_adapter_layers)
        if not all(isinstance(e, int) and not isinstance(e, bool) and 1 <= e < self.num_layers
                   for e in layers):
            raise ValueError(f"exit_adapter_layers={list(layers)} must hold exit layers in "
                             f"[1, num_layers={self.num_layers})")
        object.__setattr__(self, "exit_adapter_layers", tuple(sorted(set(layers))))

    @property
    def rope_scaling_dict(self) -> dict | None:
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    @property
    def generation_defaults_dict(self) -> dict:
        return dict(self.generation_defaults)

    @classmethod
    def from_hf_dict(cls, config: dict, generation_config: dict | None = None,
                     where: str = "") -> "LlamaConfig":
        """Builds a config from a parsed HF `config.json` (and optional generation_config.json).

        Accepts both the transformers<5 keys (`rope_theta`, `rope_scaling`) and the
        transformers>=5 `rope_parameters` dict. Raises ValueError for other architectures
        (or a model_type contradicting them), and, naming the config.json key and its
        allowed values, for a missing or malformed number (every number is checked before it
        is used: config_checks.py) and for a field that changes the math but is not
        implemented (hidden_act other than silu, partial_rotary_factor other than 1, a
        quantization_config). where: a prefix for the messages (the file's path).
        """
        prefix = f"{where}: " if where else ""
        if not isinstance(config, dict):
            raise ValueError(f"{prefix}config.json holds a {type(config).__name__}, expected "
                             f"an object")
        archs = config.get("architectures") or []
        if not isinstance(archs, list):
            raise ValueError(f"{prefix}architectures={archs!r}; allowed: a list of names")
        model_type = config.get("model_type")
        known_type = model_type if isinstance(model_type, str) else None
        arch = archs[0] if archs else _ARCH_BY_MODEL_TYPE.get(known_type)
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"{prefix}unsupported architecture {arch!r} (model_type="
                f"{model_type!r}); supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if model_type is not None and _ARCH_BY_MODEL_TYPE.get(known_type) != arch:
            # transformers picks the model class by model_type: contradicting it is an error
            allowed = [t for t, a in _ARCH_BY_MODEL_TYPE.items() if a == arch]
            raise ValueError(f"{prefix}model_type={model_type!r} contradicts architectures="
                             f"{archs!r}; allowed: {', '.join(map(repr, allowed))} or none")
        if config.get("mlp_bias"):
            raise ValueError(f"{prefix}{arch}: mlp_bias=True is not supported")
        check_activation(config, where=where)
        refuse_quantization(config, where)
        for key in ("tie_word_embeddings", "attention_bias", "use_sliding_window"):
            if not isinstance(config.get(key, False), bool):
                raise ValueError(f"{prefix}{key}={config[key]!r}; allowed: true or false")
        numbers = _hf_numbers(config, where)
        hidden, heads = numbers["hidden_size"], numbers["num_heads"]
        if numbers.get("head_dim") is None:  # HF's default: hidden_size / heads
            if hidden % heads:
                raise ValueError(f"{prefix}hidden_size={hidden} is not a multiple of "
                                 f"num_attention_heads={heads} and there is no head_dim; "
                                 f"allowed: a multiple, or an explicit head_dim")
            numbers["head_dim"] = hidden // heads
        numbers.setdefault("num_kv_heads", heads)
        rope_params = config.get("rope_parameters") or {}
        legacy_scaling = config.get("rope_scaling")
        for key, value in (("rope_parameters", rope_params), ("rope_scaling", legacy_scaling)):
            if value is not None and not isinstance(value, dict):
                raise ValueError(f"{prefix}{key}={value!r}; allowed: an object or null")
        rope_params = dict(rope_params)
        if legacy_scaling:
            rope_params.update(legacy_scaling)
        _check_full_rotary(config, rope_params, where)
        rope_params.pop("partial_rotary_factor", None)
        rope_theta = rope_params.pop("rope_theta", config.get("rope_theta", 10000.0))
        numbers["rope_theta"] = check_float("rope_theta", rope_theta,
                                            *FLOAT_LIMITS["rope_theta"], where)
        try:
            scaling = rope_lib.normalize(rope_params)
        except ValueError as error:
            raise ValueError(f"{prefix}{error}") from None
        biased = bool(config.get("attention_bias", False))
        is_qwen2 = arch == "Qwen2ForCausalLM"
        gen = generation_fields(generation_config)
        window = _uniform_window(arch, config, numbers["num_layers"], where)
        ids, id_names = special_token_ids(config, gen)
        check_llama_numbers({**numbers, "sliding_window": window, **ids},
                            {**HF_NAMES, **id_names}, where)
        return cls(
            **numbers,
            rope_scaling=scaling,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=True if is_qwen2 else biased,
            attention_out_bias=False if is_qwen2 else biased,
            qk_norm=arch == "Qwen3ForCausalLM",
            **ids,
            generation_defaults=freeze(gen),
            architecture=arch,
            sliding_window=window,
        )


# LlamaConfig field -> config.json key (the names the checks' messages show)
HF_NAMES = {"vocab_size": "vocab_size", "hidden_size": "hidden_size",
            "intermediate_size": "intermediate_size", "num_layers": "num_hidden_layers",
            "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads",
            "head_dim": "head_dim", "rms_norm_eps": "rms_norm_eps", "rope_theta": "rope_theta",
            "max_position_embeddings": "max_position_embeddings",
            "sliding_window": "sliding_window", "num_mtp_layers": "num_mtp_layers"}
_HF_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads")


def _hf_numbers(config: dict, where: str) -> dict:
    """The config.json numbers, each checked against its range (missing required ones, a
    wrong type or an out-of-range value: ValueError naming the key and what is allowed)."""
    prefix = f"{where}: " if where else ""
    numbers = {}
    for field in (*_HF_REQUIRED, "num_kv_heads", "head_dim", "max_position_embeddings"):
        key = HF_NAMES[field]
        value = config.get(key)
        if value is None:
            if field in _HF_REQUIRED:
                low, high = INT_LIMITS[field]
                raise ValueError(f"{prefix}config.json has no {key!r}; allowed: an int in "
                                 f"[{low}, {high}]")
            continue
        numbers[field] = check_int(key, value, *INT_LIMITS[field], where)
    numbers.setdefault("max_position_embeddings", 2048)
    numbers["rms_norm_eps"] = check_float("rms_norm_eps", config.get("rms_norm_eps", 1e-6),
                                          *FLOAT_LIMITS["rms_norm_eps"], where)
    mtp_key = "num_mtp_layers" if config.get("num_mtp_layers") is not None \
        else "num_nextn_predict_layers"
    numbers["num_mtp_layers"] = check_int(mtp_key, config.get(mtp_key) or 0,
                                          *INT_LIMITS["num_mtp_layers"], where)
    return numbers


_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def _check_full_rotary(config: dict, rope_params: dict, where: str) -> None:
    """ValueError unless `partial_rotary_factor` (top level, or in rope_parameters /
    rope_scaling) is absent or 1: the Llama family rotates every head dimension."""
    for key, source in (("partial_rotary_factor", config),
                        ("rope_parameters.partial_rotary_factor", rope_params)):
        factor = source.get("partial_rotary_factor")
        if factor is not None and (not isinstance(factor, (int, float)) or isinstance(
                factor, bool) or factor != 1):
            prefix = f"{where}: " if where else ""
            raise ValueError(f"{prefix}{key}={factor!r}; allowed: 1.0 (partial RoPE is not "
                             f"implemented for the Llama family)")


def _uniform_window(arch: str, config: dict, layers: int, where: str = "") -> int | None:
    """The sliding window every layer uses (None: full attention everywhere).

    Qwen2/Qwen3 slide only with use_sliding_window, and only layers >= max_window_layers (or
    those HF's `layer_types` marks); a mix of sliding and full layers is not supported.
    layers: num_hidden_layers, already checked.
    """
    prefix = f"{where}: " if where else ""
    window = config.get("sliding_window")
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        if not config.get("use_sliding_window", False) or window is None:
            return None
        first = check_int("max_window_layers", config.get("max_window_layers", layers), 0,
                          INT_LIMITS["num_layers"][1], where)
        types = config.get("layer_types") or [
            "sliding_attention" if i >= first else "full_attention" for i in range(layers)]
        if not isinstance(types, list) or len(types) != layers:
            raise ValueError(f"{prefix}layer_types must list num_hidden_layers={layers} "
                             f"attention types")
        if all(t == "full_attention" for t in types):
            return None
        if not all(t == "sliding_attention" for t in types):
            raise ValueError(f"{prefix}{arch}: sliding windows on some layers only "
                             f"(max_window_layers={config.get('max_window_layers')}) are not "
                             f"supported")
    return window


def _rotate_half(x: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)  # [..., Dh]


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [B, S, N, Dh]; cos, sin: [B, S, Dh] in x's dtype (HF's rotate_half convention)."""
    return x * cos[:, :, None] + _rotate_half(x) * sin[:, :, None]  # [B, S, N, Dh]


def uniform_cache(cfg, kind: str, batch: int, max_len: int, dtype, cache_config) -> Cache:
    """An empty cache of `kind` for a model whose layers share one KV shape: `cfg` holds
    num_layers, num_kv_heads, head_dim and sliding_window (a LlamaConfig or alike)."""
    if kind not in CACHE_KINDS:
        raise ValueError(f"unknown cache kind {kind!r}; allowed: {', '.join(CACHE_KINDS)}")
    return make_cache(kind, num_layers=cfg.num_layers, batch=batch, max_len=max_len,
                      num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=dtype,
                      sliding_window=cfg.sliding_window, cache_config=cache_config)


@dataclasses.dataclass(frozen=True)
class Llama:
    """Llama-family decoder. Hashable; usable as a static jit argument."""

    config: LlamaConfig
    weight_formats = ("float", "int8")  # what load(..., weights=) may give this family

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32,
                   kind: str = "static", cache_config: dict | None = None) -> Cache:
        """An empty cache of `kind` (jaxgen.cache.CACHE_KINDS, HF's cache_implementation
        names) for `max_len` positions; the static kind holds k, v [L, batch, Hkv, max_len,
        Dh] (heads-major)."""
        return uniform_cache(self.config, kind, batch, max_len, dtype, cache_config)

    def init_params(self, key: jax.Array, dtype=jnp.float32) -> dict:
        """Random parameters (normal, std 0.02; norms at 1) in the params layout above."""
        cfg = self.config
        L, D, F, V = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
        qd, kd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        shapes = {"wq": (L, D, qd), "wk": (L, D, kd), "wv": (L, D, kd), "wo": (L, qd, D),
                  "w_gate": (L, D, F), "w_up": (L, D, F), "w_down": (L, F, D)}
        if cfg.attention_bias:
            shapes.update(bq=(L, qd), bk=(L, kd), bv=(L, kd))
        if cfg.attention_out_bias:
            shapes.update(bo=(L, D))
        keys = jax.random.split(key, len(shapes) + 2)
        layers = {name: (0.02 * jax.random.normal(k, shape)).astype(dtype)
                  for k, (name, shape) in zip(keys[2:], sorted(shapes.items()))}
        layers["attn_norm"] = jnp.ones((L, D), dtype)
        layers["mlp_norm"] = jnp.ones((L, D), dtype)
        if cfg.qk_norm:
            layers["q_norm"] = jnp.ones((L, cfg.head_dim), dtype)
            layers["k_norm"] = jnp.ones((L, cfg.head_dim), dtype)
        params = {"embed": (0.02 * jax.random.normal(keys[0], (V, D))).astype(dtype),
                  "layers": layers, "final_norm": jnp.ones((D,), dtype)}
        if not cfg.tie_word_embeddings:
            params["lm_head"] = (0.02 * jax.random.normal(keys[1], (D, V))).astype(dtype)
        return params

    def check_params(self, params: Any) -> None:
        """Raises ValueError naming the first parameter that does not fit this model.

        Accepts both layouts the forward runs: stacked (`init_params`, the loaders: each
        `layers` entry [L, ...]) and unstacked (`unstack_layers`: `layers` a list of L dicts).
        A missing or unexpected key, a wrong shape, or a wrong number of layers is an error;
        `lm_head` [D, V] is optional when the embeddings are tied. Host-only: it reads
        `.shape`, so arrays, jax.ShapeDtypeStruct and tracers all work, with no device work.

        Example:
            >>> model = Llama(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
            ...                           num_layers=1, num_heads=2, num_kv_heads=2, head_dim=8))
            >>> model.check_params(model.init_params(jax.random.key(0)))      # fits: None
            >>> deeper = Llama(dataclasses.replace(model.config, num_layers=2))
            >>> shapes = jax.eval_shape(deeper.init_params, jax.random.key(0))
            >>> model.check_params(shapes)                 # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            ValueError: params['layers']['attn_norm'] has shape (2, 16), expected (1, 16) ...
        """
        expected = _expected_shapes(self.config)
        if not isinstance(params, Mapping):
            raise ValueError(f"params is a {type(params).__name__}, expected a dict with keys "
                             f"{sorted(expected)}")
        optional = {"lm_head": (self.config.hidden_size, self.config.vocab_size)} \
            if self.config.tie_word_embeddings else {}
        if "exit_adapters" in params:
            self._check_exit_adapters(params["exit_adapters"])
            params = {k: v for k, v in params.items() if k != "exit_adapters"}
        if "mtp" in params:  # the checkpoint's MTP layers (jaxgen/models/mtp.py)
            self._check_mtp(params["mtp"])
            params = {k: v for k, v in params.items() if k != "mtp"}
        elif self.config.num_mtp_layers:
            raise ValueError(f"params have no 'mtp' entry, but the model has num_mtp_layers="
                             f"{self.config.num_mtp_layers}: add its MTP layers' weights "
                             f"(jaxgen.models.mtp.init_mtp_params, or load the checkpoint)")
        _check_keys(params, expected, optional, "params")
        for key, shape in {**expected, **optional}.items():
            if key == "layers" or key not in params:
                continue
            _check_shape(params[key], shape, f"params[{key!r}]")
        layers, per_layer = params["layers"], expected["layers"]
        if isinstance(layers, Mapping):  # stacked
            _check_keys(layers, per_layer, {}, "params['layers']")
            for key, shape in per_layer.items():
                _check_shape(layers[key], shape, f"params['layers'][{key!r}]")
            return
        if not isinstance(layers, (list, tuple)):
            raise ValueError(f"params['layers'] is a {type(layers).__name__}, expected a dict "
                             f"(stacked) or a list of per-layer dicts (unstack_layers)")
        if len(layers) != self.config.num_layers:
            raise ValueError(f"params['layers'] is a list of {len(layers)} layer(s), expected "
                             f"{self.config.num_layers} for this model")
        unstacked = {key: shape[1:] for key, shape in per_layer.items()}
        for index, layer in enumerate(layers):
            where = f"params['layers'][{index}]"
            if not isinstance(layer, Mapping):
                raise ValueError(f"{where} is a {type(layer).__name__}, expected a dict")
            _check_keys(layer, unstacked, {}, where)
            for key, shape in unstacked.items():
                _check_shape(layer[key], shape, f"{where}[{key!r}]")

    def _check_mtp(self, mtp: Any) -> None:
        """params["mtp"]: the MTP depths' weights, stacked over config.num_mtp_layers."""
        depths = self.config.num_mtp_layers
        if depths < 1:
            raise ValueError("params carry 'mtp' (MTP layers) but the model's config has "
                             "num_mtp_layers=0; set it to the number of MTP depths")
        shapes = mtp_shapes(self.config, _expected_shapes(self.config)["layers"])
        for where, tree, expected in (("params['mtp']", mtp, shapes),
                                      ("params['mtp']['layers']", None, shapes["layers"])):
            tree = mtp.get("layers") if tree is None else tree
            if not isinstance(tree, Mapping):
                raise ValueError(f"{where} is a {type(tree).__name__}, expected a dict with "
                                 f"keys {sorted(expected)}")
            _check_keys(tree, expected, {}, where)
            for key, shape in expected.items():
                if key != "layers":
                    _check_shape(tree[key], shape, f"{where}[{key!r}]")

    def _check_exit_adapters(self, adapters: Any) -> None:
        """params["exit_adapters"]: {str(E): adapter} with 1 <= E < num_layers."""
        if not isinstance(adapters, Mapping):
            raise ValueError(f"params['exit_adapters'] is a {type(adapters).__name__}, expected "
                             f"a dict {{str(exit layer): adapter}}")
        for name, adapter in adapters.items():
            where = f"params['exit_adapters'][{name!r}]"
            if not (isinstance(name, str) and name.isdigit()
                    and 1 <= int(name) < self.config.num_layers):
                raise ValueError(f"{where}: keys are exit layers as strings, '1' .. "
                                 f"'{self.config.num_layers - 1}'")
            if not isinstance(adapter, Mapping) or "w_in" not in adapter:
                raise ValueError(f"{where} must be a dict with 'norm', 'w_in', 'w_out'")
            width = adapter["w_in"].shape[-1]
            shapes = exit_adapter_shapes(self.config.hidden_size, width)
            _check_keys(adapter, shapes, {}, where)
            for key, shape in shapes.items():
                _check_shape(adapter[key], shape, f"{where}[{key!r}]")

    def __call__(self, params: dict, tokens: jax.Array, positions: jax.Array, cache: Cache, *,
                 exit_layer: int | None = None,
                 logits_index: jax.Array | None = None,
                 tree_mask: jax.Array | None = None) -> ModelOutput:
        """One forward over S new tokens per row, writing their K/V into `cache` at `positions`.

        tokens, positions: int32 [B, S]. exit_layer (static): run only the first exit_layer
        layers. logits_index: optional int32 [B, S'] of sequence indices that get logits.
        tree_mask: optional bool [B, S, S], a token tree (jaxgen.speculative.tree): positions
        are then the contiguous slots the K/V go to, token s sees the earlier cache and the
        tokens j with tree_mask[b, s, j] (its ancestors and itself), and its RoPE position is
        positions[:, 0] + its depth (sum_j tree_mask[b, s, j] - 1).
        Returns ModelOutput(logits [B, S', V] f32, hidden [B, S, D] (pre final norm), cache)
        with cache.length = positions[:, -1] + 1.
        """
        cfg = self.config
        num_layers = cfg.num_layers if exit_layer is None else int(exit_layer)
        if not 1 <= num_layers <= cfg.num_layers:
            raise ValueError(f"exit_layer={exit_layer} must be in [1, {cfg.num_layers}]")
        x = self.embed(params, tokens)  # [B, S, D]
        if tree_mask is None:
            x, cache = self.run_layers(params, x, positions, cache, 0, num_layers)  # [B, S, D]
        else:
            x, cache = self.run_layers(params, x, positions, cache, 0, num_layers,
                                       tree_mask=tree_mask)  # [B, S, D]
        hidden = x  # [B, S, D]
        if logits_index is not None:
            x = jnp.take_along_axis(x, logits_index[:, :, None].astype(jnp.int32),
                                    axis=1)  # [B, S', D]
        logits = self.head(params, x)  # [B, S', V]
        cache = cache.with_length(positions[:, -1] + 1)
        return ModelOutput(logits=logits, hidden=hidden, cache=cache)

    def embed(self, params: dict, tokens: jax.Array) -> jax.Array:
        """Input embeddings: tokens int32 [B, S] -> [B, S, D]."""
        return jnp.take(params["embed"], tokens, axis=0)  # [B, S, D]

    def run_layers(self, params: dict, x: jax.Array, positions: jax.Array, cache: Cache,
                   start: int, stop: int, *, tree_mask: jax.Array | None = None
                   ) -> tuple[jax.Array, Cache]:
        """Decoder layers [start, stop) (static) over hidden states x [B, S, D] at
        `positions` [B, S], writing those layers' K/V into `cache` (its length unchanged).
        Self-speculative early exit runs [0, E) to draft and [E, L) to verify. tree_mask:
        bool [B, S, S] or None (see __call__)."""
        cfg = self.config
        if not 0 <= start <= stop <= cfg.num_layers:
            raise ValueError(f"layers [{start}, {stop}) are not inside [0, {cfg.num_layers}]")
        if start == stop:
            return x, cache
        rotated = positions
        if tree_mask is not None:  # a token tree: RoPE by depth below the block's first slot
            depth = jnp.sum(tree_mask, axis=-1, dtype=jnp.int32) - 1  # [B, S]
            rotated = positions[:, :1] + depth  # [B, S]
        rope = functools.partial(rope_lib.cos_sin, head_dim=cfg.head_dim, theta=cfg.rope_theta,
                                 scaling=cfg.rope_scaling,
                                 max_position_embeddings=cfg.max_position_embeddings,
                                 dtype=x.dtype)
        cos, sin = computed_once(cache, rope, rotated)  # [B, S, Dh] each
        block = self._block if tree_mask is None else functools.partial(
            self._block, tree_mask=tree_mask)
        layers = params["layers"]
        per_layer = isinstance(layers, (list, tuple))  # unstacked (see unstack_layers)
        if per_layer or holds_layer_tuples(cache):  # unrolled: per-layer buffers need static indices
            for index in range(start, stop):
                layer = layers[index] if per_layer else jax.tree_util.tree_map(
                    lambda a, i=index: a[i], layers)
                x, cache = block(layer, index, x, cos, sin, positions, cache)
            return x, cache
        if (start, stop) != (0, cfg.num_layers):
            layers = jax.tree_util.tree_map(lambda a: a[start:stop], layers)

        def layer_step(carry, scanned):
            h, kv = carry
            layer_params, index = scanned
            h, kv = block(layer_params, index, h, cos, sin, positions, kv)
            return (h, kv), None

        layer_ids = jnp.arange(start, stop, dtype=jnp.int32)  # [stop - start]
        (x, cache), _ = jax.lax.scan(layer_step, (x, cache), (layers, layer_ids))
        return x, cache

    def mtp_layers(self) -> MtpLayers | None:
        """The checkpoint's MTP layers (jaxgen/models/mtp.py; weights in params["mtp"]), or None when
        config.num_mtp_layers is 0. use_mtp=True drafts with them."""
        return MtpLayers(self) if self.config.num_mtp_layers > 0 else None

    def exit_head(self, params: dict, hidden: jax.Array, layer: int) -> jax.Array:
        """Early-exit logits from layer `layer`'s hidden [B, S, D]: the exit adapter of that
        layer when params carry one (params["exit_adapters"][str(layer)]), then the shared
        final norm and head. [B, S, V] float32."""
        adapter = (params.get("exit_adapters") or {}).get(str(int(layer)))
        if adapter is not None and layer < self.config.num_layers:
            hidden = apply_exit_adapter(adapter, hidden, self.config.rms_norm_eps)
        return self.head(params, hidden)

    def head(self, params: dict, hidden: jax.Array) -> jax.Array:
        """Final norm + LM head: hidden [B, S, D] -> logits [B, S, V] float32. A tied head
        (no params["lm_head"]) reads the embedding [V, D]; an untied one is a [D, V] array, or
        a weight object (quantized, or laid out by a backend) that `normed @ head` multiplies."""
        normed = rms_norm(hidden, params["final_norm"], self.config.rms_norm_eps)  # [B, S, D]
        head = params.get("lm_head")
        if head is None:
            return jnp.einsum("bsd,vd->bsv", normed, params["embed"],
                              preferred_element_type=jnp.float32)  # [B, S, V]
        if isinstance(head, jax.Array):
            return jnp.einsum("bsd,dv->bsv", normed, head,
                              preferred_element_type=jnp.float32)  # [B, S, V]
        return (normed @ head).astype(jnp.float32)  # [B, S, V]

    def _block(self, p: dict, index: jax.Array, x: jax.Array, cos: jax.Array, sin: jax.Array,
               positions: jax.Array, cache: Cache, tree_mask: jax.Array | None = None
               ) -> tuple[jax.Array, Cache]:
        """One decoder layer: pre-norm attention then pre-norm SwiGLU MLP, both residual."""
        cfg = self.config
        batch, seq, _ = x.shape
        h = rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)  # [B, S, D]
        if "wqkv" in p:  # a backend's fused projections: one matrix
            q_width, kv_width = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            qkv = h @ p["wqkv"]  # [B, S, (H + 2K) * Dh]
            q, k, v = jnp.split(qkv, [q_width, q_width + kv_width], axis=-1)  # [B, S, H*Dh], ...
        else:
            q = h @ p["wq"]  # [B, S, H*Dh]
            k = h @ p["wk"]  # [B, S, K*Dh]
            v = h @ p["wv"]  # [B, S, K*Dh]
        if cfg.attention_bias:
            q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
        q = q.reshape(batch, seq, cfg.num_heads, cfg.head_dim)  # [B, S, H, Dh]
        k = k.reshape(batch, seq, cfg.num_kv_heads, cfg.head_dim)  # [B, S, K, Dh]
        v = v.reshape(batch, seq, cfg.num_kv_heads, cfg.head_dim)  # [B, S, K, Dh]
        if cfg.qk_norm:
            q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)  # [B, S, H, Dh]
            k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)  # [B, S, K, Dh]
        q = apply_rope(q, cos, sin)  # [B, S, H, Dh]
        k = apply_rope(k, cos, sin)  # [B, S, K, Dh]
        tree = {} if tree_mask is None else {"tree_mask": tree_mask}  # only dense caches take it
        attn, cache = cache.update_attend(index, q, k, v, positions, scale=cfg.head_dim ** -0.5,
                                          window=cfg.sliding_window, **tree)  # [B, S, H, Dh]
        out = attn.reshape(batch, seq, cfg.num_heads * cfg.head_dim) @ p["wo"]  # [B, S, D]
        if cfg.attention_out_bias:
            out = out + p["bo"]
        x = x + out  # [B, S, D]
        h = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)  # [B, S, D]
        if "w_gate_up" in p:  # a backend's fused projections: one matrix
            gate, up = jnp.split(h @ p["w_gate_up"], 2, axis=-1)  # [B, S, F] each
        else:
            gate, up = h @ p["w_gate"], h @ p["w_up"]  # [B, S, F] each
        gated = jax.nn.silu(gate) * up  # [B, S, F]
        return x + gated @ p["w_down"], cache  # [B, S, D]


def checked_params(params: dict, expected: dict, dtype, where: str = "") -> dict:
    """Host arrays -> jax arrays of `dtype`, checking every shape against `expected`
    (param_shapes). where: a prefix for the error message (e.g. the file's path)."""
    out = {}
    for key, value in params.items():
        if isinstance(value, dict):
            out[key] = checked_params(value, expected[key], dtype, where)
            continue
        if tuple(value.shape) != tuple(expected[key]):
            prefix = f"{where}: " if where else ""
            raise ValueError(f"{prefix}tensor for {key!r} has shape {tuple(value.shape)}, "
                             f"expected {tuple(expected[key])}")
        out[key] = jnp.asarray(np.asarray(value, dtype=np.float32), dtype=dtype)
    return out


def param_shapes(config: LlamaConfig) -> dict:
    """The expected shape of every parameter, stacked layout (for loaders' checks)."""
    expected = _expected_shapes(config)
    return {key: dict(value) if isinstance(value, dict) else value
            for key, value in expected.items()}


@functools.lru_cache(maxsize=64)
def _expected_shapes(config: LlamaConfig) -> dict:
    """param_shapes, traced once per config (shared: callers must not modify it)."""
    model = Llama(config)
    return jax.tree_util.tree_map(lambda a: tuple(a.shape),
                                  jax.eval_shape(lambda: model.init_params(jax.random.key(0))))


def _check_keys(tree: Mapping, expected: dict, optional: dict, path: str) -> None:
    """ValueError for the first key of `expected` missing from `tree`, then for the first key
    of `tree` in neither `expected` nor `optional`."""
    for key, shape in expected.items():
        if key not in tree:
            wanted = "" if isinstance(shape, dict) else f" (expected shape {shape})"
            raise ValueError(f"{path} has no key {key!r}{wanted} for this model")
    for key in tree:
        if key not in expected and key not in optional:
            raise ValueError(f"{path} has an unexpected key {key!r}; this model uses "
                             f"{', '.join(sorted((*expected, *optional)))}")


def _check_shape(value: Any, shape: tuple, path: str) -> None:
    got = getattr(value, "shape", None)
    if got is None:
        raise ValueError(f"{path} is a {type(value).__name__}, expected an array of shape "
                         f"{tuple(shape)} for this model")
    if tuple(got) != tuple(shape):
        raise ValueError(f"{path} has shape {tuple(got)}, expected {tuple(shape)} for this model")


def unstack_layers(model: Llama, params: dict) -> dict:
    """The same weights with one buffer per layer: `params["layers"]` a list of per-layer
    dicts, which the forward unrolls.

    The stacked layout ([L, ...] arrays run by `lax.scan`) compiles fast; the per-layer one
    hands each matmul its weight in place (XLA:CPU copies a stacked layer's slice before its
    matmuls) at a longer compile. Outputs equal the stacked layout's up to float rounding.
    A backend may lay per-layer params out further for decoding (`jaxgen.runtime.backend`).

    Example:
        >>> model = Llama(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...                           num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8,
        ...                           tie_word_embeddings=True))
        >>> params = model.init_params(jax.random.key(0))
        >>> fast = unstack_layers(model, params)
        >>> len(fast["layers"]), fast["layers"][0]["wq"].shape, "lm_head" in fast
        (2, (16, 16), False)
        >>> model.check_params(fast)                   # both layouts fit the model
        >>> tokens, positions = jnp.array([[3, 1, 4]]), jnp.arange(3)[None]
        >>> slow_out = model(params, tokens, positions, model.init_cache(1, 4))
        >>> fast_out = model(fast, tokens, positions, model.init_cache(1, 4))
        >>> bool(jnp.allclose(slow_out.logits, fast_out.logits, atol=1e-5))
        True
    """
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        return params
    count = model.config.num_layers
    per_layer = [jax.tree_util.tree_map(lambda array, i=i: jnp.array(array[i]), layers)
                 for i in range(count)]  # quantized matrices (Int8Matrix, ...) slice leafwise
    return dict(params, layers=per_layer)

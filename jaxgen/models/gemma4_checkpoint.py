"""Gemma 4 HF folders: `load_gemma4(folder, dtype)` for config.json model_type "gemma4_text"
(Gemma4ForCausalLM) and "gemma4" (Gemma4ForConditionalGeneration: its text model; the vision
and audio towers' tensors are recognised and not loaded, with one warning line: jaxgen
generates from text only).

`gemma4_config(config)` turns a parsed Gemma4TextConfig dict into a `Gemma4Config`, refusing
(ValueError naming the config.json field and the allowed values) what jaxgen does not
implement: enable_moe_block, use_bidirectional_attention, attention_bias, another
hidden_activation than gelu_pytorch_tanh, RoPE types other than "default" / "proportional".

Example:
    >>> config = gemma4_config({"vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
    ...     "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
    ...     "head_dim": 4, "global_head_dim": 8, "sliding_window": 4,
    ...     "hidden_size_per_layer_input": 0, "layer_types": ["sliding_attention",
    ...     "full_attention"]})
    >>> config.head_dims, config.kv_heads
    ((4, 8), (1, 1))
    >>> gemma4_config({"vocab_size": 32, "enable_moe_block": True})
    Traceback (most recent call last):
    ...
    ValueError: enable_moe_block=True is not supported by jaxgen's Gemma 4 (allowed: false)
"""
from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np

from jaxgen.models.checkpoint_checks import check_load_dtype
from jaxgen.models.checkpoint_files import read_json_object
from jaxgen.models.config_checks import (
    FLOAT_LIMITS,
    INT_LIMITS,
    check_float,
    check_int,
    check_llama_numbers,
    generation_fields,
    refuse_quantization,
    special_token_ids,
)
from jaxgen.models.gemma4 import LAYER_TYPES, ROPE_TYPES, Gemma4, Gemma4Config
from jaxgen.models.hf_checkpoint import read_hf_tensors
from jaxgen.models.rope import freeze
from jaxgen.models.tokenizer import Tokenizer

__all__ = ["MODEL_TYPES", "gemma4_config", "gemma4_params", "load_gemma4", "read_config"]

MODEL_TYPES = ("gemma4_text", "gemma4")
_TEXT_PREFIXES = ("model.language_model.", "model.")  # gemma4, gemma4_text
_TOWER_PREFIXES = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.",
                   "model.embed_audio.")
_DEFAULT_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                 "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                    "rope_theta": 1_000_000.0}}


def _refuse(config: dict, key: str, allowed, default, where: str) -> None:
    value = config.get(key, default)
    if value not in allowed:
        raise ValueError(f"{where}{key}={json.dumps(value)} is not supported by jaxgen's Gemma 4 (allowed: "
                         f"{', '.join(json.dumps(a) for a in allowed)})")


def _rope(params: dict, kind: str, where: str) -> tuple:
    if not isinstance(params, dict):
        raise ValueError(f"{where}rope_parameters[{kind!r}]={params!r}; allowed: an object")
    rope_type = params.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"{where}rope_parameters[{kind!r}]['rope_type']={rope_type!r}; "
                         f"allowed: {', '.join(ROPE_TYPES)}")
    theta = check_float("rope_theta", params.get("rope_theta", 10_000.0),
                        *FLOAT_LIMITS["rope_theta"], where.rstrip(": "))
    fraction = check_float("partial_rotary_factor", params.get("partial_rotary_factor", 1.0),
                           0.0, 1.0, where.rstrip(": "), low_included=True)
    factor = check_float("factor", params.get("factor", 1.0), 0.0, 1e6, where.rstrip(": "))
    return (rope_type, theta, fraction if rope_type == "proportional" else 1.0,
            factor if rope_type == "proportional" else 1.0)


def gemma4_config(config: dict, generation_config: dict | None = None,
                  where: str = "") -> Gemma4Config:
    """A Gemma4Config from a parsed Gemma4TextConfig dict (config.json, or its text_config)."""
    prefix = f"{where}: " if where else ""
    if config.get("enable_moe_block"):
        raise ValueError(f"{prefix}enable_moe_block=True is not supported by jaxgen's Gemma 4 "
                         f"(allowed: false)")
    refuse_quantization(config, where)
    _refuse(config, "use_bidirectional_attention", (None,), None, prefix)
    _refuse(config, "attention_bias", (False,), False, prefix)
    _refuse(config, "hidden_activation", ("gelu_pytorch_tanh",), "gelu_pytorch_tanh", prefix)
    where_name = where or "config.json"

    def number(key, limits, default=None):
        value = config.get(key, default)
        if value is None:
            raise ValueError(f"{prefix}config.json has no {key!r}; allowed: an int in "
                             f"[{limits[0]}, {limits[1]}]")
        return check_int(key, value, *limits, where_name)

    layers = number("num_hidden_layers", INT_LIMITS["num_layers"])
    heads = number("num_attention_heads", INT_LIMITS["num_heads"])
    kv = number("num_key_value_heads", INT_LIMITS["num_kv_heads"], heads)
    head_dim = number("head_dim", INT_LIMITS["head_dim"], 256)
    types = config.get("layer_types")
    if types is None:
        types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or \
            any(t not in LAYER_TYPES for t in types):
        raise ValueError(f"{prefix}layer_types must list num_hidden_layers={layers} entries "
                         f"from {', '.join(LAYER_TYPES)}")
    types = list(types[:-1]) + ["full_attention"]  # HF forces the last layer to full
    per_layer = config.get("per_layer_config")
    if per_layer is None:  # HF's defaults: full layers take global_head_dim (and kv heads)
        override = {"head_dim": config.get("global_head_dim", 512)}
        if config.get("num_global_key_value_heads") is not None and \
                config.get("attention_k_eq_v", False):
            override["num_key_value_heads"] = config["num_global_key_value_heads"]
        per_layer = {str(i): override for i, t in enumerate(types) if t == "full_attention"}
    if not isinstance(per_layer, dict):
        raise ValueError(f"{prefix}per_layer_config={per_layer!r}; allowed: an object")
    head_dims, kv_heads = [head_dim] * layers, [kv] * layers
    for key, override in per_layer.items():
        if not str(key).isdigit() or not 0 <= int(key) < layers or \
                not isinstance(override, dict):
            raise ValueError(f"{prefix}per_layer_config key {key!r}; allowed: layer indices "
                             f"0..{layers - 1} mapping to objects")
        extra = sorted(set(override) - {"head_dim", "num_key_value_heads"})
        if extra:
            raise ValueError(f"{prefix}per_layer_config[{key!r}] overrides {extra}; allowed: "
                             f"head_dim, num_key_value_heads")
        i = int(key)
        head_dims[i] = check_int("head_dim", override.get("head_dim", head_dim),
                                 *INT_LIMITS["head_dim"], where_name)
        kv_heads[i] = check_int("num_key_value_heads", override.get("num_key_value_heads", kv),
                                *INT_LIMITS["num_kv_heads"], where_name)
    rope_params = config.get("rope_parameters") or _DEFAULT_ROPE
    if not isinstance(rope_params, dict):
        raise ValueError(f"{prefix}rope_parameters={rope_params!r}; allowed: an object per "
                         f"layer type")
    rope = tuple(sorted((kind, _rope(rope_params.get(kind), kind, prefix))
                        for kind in set(types)))
    ple = check_int("hidden_size_per_layer_input", config.get("hidden_size_per_layer_input", 256)
                    or 0, 0, 2**16, where_name)
    cap = config.get("final_logit_softcapping")
    if cap is not None:
        cap = check_float("final_logit_softcapping", cap, 0.0, 1e6, where_name)
    for key in ("tie_word_embeddings", "attention_k_eq_v", "use_double_wide_mlp"):
        if not isinstance(config.get(key, False), bool):
            raise ValueError(f"{prefix}{key}={config[key]!r}; allowed: true or false")
    gen = generation_fields(generation_config)
    vocab = number("vocab_size", INT_LIMITS["vocab_size"], 262_144)
    ids, id_names = special_token_ids(  # Gemma4TextConfig's defaults
        config, gen, {"bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0})
    check_llama_numbers({"vocab_size": vocab, **ids}, id_names, where_name)
    return Gemma4Config(
        vocab_size=vocab,
        hidden_size=number("hidden_size", INT_LIMITS["hidden_size"], 2304),
        intermediate_size=number("intermediate_size", INT_LIMITS["intermediate_size"], 9216),
        num_heads=heads, layer_types=tuple(types), head_dims=tuple(head_dims),
        kv_heads=tuple(kv_heads),
        sliding_window=number("sliding_window", INT_LIMITS["sliding_window"], 512),
        rms_norm_eps=check_float("rms_norm_eps", config.get("rms_norm_eps", 1e-6),
                                 *FLOAT_LIMITS["rms_norm_eps"], where_name),
        rope=rope,
        max_position_embeddings=number("max_position_embeddings",
                                       INT_LIMITS["max_position_embeddings"], 131_072),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
        final_logit_softcapping=cap, hidden_size_per_layer_input=ple,
        vocab_size_per_layer_input=number("vocab_size_per_layer_input",
                                          (0, INT_LIMITS["vocab_size"][1]), 262_144) if ple
        else 0,
        attention_k_eq_v=bool(config.get("attention_k_eq_v", False)),
        num_kv_shared_layers=check_int("num_kv_shared_layers",
                                       config.get("num_kv_shared_layers", 0) or 0, 0, layers - 1,
                                       where_name),
        use_double_wide_mlp=bool(config.get("use_double_wide_mlp", False)),
        **ids, generation_defaults=freeze(gen))


def read_config(folder: str) -> tuple[dict, dict | None, str]:
    """(text config dict, generation_config dict or None, model_type) of a Gemma 4 folder."""
    path = os.path.join(folder, "config.json")
    config = read_json_object(path)
    refuse_quantization(config, path)  # the top level's (text_config's: gemma4_config)
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"{path}: model_type={model_type!r}; allowed: {', '.join(MODEL_TYPES)}")
    text = config.get("text_config") if model_type == "gemma4" else config
    if not isinstance(text, dict):
        raise ValueError(f"{path}: text_config={text!r}; allowed: an object")
    generation = read_json_object(os.path.join(folder, "generation_config.json"), required=False)
    return text, generation, model_type


# params key -> HF tensor name (under the text prefix); per layer under layers.{i}.
_TOP = {"embed": "embed_tokens.weight", "final_norm": "norm.weight",
        "ple_embed": "embed_tokens_per_layer.weight",
        "ple_projection": "per_layer_model_projection.weight",
        "ple_projection_norm": "per_layer_projection_norm.weight"}
_LAYER = {"attn_norm": "input_layernorm.weight", "wq": "self_attn.q_proj.weight",
          "q_norm": "self_attn.q_norm.weight", "wk": "self_attn.k_proj.weight",
          "k_norm": "self_attn.k_norm.weight", "wv": "self_attn.v_proj.weight",
          "wo": "self_attn.o_proj.weight", "post_attn_norm": "post_attention_layernorm.weight",
          "mlp_norm": "pre_feedforward_layernorm.weight", "w_gate": "mlp.gate_proj.weight",
          "w_up": "mlp.up_proj.weight", "w_down": "mlp.down_proj.weight",
          "post_mlp_norm": "post_feedforward_layernorm.weight", "layer_scalar": "layer_scalar",
          "ple_gate": "per_layer_input_gate.weight", "ple_up": "per_layer_projection.weight",
          "ple_norm": "post_per_layer_input_norm.weight"}
_TRANSPOSED = {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "ple_gate", "ple_up",
               "ple_projection"}


def gemma4_params(model: Gemma4, tensors: Mapping, prefix: str, dtype=jnp.float32,
                  where: str = "") -> dict:
    """The params tree from HF tensors named `prefix` + HF's names (shapes checked)."""
    shapes = model.param_shapes()
    lead = f"{where}: " if where else ""

    def read(name: str, key: str, shape: tuple):
        full = prefix + name
        if full not in tensors:
            raise ValueError(f"{lead}the checkpoint has no tensor {full!r} (expected shape "
                             f"{shape})")
        array = np.asarray(tensors[full], dtype=np.float32)
        if key in _TRANSPOSED:
            array = array.T
        if key == "lm_head":
            array = array.T
        if tuple(array.shape) != tuple(shape):
            raise ValueError(f"{lead}tensor {full!r} has shape {tuple(array.shape)}, expected "
                             f"{tuple(shape)} for this config")
        return jnp.asarray(array, dtype)

    params = {key: read(_TOP[key], key, shape) for key, shape in shapes.items()
              if key in _TOP}
    if "lm_head" in shapes:
        params["lm_head"] = read_lm_head(tensors, shapes["lm_head"], dtype, lead)
    params["layers"] = [{key: read(f"layers.{i}.{_LAYER[key]}", key, shape)
                         for key, shape in layer.items()}
                        for i, layer in enumerate(shapes["layers"])]
    return params


def read_lm_head(tensors: Mapping, shape: tuple, dtype, lead: str):
    if "lm_head.weight" not in tensors:
        raise ValueError(f"{lead}tie_word_embeddings is false but there is no 'lm_head.weight'")
    array = np.asarray(tensors["lm_head.weight"], dtype=np.float32).T
    if tuple(array.shape) != tuple(shape):
        raise ValueError(f"{lead}'lm_head.weight' has shape {array.shape[::-1]}, expected "
                         f"{tuple(shape)[::-1]}")
    return jnp.asarray(array, dtype)


def load_gemma4(folder: str, dtype=jnp.float32) -> tuple[Gemma4, dict, Tokenizer | None]:
    """(model, params, tokenizer or None) from a Gemma 4 folder ("gemma4_text" or the text
    model of "gemma4"). Unused tensors other than the vision / audio towers are an error."""
    dtype = check_load_dtype(dtype)
    text, generation, model_type = read_config(folder)
    config = gemma4_config(text, generation, where=os.path.join(folder, "config.json"))
    tokenizer = Tokenizer.of_folder(folder)  # before any weight is read
    model = Gemma4(config)
    tensors = read_hf_tensors(folder, skipped=_TOWER_PREFIXES)
    prefix = _TEXT_PREFIXES[0] if model_type == "gemma4" else _TEXT_PREFIXES[1]
    params = gemma4_params(model, tensors, prefix, dtype, where=folder)
    towers = [name for name in tensors.keys() if name.startswith(_TOWER_PREFIXES)]
    shared = tuple(f"{prefix}layers.{i}.self_attn.{part}"
                   for i in range(config.first_shared, config.num_layers)
                   for part in ("k_proj", "v_proj", "k_norm", "v_norm"))
    used = {prefix + name for name in _TOP.values()} | {"lm_head.weight"}
    used |= {f"{prefix}layers.{i}.{name}" for i in range(config.num_layers)
             for name in _LAYER.values()}
    extra = sorted(name for name in tensors.keys()
                   if name not in used and not name.startswith(_TOWER_PREFIXES)
                   and not name.startswith(shared))
    if extra:
        raise ValueError(f"{folder}: {len(extra)} tensor(s) this Gemma 4 config does not use: "
                         f"{', '.join(extra[:5])}")
    if towers:
        warnings.warn(f"{folder}: the vision / audio towers ({len(towers)} tensors) are not "
                      f"loaded; jaxgen generates from text only", stacklevel=2)
    return model, params, tokenizer

"""Loads a Hugging Face GLM-4.5 folder (config.json model_type "glm4_moe") into (Glm4Moe, params).

Names (transformers' Glm4MoeForCausalLM, as save_pretrained writes them): the attention and
the dense layers' MLP as in the Llama family (jaxgen/models/hf_export.py's HF_LAYER_NAMES),
the MoE layers' router `mlp.gate.weight` [E, D] and `mlp.gate.e_score_correction_bias` [E],
the experts per expert (`mlp.experts.{j}.gate_proj.weight` ...) or fused
(`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`), the shared experts
`mlp.shared_experts.*` (jaxgen/models/moe.py's read_moe_layer), and the MTP depths at layer
indices num_hidden_layers + k (jaxgen/models/mtp_layout.py; their blocks are MoE layers).

Strict as the Llama loader: shapes checked from the headers before any weight is read, every
weight finite, every tensor used (RoPE tables and the MTP depths' copies of the shared head /
embeddings excepted).

Example:
    >>> import json, os, tempfile
    >>> import numpy as np
    >>> from jaxgen.models.safetensors_io import write_safetensors
    >>> folder = tempfile.mkdtemp()
    >>> config = dict(model_type="glm4_moe", vocab_size=8, hidden_size=4, intermediate_size=8,
    ...     num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, head_dim=4,
    ...     first_k_dense_replace=1, n_routed_experts=2, num_experts_per_tok=1,
    ...     moe_intermediate_size=2, num_nextn_predict_layers=0)
    >>> _ = open(os.path.join(folder, "config.json"), "w").write(json.dumps(config))
    >>> shapes = {"model.embed_tokens.weight": (8, 4), "model.norm.weight": (4,),
    ...     "lm_head.weight": (8, 4), "model.layers.0.input_layernorm.weight": (4,),
    ...     "model.layers.0.post_attention_layernorm.weight": (4,),
    ...     "model.layers.0.self_attn.q_proj.weight": (4, 4),
    ...     "model.layers.0.self_attn.k_proj.weight": (4, 4),
    ...     "model.layers.0.self_attn.v_proj.weight": (4, 4),
    ...     "model.layers.0.self_attn.o_proj.weight": (4, 4),
    ...     "model.layers.0.mlp.gate_proj.weight": (8, 4),
    ...     "model.layers.0.mlp.up_proj.weight": (8, 4),
    ...     "model.layers.0.mlp.down_proj.weight": (4, 8)}
    >>> write_safetensors(os.path.join(folder, "model.safetensors"),
    ...                   {k: np.ones(s, np.float32) for k, s in shapes.items()})
    >>> model, params, tokenizer = load_glm4_moe(folder)
    >>> type(model).__name__, params["layers"]["w_gate"].shape, tokenizer is None
    ('Glm4Moe', (1, 4, 8), True)
"""
from __future__ import annotations

import os
from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np

from jaxgen.models.checkpoint_checks import (
    check_load_dtype,
    names_list,
    reject_unexpected,
    require_finite,
)
from jaxgen.models.checkpoint_files import read_json_file, read_json_object
from jaxgen.models.config_checks import check_layer_count, check_tensor_shapes
from jaxgen.models.glm4_moe import ATTENTION_KEYS, DENSE_KEYS, Glm4Moe, Glm4MoeConfig
from jaxgen.models.hf_checkpoint import IGNORED_HF_TENSORS, read_hf_tensors
from jaxgen.models.hf_export import HF_LAYER_NAMES
from jaxgen.models.llama import checked_params
from jaxgen.models.moe import read_moe_layer
from jaxgen.models.mtp_checkpoint import read_mtp_tensors
from jaxgen.models.tokenizer import Tokenizer

__all__ = ["load_glm4_moe", "load_glm4_moe_config"]

_LAYER_INDEX_PREFIX = "model.layers."


def load_glm4_moe_config(folder: str) -> Glm4MoeConfig:
    """Glm4MoeConfig from `config.json` (+ `generation_config.json` when present)."""
    path = os.path.join(folder, "config.json")
    generation = read_json_object(os.path.join(folder, "generation_config.json"), required=False)
    return Glm4MoeConfig.from_hf_dict(read_json_file(path), generation, where=path)


def _expected_hf_shapes(config: Glm4MoeConfig) -> dict:
    """HF tensor name -> the shape the config implies (stored layout), MTP depths included."""
    d, moe = config.hidden_size, config.moe
    qd, kd = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    attention = {"input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,),
                 "self_attn.q_proj.weight": (qd, d), "self_attn.k_proj.weight": (kd, d),
                 "self_attn.v_proj.weight": (kd, d), "self_attn.o_proj.weight": (d, qd)}
    if config.attention_bias:
        attention.update({"self_attn.q_proj.bias": (qd,), "self_attn.k_proj.bias": (kd,),
                          "self_attn.v_proj.bias": (kd,)})
    if config.qk_norm:
        attention.update({"self_attn.q_norm.weight": (config.head_dim,),
                          "self_attn.k_norm.weight": (config.head_dim,)})
    f = config.intermediate_size
    dense = {"mlp.gate_proj.weight": (f, d), "mlp.up_proj.weight": (f, d),
             "mlp.down_proj.weight": (d, f)}
    fe, fs = moe.expert_size, moe.expert_size * moe.shared_experts
    routed = {"mlp.gate.weight": (moe.num_experts, d),
              "mlp.gate.e_score_correction_bias": (moe.num_experts,),
              "mlp.experts.gate_up_proj": (moe.num_experts, 2 * fe, d),
              "mlp.experts.down_proj": (moe.num_experts, d, fe)}
    for j in range(moe.num_experts):
        routed.update({f"mlp.experts.{j}.gate_proj.weight": (fe, d),
                       f"mlp.experts.{j}.up_proj.weight": (fe, d),
                       f"mlp.experts.{j}.down_proj.weight": (d, fe)})
    if fs:
        routed.update({"mlp.shared_experts.gate_proj.weight": (fs, d),
                       "mlp.shared_experts.up_proj.weight": (fs, d),
                       "mlp.shared_experts.down_proj.weight": (d, fs)})
    expected = {"model.embed_tokens.weight": (config.vocab_size, d), "model.norm.weight": (d,),
                "lm_head.weight": (config.vocab_size, d)}
    for i in range(config.num_layers + config.num_mtp_layers):
        mlp = dense if i < config.dense_layers else routed
        expected.update({f"{_LAYER_INDEX_PREFIX}{i}.{k}": s
                         for k, s in {**attention, **mlp}.items()})
    for k in range(config.num_mtp_layers):
        prefix = f"{_LAYER_INDEX_PREFIX}{config.num_layers + k}."
        expected.update({prefix + "enorm.weight": (d,), prefix + "hnorm.weight": (d,),
                         prefix + "eh_proj.weight": (d, 2 * d),
                         prefix + "shared_head.norm.weight": (d,)})
    return expected


def _check_against_tensors(config: Glm4MoeConfig, tensors: Mapping, where: str) -> None:
    """The layer count and every tensor's stored shape against the config (headers only)."""
    indices = set()
    for name in tensors:
        if name.startswith(_LAYER_INDEX_PREFIX):
            head = name[len(_LAYER_INDEX_PREFIX):].split(".", 1)[0]
            if head.isdigit():
                indices.add(int(head))
    needed = config.num_layers + config.num_mtp_layers
    label = "num_hidden_layers" + (" + num_nextn_predict_layers" if config.num_mtp_layers
                                   else "")
    check_layer_count(indices, label, needed, "model.layers.{i}.", where)
    expected = _expected_hf_shapes(config)
    shape = getattr(tensors, "shape", None)
    stored = {n: tuple(shape(n)) if callable(shape) else tuple(np.shape(tensors[n]))
              for n in expected if n in tensors}
    check_tensor_shapes(expected, stored, {}, where)


def _read_block(fetch, prefix: str, config: Glm4MoeConfig, names: set, keys, moe: bool) -> dict:
    """One decoder block's params (numpy, per layer) under `prefix` ("model.layers.{i}.")."""
    block = {}
    for key in keys:
        suffix, transpose = HF_LAYER_NAMES[key]
        array = fetch(prefix + suffix)
        block[key] = None if array is None else (array.T if transpose else array)
    if moe:
        block.update(read_moe_layer(fetch, prefix + "mlp.", config.moe, names))
    return block


def glm4_moe_params(config: Glm4MoeConfig, tensors: Mapping[str, np.ndarray], dtype=jnp.float32,
                    where: str = "") -> dict:
    """HF state dict (name -> numpy array) -> the params tree of `Glm4Moe(config)` (strict:
    see the module docs)."""
    _check_against_tensors(config, tensors, where)
    model = Glm4Moe(config)
    expected = model.param_shapes()
    names = set(tensors)
    missing: list[str] = []
    used: set[str] = set()

    def fetch(name: str) -> np.ndarray | None:
        if name not in tensors:
            missing.append(name)
            return None
        used.add(name)
        array = tensors[name]
        require_finite(name, array, where)
        return array

    layer_keys = expected["layers"]
    attention = [k for k in ATTENTION_KEYS if k in layer_keys]
    dense = [k for k in DENSE_KEYS if k in layer_keys]
    blocks = [_read_block(fetch, f"{_LAYER_INDEX_PREFIX}{i}.", config, names,
                          attention + (dense if i < config.dense_layers else []),
                          moe=i >= config.dense_layers)
              for i in range(config.num_layers)]
    layers = {}
    for key in layer_keys:
        arrays = [b[key] for b in blocks if key in b]
        if all(a is not None for a in arrays):
            layers[key] = np.stack(arrays)
    params = {"embed": fetch("model.embed_tokens.weight"), "layers": layers,
              "final_norm": fetch("model.norm.weight")}
    if not config.tie_word_embeddings:
        head = fetch("lm_head.weight")
        params["lm_head"] = None if head is None else head.T
    if config.num_mtp_layers:
        params["mtp"] = read_mtp_tensors(
            config, fetch, names, used, model.mtp_block_shapes(), where,
            read_block=lambda prefix: _read_block(fetch, prefix, config, names, attention,
                                                  moe=True))
    prefix = f"{where}: " if where else ""
    if missing:
        raise ValueError(f"{prefix}checkpoint is missing {len(missing)} tensor(s): "
                         f"{names_list(missing)}")
    if config.tie_word_embeddings and "lm_head.weight" in tensors:
        if not np.array_equal(tensors["lm_head.weight"], params["embed"]):
            raise ValueError(f"{prefix}tie_word_embeddings is true but lm_head.weight differs "
                             f"from model.embed_tokens.weight (is the config right?)")
        used.add("lm_head.weight")
    unused = (n for n in tensors if n not in used and not IGNORED_HF_TENSORS.search(n))
    reject_unexpected(unused, (), where,
                      f" (the config has {config.num_layers} layer(s) and "
                      f"{config.num_mtp_layers} MTP layer(s); does it match the weights?)")
    return checked_params(params, expected, dtype, where)


def load_glm4_moe(folder: str, dtype=jnp.float32) -> tuple[Glm4Moe, dict, Tokenizer | None]:
    """(model, params, tokenizer) from a GLM-4.5 HF folder; tokenizer is None without
    tokenizer.json. The registry's loader for model_type "glm4_moe"."""
    dtype = check_load_dtype(dtype)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"checkpoint folder not found: {folder}")
    config = load_glm4_moe_config(folder)
    tokenizer = Tokenizer.of_folder(folder)  # before any weight is read
    params = glm4_moe_params(config, read_hf_tensors(folder), dtype, where=folder)
    return Glm4Moe(config), params, tokenizer

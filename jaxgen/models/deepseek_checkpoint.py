"""Loads a Hugging Face DeepSeek-V3 folder (config.json `model_type` "deepseek_v3") into
(DeepseekV3, params): `jaxgen.models.load(folder)` dispatches here (HF_FAMILY_LOADERS).

Names (under model.layers.{i}.; linear weights transposed to [in, out], layers stacked):

    input_layernorm / post_attention_layernorm.weight     attn_norm / mlp_norm
    self_attn.q_a_proj.weight (.bias)  q_a_layernorm      wq_a (bq_a), q_a_norm
    self_attn.q_b_proj.weight / q_proj.weight             wq_b / wq (q_lora_rank null)
    self_attn.kv_a_proj_with_mqa.weight (.bias)           wkv_a (bkv_a)
    self_attn.kv_a_layernorm.weight, kv_b_proj.weight     kv_a_norm, wkv_b
    self_attn.o_proj.weight (.bias)                       wo (bo)
    mlp.{gate,up,down}_proj.weight                        w_gate, w_up, w_down (the first
                                                          first_k_dense_replace layers)
    mlp.gate.*, mlp.experts.*, mlp.shared_experts.*       the MoE keys (moe.read_moe_layer:
                                                          per-expert or fused names)

MTP depth k at model.layers.{L + k}.: enorm, hnorm, eh_proj ([D, 2D] -> [2D, D]),
shared_head.norm (-> norm) and a full MoE decoder block under the names above; the per-depth
copies shared_head.head.weight / embed_tokens.weight are accepted, not loaded. The router
(gate.weight, e_score_correction_bias) stays float32 whatever `dtype` (transformers keeps it
in float32 too). Strict: every tensor must be used, every weight finite.

Example (the config alone; tests/test_deepseek_v3.py builds whole folders with transformers):
    >>> import tempfile
    >>> folder = tempfile.mkdtemp()
    >>> with open(os.path.join(folder, "config.json"), "w") as f:
    ...     json.dump({"model_type": "deepseek_v3", "vocab_size": 32, "hidden_size": 16,
    ...                "intermediate_size": 32, "num_hidden_layers": 2,
    ...                "num_attention_heads": 2, "q_lora_rank": None, "kv_lora_rank": 8,
    ...                "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 4,
    ...                "moe_intermediate_size": 8, "n_routed_experts": 4,
    ...                "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
    ...                "first_k_dense_replace": 1, "num_nextn_predict_layers": 1,
    ...                "rope_parameters": {"rope_type": "yarn", "factor": 40,
    ...                                    "mscale_all_dim": 1.0, "rope_theta": 1e4}}, f)
    >>> config = load_deepseek_v3_config(folder)
    >>> config.q_lora_rank, config.num_mtp_layers, dict(config.rope_scaling)["rope_type"]
    (None, 1, 'yarn')
    >>> load_deepseek_v3(folder)                                  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    FileNotFoundError: missing file: .../model.safetensors (nor a sharded ...)
"""
from __future__ import annotations

import json  # noqa: F401  (the docstring's example)
import os

import jax.numpy as jnp
import numpy as np

from jaxgen.models.checkpoint_checks import (
    check_load_dtype,
    names_list,
    reject_unexpected,
    require_finite,
)
from jaxgen.models.checkpoint_files import read_json_file, read_json_object
from jaxgen.models.deepseek_v3 import DeepseekV3, DeepseekV3Config, param_shapes
from jaxgen.models.hf_checkpoint import IGNORED_HF_TENSORS, read_hf_tensors
from jaxgen.models.moe import read_moe_layer
from jaxgen.models.tokenizer import Tokenizer

__all__ = ["ATTENTION_NAMES", "load_deepseek_v3", "load_deepseek_v3_config"]

ATTENTION_NAMES = {  # params key -> (HF suffix under model.layers.{i}., transposed)
    "attn_norm": ("input_layernorm.weight", False),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "wq_a": ("self_attn.q_a_proj.weight", True),
    "bq_a": ("self_attn.q_a_proj.bias", False),
    "q_a_norm": ("self_attn.q_a_layernorm.weight", False),
    "wq_b": ("self_attn.q_b_proj.weight", True),
    "wq": ("self_attn.q_proj.weight", True),
    "wkv_a": ("self_attn.kv_a_proj_with_mqa.weight", True),
    "bkv_a": ("self_attn.kv_a_proj_with_mqa.bias", False),
    "kv_a_norm": ("self_attn.kv_a_layernorm.weight", False),
    "wkv_b": ("self_attn.kv_b_proj.weight", True),
    "wo": ("self_attn.o_proj.weight", True),
    "bo": ("self_attn.o_proj.bias", False),
}
DENSE_NAMES = {"w_gate": ("mlp.gate_proj.weight", True), "w_up": ("mlp.up_proj.weight", True),
               "w_down": ("mlp.down_proj.weight", True)}
MTP_NAMES = {"enorm": ("enorm.weight", False), "hnorm": ("hnorm.weight", False),
             "eh_proj": ("eh_proj.weight", True), "norm": ("shared_head.norm.weight", False)}
MTP_SHARED_COPIES = ("shared_head.head.weight", "embed_tokens.weight")
FLOAT32_KEYS = ("router", "router_bias")  # kept in float32 whatever the dtype


def load_deepseek_v3_config(folder: str) -> DeepseekV3Config:
    """DeepseekV3Config from `config.json` (+ `generation_config.json` when present)."""
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"checkpoint folder not found: {folder}")
    path = os.path.join(folder, "config.json")
    generation = read_json_object(os.path.join(folder, "generation_config.json"), required=False)
    return DeepseekV3Config.from_hf_dict(read_json_file(path), generation, where=path)


class _Reader:
    """Fetches tensors by name, checking shape and finiteness, recording what was used."""

    def __init__(self, tensors, where: str):
        self.tensors, self.where, self.used, self.missing = tensors, where, set(), []

    def __call__(self, name: str, shape: tuple | None = None, transpose: bool = False):
        if name not in self.tensors:
            self.missing.append(name)
            return None if shape is None else np.zeros(shape, np.float32)
        self.used.add(name)
        array = np.asarray(self.tensors[name])
        require_finite(name, array, self.where)
        array = array.T if transpose else array
        if shape is not None and tuple(array.shape) != tuple(shape):
            want = tuple(shape)[::-1] if transpose else tuple(shape)
            raise ValueError(f"{self.where}: tensor {name!r} has shape "
                             f"{tuple(np.shape(self.tensors[name]))}, expected {want} for "
                             f"this config")
        return array

    def strict(self, name: str):
        """A tensor the MoE reader asks for: missing is an error right away."""
        array = self(name)
        if array is None:
            raise ValueError(f"{self.where}: checkpoint is missing tensor {name!r}")
        return array


def _block(read: _Reader, prefix: str, keys: dict, names: dict) -> dict:
    """One layer's tensors under `prefix` for params `keys` ({key: shape without layer axis})."""
    return {key: read(prefix + names[key][0], shape, names[key][1])
            for key, shape in keys.items() if key in names}


def _moe(read: _Reader, prefix: str, config: DeepseekV3Config, keys: dict) -> dict:
    layer = read_moe_layer(read.strict, prefix + "mlp.", config.moe, set(read.tensors))
    for key, shape in keys.items():
        if key in layer and tuple(np.shape(layer[key])) != tuple(shape):
            raise ValueError(f"{read.where}: the MoE tensors under {prefix}mlp. give {key} of "
                             f"shape {tuple(np.shape(layer[key]))}, expected {tuple(shape)} "
                             f"for this config")
    return layer


def _stack(per_layer: list[dict]) -> dict:
    return {key: np.stack([layer[key] for layer in per_layer]) for key in per_layer[0]}


def hf_to_params(config: DeepseekV3Config, tensors, dtype=jnp.float32, where: str = "") -> dict:
    """HF tensors (name -> numpy array) -> params (see deepseek_v3.py's layout)."""
    expected = param_shapes(config)
    read = _Reader(tensors, where)
    layer_shapes = expected["layers"]
    one = {key: shape[1:] for key, shape in layer_shapes.items()}
    attention = {k: v for k, v in one.items() if k in ATTENTION_NAMES}
    dense_keys = {k: v for k, v in one.items() if k in DENSE_NAMES}
    moe_keys = {k: v for k, v in one.items() if k not in ATTENTION_NAMES and k not in DENSE_NAMES}
    blocks = []
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}."
        block = _block(read, prefix, attention, ATTENTION_NAMES)
        if i < config.dense_layers:
            block.update(_block(read, prefix, dense_keys, DENSE_NAMES))
        else:
            block.update(_moe(read, prefix, config, moe_keys))
        blocks.append(block)
    layers = _stack([{k: b[k] for k in attention} for b in blocks])
    if config.dense_layers:
        layers.update(_stack([{k: b[k] for k in dense_keys}
                              for b in blocks[:config.dense_layers]]))
    if config.dense_layers < config.num_layers:
        layers.update(_stack([{k: b[k] for k in moe_keys} for b in blocks[config.dense_layers:]]))
    d, v = config.hidden_size, config.vocab_size
    params = {"embed": read("model.embed_tokens.weight", (v, d)), "layers": layers,
              "final_norm": read("model.norm.weight", (d,))}
    if not config.tie_word_embeddings:
        params["lm_head"] = read("lm_head.weight", (d, v), transpose=True)
    elif "lm_head.weight" in tensors:
        if not np.array_equal(np.asarray(tensors["lm_head.weight"]), params["embed"]):
            raise ValueError(f"{where}: tie_word_embeddings is true but lm_head.weight differs "
                             f"from model.embed_tokens.weight (is the config right?)")
        read.used.add("lm_head.weight")
    if config.num_mtp_layers:
        params["mtp"] = _mtp(read, config, expected["mtp"], attention, moe_keys)
    if read.missing:
        raise ValueError(f"{where}: checkpoint is missing {len(read.missing)} tensor(s): "
                         f"{names_list(read.missing)}")
    unused = (n for n in tensors if n not in read.used and not IGNORED_HF_TENSORS.search(n))
    reject_unexpected(unused, (), where,
                      f" (the config has {config.num_layers} layer(s) and "
                      f"{config.num_mtp_layers} MTP layer(s); does it match the weights?)")
    return _as_arrays(params, dtype)


def _mtp(read: _Reader, config: DeepseekV3Config, shapes: dict, attention: dict,
         moe_keys: dict) -> dict:
    """params["mtp"]: each depth's own tensors and its MoE decoder block, stacked."""
    depths = []
    for k in range(config.num_mtp_layers):
        prefix = f"model.layers.{config.num_layers + k}."
        own = {key: read(prefix + name, shapes[key][1:], transpose)
               for key, (name, transpose) in MTP_NAMES.items()}
        block = _block(read, prefix, attention, ATTENTION_NAMES)
        block.update(_moe(read, prefix, config, moe_keys))
        own["layers"] = block
        for copy in MTP_SHARED_COPIES:
            if prefix + copy in read.tensors:
                read.used.add(prefix + copy)
        depths.append(own)
    mtp = {key: np.stack([d[key] for d in depths]) for key in MTP_NAMES}
    mtp["layers"] = _stack([d["layers"] for d in depths])
    return mtp


def _as_arrays(tree, dtype, name: str = ""):
    if isinstance(tree, dict):
        return {key: _as_arrays(value, dtype, key) for key, value in tree.items()}
    kept = jnp.float32 if name in FLOAT32_KEYS else dtype
    return jnp.asarray(np.asarray(tree, dtype=np.float32), dtype=kept)


def load_deepseek_v3(folder: str, dtype=jnp.float32) -> tuple[DeepseekV3, dict,
                                                             Tokenizer | None]:
    """(model, params, tokenizer) from a HF DeepSeek-V3 folder; tokenizer is None without
    tokenizer.json. dtype: jnp.float32 or jnp.bfloat16."""
    dtype = check_load_dtype(dtype)
    config = load_deepseek_v3_config(folder)
    tokenizer = Tokenizer.of_folder(folder)  # before any weight is read
    tensors = read_hf_tensors(folder)
    model = DeepseekV3(config)
    params = hf_to_params(config, tensors, dtype, where=folder)
    model.check_params(params)
    return model, params, tokenizer

"""Loads a Hugging Face checkpoint folder into (Llama, params).

Reads `config.json`, `generation_config.json` (optional), and `model.safetensors` or a
sharded `model.safetensors.index.json`; maps HF names/layouts onto the params layout in
`llama.py` (linear weights transposed to [in, out], layers stacked on axis 0).

Example:
    >>> model, params = load_hf_checkpoint("/path/to/folder", dtype=jnp.bfloat16)  # doctest: +SKIP
"""
from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np

from .llama import Llama, LlamaConfig, checked_params, param_shapes
from .safetensors_io import read_safetensors

_LAYER_NAMES = {  # params name -> (HF suffix under model.layers.{i}., transpose)
    "attn_norm": ("input_layernorm.weight", False),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True),
    "wo": ("self_attn.o_proj.weight", True),
    "bq": ("self_attn.q_proj.bias", False),
    "bk": ("self_attn.k_proj.bias", False),
    "bv": ("self_attn.v_proj.bias", False),
    "bo": ("self_attn.o_proj.bias", False),
    "q_norm": ("self_attn.q_norm.weight", False),
    "k_norm": ("self_attn.k_norm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True),
    "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
}


def _read_json(path: str, required: bool = True) -> dict | None:
    if not os.path.isfile(path):
        if required:
            raise FileNotFoundError(f"missing file: {path}")
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: invalid JSON ({err})") from None


def load_hf_config(folder: str) -> LlamaConfig:
    """LlamaConfig from `config.json` (+ `generation_config.json` when present)."""
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"checkpoint folder not found: {folder}")
    config = _read_json(os.path.join(folder, "config.json"))
    generation = _read_json(os.path.join(folder, "generation_config.json"), required=False)
    return LlamaConfig.from_hf_dict(config, generation)


def read_hf_tensors(folder: str) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint (single file or shards listed in the index)."""
    single = os.path.join(folder, "model.safetensors")
    index_path = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(single):
        return read_safetensors(single)
    if os.path.isfile(index_path):
        index = _read_json(index_path)
        if "weight_map" not in index:
            raise ValueError(f"{index_path}: no 'weight_map'")
        tensors = {}
        for shard in sorted(set(index["weight_map"].values())):
            tensors.update(read_safetensors(os.path.join(folder, shard)))
        return tensors
    raise FileNotFoundError(f"missing file: {single} (nor a sharded {index_path})")


def hf_to_params(config: LlamaConfig, tensors: dict[str, np.ndarray], dtype=jnp.float32) -> dict:
    """HF state dict (numpy) -> params tree, checking names and shapes."""
    expected = param_shapes(config)
    missing: list[str] = []

    def fetch(name: str) -> np.ndarray | None:
        if name not in tensors:
            missing.append(name)
            return None
        return tensors[name]

    layers = {}
    for key in expected["layers"]:
        suffix, transpose = _LAYER_NAMES[key]
        arrays = [fetch(f"model.layers.{i}.{suffix}") for i in range(config.num_layers)]
        if any(a is None for a in arrays):
            continue
        layers[key] = np.stack([a.T if transpose else a for a in arrays])
    params = {"embed": fetch("model.embed_tokens.weight"), "layers": layers,
              "final_norm": fetch("model.norm.weight")}
    if not config.tie_word_embeddings:
        head = fetch("lm_head.weight")
        params["lm_head"] = None if head is None else head.T
    if missing:
        shown = ", ".join(missing[:8]) + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else "")
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")
    return checked_params(params, expected, dtype)


def load_hf_checkpoint(folder: str, dtype=jnp.float32) -> tuple[Llama, dict]:
    """(Llama, params) from a HF checkpoint folder. dtype: jnp.float32 or jnp.bfloat16."""
    config = load_hf_config(folder)
    tensors = read_hf_tensors(folder)
    return Llama(config), hf_to_params(config, tensors, dtype)

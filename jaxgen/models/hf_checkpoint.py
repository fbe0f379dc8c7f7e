"""Loads a Hugging Face checkpoint folder into (Llama, params).

Reads `config.json`, `generation_config.json` (optional), and `model.safetensors` or a
sharded `model.safetensors.index.json`; maps HF names/layouts onto the params layout in
`llama.py` (linear weights transposed to [in, out], layers stacked on axis 0).

Strict: every tensor in the files must be used (see `checkpoint_checks`), except the
buffers HF checkpoints routinely carry that hold no weights (`IGNORED_HF_TENSORS`: RoPE
frequency tables, recomputed from the config) and a tied `lm_head.weight` equal to the
embeddings. Every weight must be finite.

Example:
    >>> import tempfile, jax
    >>> from jaxgen.models.hf_export import save_hf_checkpoint
    >>> tiny = Llama(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
    ...                          num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8))
    >>> folder = save_hf_checkpoint(tiny, tiny.init_params(jax.random.key(0)), tempfile.mkdtemp())
    >>> model, params = load_hf_checkpoint(folder, dtype=jnp.bfloat16)
    >>> model == tiny, params["layers"]["wk"].shape, params["layers"]["wk"].dtype
    (True, (2, 16, 8), dtype(bfloat16))
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np

from jaxgen.models.checkpoint_checks import (
    names_list,
    reject_unexpected,
    require_finite,
)
from jaxgen.models.config_checks import (
    check_layer_count,
    check_tensor_shapes,
    expected_tensor_shapes,
)
from jaxgen.models.llama import (
    HF_NAMES,
    Llama,
    LlamaConfig,
    checked_params,
    param_shapes,
)
from jaxgen.models.mtp_checkpoint import read_mtp_tensors
from jaxgen.models.mtp_layout import mtp_shapes
from jaxgen.models.safetensors_io import TensorFiles, open_safetensors
from jaxgen.models.tokenizer import Tokenizer

# Tensors HF checkpoints may carry that are not weights: the RoPE tables older Llama code
# saved per layer (recomputed from the config here). Skipped without error.
IGNORED_HF_TENSORS = re.compile(r"(^|\.)rotary_emb\.(inv_freq|cos_cached|sin_cached)$")
_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")

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


def read_model_type(folder: str) -> str | None:
    """config.json's `model_type` (None when absent): which family's loader reads the folder.
    A missing folder or config.json, or invalid JSON, raises as `load_hf_config` does."""
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"checkpoint folder not found: {folder}")
    config = _read_json(os.path.join(folder, "config.json"))
    model_type = config.get("model_type") if isinstance(config, dict) else None
    return model_type if isinstance(model_type, str) else None


def load_hf_config(folder: str) -> LlamaConfig:
    """LlamaConfig from `config.json` (+ `generation_config.json` when present)."""
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"checkpoint folder not found: {folder}")
    path = os.path.join(folder, "config.json")
    config = _read_json(path)
    generation = _read_json(os.path.join(folder, "generation_config.json"), required=False)
    if generation is not None and not isinstance(generation, dict):
        raise ValueError(f"{folder}/generation_config.json holds a {type(generation).__name__}"
                         f", expected an object")
    return LlamaConfig.from_hf_dict(config, generation, where=path)


def read_hf_tensors(folder: str) -> Mapping[str, np.ndarray]:
    """Every tensor of the checkpoint (single file or the shards listed in the index), as a
    lazy name -> numpy array mapping. Headers are validated now; a corrupt or truncated file,
    or a shard the index lists but the folder lacks, raises ValueError naming the path."""
    single = os.path.join(folder, "model.safetensors")
    index_path = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(single):
        return open_safetensors(single)
    if os.path.isfile(index_path):
        index = _read_json(index_path)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index_path}: no 'weight_map'")
        shards = {}
        for shard in sorted(set(weight_map.values())):
            path = os.path.join(folder, shard)
            if not os.path.isfile(path):
                raise ValueError(f"{index_path} lists shard {shard!r}, but {path} is missing")
            shards[shard] = open_safetensors(path)
        absent = sorted(n for n, shard in weight_map.items() if n not in shards[shard])
        if absent:
            raise ValueError(f"{index_path}: {len(absent)} tensor(s) not in the shard the index "
                             f"names: {names_list(absent)}")
        return TensorFiles(list(shards.values()))
    raise FileNotFoundError(f"missing file: {single} (nor a sharded {index_path})")


def _stored_shape(tensors: Mapping[str, np.ndarray], name: str) -> tuple[int, ...]:
    """A tensor's shape from the file header when the mapping can tell (no data read)."""
    shape = getattr(tensors, "shape", None)
    return tuple(shape(name)) if callable(shape) else tuple(np.shape(tensors[name]))


def check_against_tensors(config: LlamaConfig, tensors: Mapping[str, np.ndarray],
                          where: str = "") -> None:
    """The config against the checkpoint before a weight is read: the layers it needs
    (num_hidden_layers + num_mtp_layers) are there, and every tensor the config names has
    the shape the config implies (headers only). ValueError naming the config.json field."""
    indices = {int(m.group(1)) for m in map(_LAYER_INDEX.match, tensors) if m}
    needed = config.num_layers + config.num_mtp_layers
    name = "num_hidden_layers" + (" + num_mtp_layers" if config.num_mtp_layers else "")
    check_layer_count(indices, name, needed, "model.layers.{i}.", where)
    expected, origin = expected_tensor_shapes(
        config, param_shapes(config), HF_NAMES,
        {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight",
         "lm_head": "lm_head.weight"}, _LAYER_NAMES, "model.layers.{i}.")
    stored = {n: _stored_shape(tensors, n) for n in expected if n in tensors}
    check_tensor_shapes(expected, stored, origin, where)


def hf_to_params(config: LlamaConfig, tensors: Mapping[str, np.ndarray], dtype=jnp.float32, *,
                 allowed_extra: tuple[str, ...] = (), where: str = "") -> dict:
    """HF state dict (name -> numpy array) -> params tree.

    Checks names and shapes, that every weight is finite, and that every tensor is used:
    tensors the config has no place for raise ValueError (a few named), except
    `IGNORED_HF_TENSORS`, a tied `lm_head.weight` equal to the embeddings, and names starting
    with one of `allowed_extra` (the hook for tensors another option consumes; default none).
    where: a prefix for error messages (the folder).
    """
    check_against_tensors(config, tensors, where)
    expected = param_shapes(config)
    if config.num_mtp_layers:  # the checkpoint's MTP layers (jaxgen/models/mtp_checkpoint.py)
        expected["mtp"] = mtp_shapes(config, expected["layers"])
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
    if config.num_mtp_layers:
        params["mtp"] = read_mtp_tensors(config, fetch, set(tensors), used, expected["layers"],
                                         where)
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
    reject_unexpected(unused, allowed_extra, where,
                      f" (the config has {config.num_layers} layer(s) and "
                      f"{config.num_mtp_layers} MTP layer(s); does it match the weights?)")
    return checked_params(params, expected, dtype, where)


def load_hf_checkpoint(folder: str, dtype=jnp.float32, *,
                       allowed_extra: tuple[str, ...] = ()) -> tuple[Llama, dict]:
    """(Llama, params) from a HF checkpoint folder. dtype: jnp.float32 or jnp.bfloat16.

    allowed_extra: tensor-name prefixes that may be present without being loaded (see
    `hf_to_params`); by default every tensor must be used.
    """
    config = load_hf_config(folder)
    tensors = read_hf_tensors(folder)
    return Llama(config), hf_to_params(config, tensors, dtype, allowed_extra=allowed_extra,
                                       where=folder)


def load_hf(folder: str, dtype=jnp.float32) -> tuple[Llama, dict, Tokenizer | None]:
    """(model, params, tokenizer) from a HF folder; tokenizer is None without tokenizer.json."""
    model, params = load_hf_checkpoint(folder, dtype)
    has_tokenizer = os.path.isfile(os.path.join(folder, "tokenizer.json"))
    return model, params, Tokenizer.from_hf_folder(folder) if has_tokenizer else None

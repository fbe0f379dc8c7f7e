"""Loads a Hugging Face checkpoint folder into (Llama, params).

Reads `config.json`, `generation_config.json` (optional), and `model.safetensors` or a
sharded `model.safetensors.index.json`; maps HF names/layouts onto the params layout in
`llama.py` (linear weights transposed to [in, out], layers stacked on axis 0).

Strict: every tensor in the files must be used (see `checkpoint_checks`), except the
buffers HF checkpoints routinely carry that hold no weights (`IGNORED_HF_TENSORS`: RoPE
frequency tables, recomputed from the config) and a tied `lm_head.weight` equal to the
embeddings. Every tensor must be floating point (F32, F16, BF16, F64; checked from the
headers before a weight is read) and every weight finite.

Files: symlinks in the folder are followed wherever they point (the folder owner's choice,
as in the Hugging Face hub cache, whose snapshot files link into its blobs folder); the
shard names `model.safetensors.index.json` lists must stay inside the folder
(jaxgen/models/checkpoint_files.py).

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

import os
import re
from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np

from jaxgen.models.checkpoint_checks import (
    check_load_dtype,
    names_list,
    reject_unexpected,
    require_finite,
)
from jaxgen.models.checkpoint_files import (
    read_json_file,
    read_json_object,
    require_regular_file,
    shard_path,
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
from jaxgen.models.safetensors_io import TensorFiles, check_tensor_dtypes, open_safetensors
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


def read_model_type(folder: str) -> str | None:
    """config.json's `model_type` (None when absent): which family's loader reads the folder.
    A missing folder or config.json, or invalid JSON, raises as `load_hf_config` does."""
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"checkpoint folder not found: {folder}")
    config = read_json_file(os.path.join(folder, "config.json"))
    model_type = config.get("model_type") if isinstance(config, dict) else None
    return model_type if isinstance(model_type, str) else None


def load_hf_config(folder: str) -> LlamaConfig:
    """LlamaConfig from `config.json` (+ `generation_config.json` when present)."""
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"checkpoint folder not found: {folder}")
    path = os.path.join(folder, "config.json")
    config = read_json_file(path)
    generation = read_json_object(os.path.join(folder, "generation_config.json"), required=False)
    return LlamaConfig.from_hf_dict(config, generation, where=path)


def read_hf_tensors(folder: str, *, skipped: tuple[str, ...] = (),
                    integer: tuple[str, ...] = ()) -> Mapping[str, np.ndarray]:
    """Every tensor of the checkpoint (single file or the shards listed in the index), as a
    lazy name -> numpy array mapping. Headers are validated now; a corrupt or truncated file,
    a shard the index lists but the folder lacks, a shard name leaving the folder, or a
    tensor that is not floating point raises ValueError naming the path. skipped: name
    prefixes of parts the caller does not read (their dtypes are not checked); integer: the
    tensors that hold integer indices instead (safetensors_io.check_tensor_dtypes)."""
    single = os.path.join(folder, "model.safetensors")
    index_path = os.path.join(folder, "model.safetensors.index.json")
    if require_regular_file(single):
        tensors = open_safetensors(single)
    elif require_regular_file(index_path):
        tensors = _read_shards(folder, index_path)
    else:
        raise FileNotFoundError(f"missing file: {single} (nor a sharded {index_path})")
    check_tensor_dtypes(tensors, skipped=skipped, integer=integer)
    return tensors


def _read_shards(folder: str, index_path: str) -> TensorFiles:
    """The shards `index_path` lists, each name checked to stay inside `folder`."""
    index = read_json_file(index_path)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index_path}: no 'weight_map'")
    paths = {tensor: shard_path(folder, index_path, tensor, entry)
             for tensor, entry in weight_map.items()}
    shards = {}
    for path in sorted(set(paths.values())):
        if not require_regular_file(path):
            raise ValueError(f"{index_path} lists shard {os.path.relpath(path, folder)!r}, "
                             f"but {path} is missing")
        shards[path] = open_safetensors(path)
    absent = sorted(n for n, path in paths.items() if n not in shards[path])
    if absent:
        raise ValueError(f"{index_path}: {len(absent)} tensor(s) not in the shard the index "
                         f"names: {names_list(absent)}")
    return TensorFiles(list(shards.values()))


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
    dtype = check_load_dtype(dtype)
    config = load_hf_config(folder)
    tensors = read_hf_tensors(folder)
    return Llama(config), hf_to_params(config, tensors, dtype, allowed_extra=allowed_extra,
                                       where=folder)


def load_hf(folder: str, dtype=jnp.float32) -> tuple[Llama, dict, Tokenizer | None]:
    """(model, params, tokenizer) from a HF folder; tokenizer is None without tokenizer.json."""
    tokenizer = Tokenizer.of_folder(folder)  # before any weight is read
    model, params = load_hf_checkpoint(folder, dtype)
    return model, params, tokenizer

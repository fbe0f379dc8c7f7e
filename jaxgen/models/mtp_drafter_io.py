"""The MTP drafter's checkpoint folder (Hugging Face style): save and load.

    config.json          {"model_type": "jaxgen_mtp_drafter",
                          "architectures": ["JaxgenMtpDrafter"],
                          "hidden_size", "intermediate_size", "num_hidden_layers",
                          "num_attention_heads", "rms_norm_eps", "q_norm",      its own
                          "target": {"hidden_size", "num_attention_heads",
                                     "num_key_value_heads", "head_dim", "vocab_size",
                                     "num_hidden_layers", "kv_layers"},  the target it reads
                          "draft_vocab": [token ids]}   optional: its pruned draft vocabulary
    model.safetensors    HF names, Linear weights as [out, in]:
                           embed_norm.weight [Dt]          hidden_norm.weight [Dt]
                           pre_projection.weight [D, 2 Dt] (input: embedding, then hidden)
                           layers.{n}.input_layernorm.weight, .self_attn.q_proj.weight,
                           .self_attn.q_norm.weight (q_norm), .self_attn.o_proj.weight,
                           .post_attention_layernorm.weight, .mlp.gate_proj.weight,
                           .mlp.up_proj.weight, .mlp.down_proj.weight   (the Llama names)
                           norm.weight [D]                 post_projection.weight [Dt, D]
                         (a draft vocabulary's "draft_head" is not stored: it is the target's
                         head rows, rebuilt by mtp_drafter.drafter_with_draft_head)

`jaxgen.models.load(folder)` dispatches here on the model_type. Loading is strict, like the
model loaders: a missing or unexpected tensor, a wrong shape or a tensor that is not
floating point (both from the header, before any data is read), or a non-finite weight is a
ValueError naming the file and the tensor; so is a config.json field of the wrong type.

Example:
    >>> import os, tempfile, jax
    >>> from jaxgen.models import tiny_llama
    >>> from jaxgen.models.mtp_drafter import MtpDrafterModel, MtpDrafterConfig
    >>> from jaxgen.models.mtp_drafter_io import load_mtp_drafter, save_mtp_drafter
    >>> target, _ = tiny_llama()
    >>> config = MtpDrafterConfig.for_target(target.config, hidden_size=8,
    ...                                      intermediate_size=16, num_layers=1)
    >>> drafter = MtpDrafterModel(config)
    >>> folder = save_mtp_drafter(drafter, drafter.init_params(jax.random.key(0)),
    ...                           os.path.join(tempfile.mkdtemp(), "drafter"))
    >>> loaded, params = load_mtp_drafter(folder)
    >>> loaded == drafter, params["pre_projection"].shape
    (True, (32, 8))
"""
from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np

from jaxgen.models.checkpoint_checks import check_load_dtype, reject_unexpected, require_finite
from jaxgen.models.checkpoint_files import read_json_file
from jaxgen.models.hf_export import HF_LAYER_NAMES
from jaxgen.models.mtp_drafter import (
    ARCHITECTURE,
    MODEL_TYPE,
    TARGET_FIELDS,
    MtpDrafterConfig,
    MtpDrafterModel,
    param_shapes,
)
from jaxgen.models.safetensors_io import (
    check_tensor_dtypes,
    open_safetensors,
    write_safetensors,
)

__all__ = ["is_mtp_drafter_folder", "load_mtp_drafter", "mtp_config_dict", "save_mtp_drafter"]

# params name -> (tensor name, transposed) outside the layers
TOP_NAMES = {"embed_norm": ("embed_norm.weight", False),
             "hidden_norm": ("hidden_norm.weight", False),
             "pre_projection": ("pre_projection.weight", True),
             "final_norm": ("norm.weight", False),
             "post_projection": ("post_projection.weight", True)}
OWN_FIELDS = {"hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
              "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads"}


def mtp_config_dict(config: MtpDrafterConfig) -> dict:
    """config.json's content for a drafter config."""
    target = {hf: getattr(config, mine) for mine, (_, hf) in TARGET_FIELDS.items()}
    target["kv_layers"] = list(config.kv_layers)
    data = {"model_type": MODEL_TYPE, "architectures": [ARCHITECTURE],
            **{hf: getattr(config, mine) for mine, hf in OWN_FIELDS.items()},
            "rms_norm_eps": config.rms_norm_eps, "q_norm": config.q_norm, "target": target}
    if config.draft_vocab:
        data["draft_vocab"] = list(config.draft_vocab)
    return data


def config_from_dict(data: dict, where: str = "config.json") -> MtpDrafterConfig:
    """MtpDrafterConfig from config.json's content; ValueError naming a missing field."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: holds a {type(data).__name__}, expected an object")
    if data.get("model_type") != MODEL_TYPE:
        raise ValueError(f"{where}: model_type={data.get('model_type')!r} is not an MTP drafter "
                         f"(expected {MODEL_TYPE!r})")
    target = data.get("target")
    if not isinstance(target, dict):
        raise ValueError(f"{where}: no 'target' object (the target's dimensions the drafter "
                         f"was built for: {', '.join(hf for _, hf in TARGET_FIELDS.values())}, "
                         f"kv_layers)")
    fields = {}
    for mine, hf in OWN_FIELDS.items():
        if hf not in data:
            raise ValueError(f"{where}: missing {hf!r}")
        fields[mine] = data[hf]
    for mine, (_, hf) in TARGET_FIELDS.items():
        if hf not in target:
            raise ValueError(f"{where}: missing 'target.{hf}'")
        fields[mine] = target[hf]
    if not _is_int_list(target.get("kv_layers")):
        raise ValueError(f"{where}: 'target.kv_layers' must be a list of target layer indices "
                         f"(one per drafter layer)")
    vocab = data.get("draft_vocab", [])
    if not _is_int_list(vocab):
        raise ValueError(f"{where}: 'draft_vocab' must be a list of token ids")
    q_norm = data.get("q_norm", False)
    if not isinstance(q_norm, bool):
        raise ValueError(f"{where}: q_norm={q_norm!r}; allowed: true or false")
    try:
        return MtpDrafterConfig(kv_layers=tuple(target["kv_layers"]),
                                rms_norm_eps=data.get("rms_norm_eps", 1e-6), q_norm=q_norm,
                                draft_vocab=tuple(vocab), **fields)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def _is_int_list(value) -> bool:
    """A JSON list of ints (true / false are not ints here)."""
    return isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value)


def _tensor_names(config: MtpDrafterConfig) -> dict:
    """(params path) -> (tensor name, transposed, expected params shape)."""
    shapes = param_shapes(config)
    names = {(key,): (*TOP_NAMES[key], shapes[key]) for key in TOP_NAMES}
    for key, shape in shapes["layers"].items():
        suffix, transposed = HF_LAYER_NAMES[key]
        for n in range(config.num_layers):
            names[("layers", key, n)] = (f"layers.{n}.{suffix}", transposed, shape[1:])
    return names


def save_mtp_drafter(model: MtpDrafterModel, params: dict, folder: str,
                     dtype=np.float32) -> str:
    """Writes config.json + model.safetensors; returns the folder."""
    model.check_params(params)
    os.makedirs(folder, exist_ok=True)
    arrays = {}
    for path, (name, transposed, _) in _tensor_names(model.config).items():
        value = params[path[0]] if len(path) == 1 else params["layers"][path[1]][path[2]]
        value = np.asarray(value).astype(dtype)
        arrays[name] = np.ascontiguousarray(value.T if transposed else value)
    write_safetensors(os.path.join(folder, "model.safetensors"), arrays,
                      metadata={"format": "np"})
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(mtp_config_dict(model.config), f, indent=2)
    return folder


def is_mtp_drafter_folder(folder: str) -> bool:
    """Whether `folder`'s config.json names an MTP drafter (model_type)."""
    try:
        data = read_json_file(os.path.join(folder, "config.json"), required=False)
    except ValueError:  # the family loader reports it
        return False
    return isinstance(data, dict) and data.get("model_type") == MODEL_TYPE


def load_mtp_drafter(folder: str, dtype=jnp.float32) -> tuple[MtpDrafterModel, dict]:
    """(model, params) from a drafter folder, strictly checked (module docs)."""
    dtype = check_load_dtype(dtype)
    config_path = os.path.join(folder, "config.json")
    config = config_from_dict(read_json_file(config_path), config_path)
    path = os.path.join(folder, "model.safetensors")
    tensors = open_safetensors(path)
    check_tensor_dtypes(tensors)
    names = _tensor_names(config)
    for name, transposed, shape in names.values():  # from the header: nothing read yet
        stored = tuple(reversed(shape)) if transposed else tuple(shape)
        if name not in tensors:
            raise ValueError(f"{path}: missing tensor {name!r} (expected shape {stored})")
        if tuple(tensors.shape(name)) != stored:
            raise ValueError(f"{path}: tensor {name!r} has shape {tuple(tensors.shape(name))}, "
                             f"expected {stored} for this config")
    used = {name for name, _, _ in names.values()}
    reject_unexpected([n for n in tensors if n not in used], (), path)
    params: dict = {"layers": {}}
    per_layer: dict = {}
    for key, (name, transposed, shape) in names.items():
        array = tensors[name]
        require_finite(name, array, path)
        value = np.asarray(array, np.float32)
        value = value.T if transposed else value
        if len(key) == 1:
            params[key[0]] = jnp.asarray(value, dtype)
        else:
            per_layer.setdefault(key[1], {})[key[2]] = value
    for key, layers in per_layer.items():
        params["layers"][key] = jnp.asarray(np.stack([layers[n] for n in range(len(layers))]),
                                            dtype)
    model = MtpDrafterModel(config)
    model.check_params(params)
    return model, params

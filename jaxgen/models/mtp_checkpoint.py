"""MTP layers in Hugging Face folders: read them (jaxgen/models/hf_checkpoint.py calls
`read_mtp_tensors` when config.json has `num_mtp_layers` / `num_nextn_predict_layers`) and
write a folder with them (`save_mtp_checkpoint`, for tests and benchmarks). Names and
transposes: jaxgen/models/mtp_layout.py.

Example:
    >>> import tempfile
    >>> from jaxgen.models import tiny_llama, load
    >>> from jaxgen.models.mtp import with_mtp
    >>> model, params = with_mtp(*tiny_llama(num_layers=2), jax.random.key(1), depths=2)
    >>> folder = save_mtp_checkpoint(model, params, tempfile.mkdtemp())
    >>> loaded, loaded_params, _ = load(folder)
    >>> loaded.config.num_mtp_layers, loaded_params["mtp"]["eh_proj"].shape
    (2, (2, 32, 16))
    >>> bool((loaded_params["mtp"]["layers"]["wq"] == params["mtp"]["layers"]["wq"]).all())
    True
"""
from __future__ import annotations

import json
import os
from typing import Callable

import jax
import numpy as np

from jaxgen.models.hf_export import HF_LAYER_NAMES, hf_config_dict, to_hf_arrays
from jaxgen.models.mtp_layout import MTP_SHARED_COPIES, hf_mtp_names, mtp_shapes
from jaxgen.models.safetensors_io import write_safetensors

__all__ = ["mtp_hf_arrays", "read_mtp_tensors", "save_mtp_checkpoint"]


def _depth_names(config, depth: int, layer_keys) -> dict:
    """{key: (HF name, transposed)} of one depth: its own tensors and its decoder block's."""
    index = config.num_layers + depth
    names = dict(hf_mtp_names(config, depth))
    block = {key: (f"model.layers.{index}.{HF_LAYER_NAMES[key][0]}", HF_LAYER_NAMES[key][1])
             for key in layer_keys}
    return {**names, "layers": block}


def read_mtp_tensors(config, fetch: Callable[[str], np.ndarray | None], names: set[str],
                     used: set[str], layer_shapes: dict, where: str = "",
                     read_block: Callable[[str], dict] | None = None) -> dict:
    """params["mtp"] (host arrays, stacked over depths) from a checkpoint's tensors.

    fetch(name): the array, or None after recording the name as missing (the loader's);
    names: every tensor name of the checkpoint; used: the loader's set of consumed names
    (the per-depth copies of the shared head / embeddings are marked used, not loaded);
    layer_shapes: the model's stacked decoder-layer shapes {key: (L, ...)}. A tensor of the
    wrong shape is a ValueError naming it (where: the folder, for the message).
    read_block(prefix): a family's reader of one decoder block under `prefix`
    ("model.layers.{N}.") -> {key: array or None}, for blocks whose tensors are not the Llama
    names one to one (GLM-4.5's MoE experts); None: the Llama names (hf_export.HF_LAYER_NAMES).
    """
    block_keys = layer_shapes if read_block is None else ()  # else: read_block names them
    depths = [_depth_names(config, k, block_keys) for k in range(config.num_mtp_layers)]
    shapes = mtp_shapes(config, layer_shapes)

    def stacked(pick, shape):
        arrays = [fetch(name) for name, _ in map(pick, depths)]
        if any(a is None for a in arrays):
            return None
        transpose = pick(depths[0])[1]
        arrays = [a.T if transpose else a for a in arrays]
        for (name, _), array in zip(map(pick, depths), arrays):
            if tuple(array.shape) != tuple(shape[1:]):
                want = shape[1:][::-1] if transpose else shape[1:]
                prefix = f"{where}: " if where else ""
                raise ValueError(f"{prefix}MTP tensor {name!r} has shape "
                                 f"{tuple(np.shape(array.T if transpose else array))}, "
                                 f"expected {tuple(want)}")
        return np.stack(arrays)

    mtp = {key: stacked(lambda d, key=key: d[key], shapes[key])
           for key in depths[0] if key != "layers"}
    if read_block is None:
        mtp["layers"] = {key: stacked(lambda d, key=key: d["layers"][key],
                                      shapes["layers"][key]) for key in layer_shapes}
    else:
        blocks = [read_block(f"model.layers.{config.num_layers + k}.")
                  for k in range(config.num_mtp_layers)]
        mtp["layers"] = {key: _stack_blocks(blocks, key, shapes["layers"][key], where)
                         for key in layer_shapes}
    for depth in range(config.num_mtp_layers):
        for copy in MTP_SHARED_COPIES:
            name = f"model.layers.{config.num_layers + depth}.{copy}"
            if name in names:
                used.add(name)
    return mtp


def _stack_blocks(blocks: list, key: str, shape: tuple, where: str):
    """One key of the depths' blocks (read_block's dicts) stacked over depths, or None when a
    depth lacks it (the loader reports the missing tensor); a wrong shape is a ValueError."""
    arrays = [block.get(key) for block in blocks]
    if any(a is None for a in arrays):
        return None
    for depth, array in enumerate(arrays):
        if tuple(np.shape(array)) != tuple(shape[1:]):
            prefix = f"{where}: " if where else ""
            raise ValueError(f"{prefix}MTP depth {depth}'s {key!r} has shape "
                             f"{tuple(np.shape(array))}, expected {tuple(shape[1:])}")
    return np.stack(arrays)


def mtp_hf_arrays(model, params, dtype=np.float32) -> dict[str, np.ndarray]:
    """params["mtp"] -> HF tensors (DeepSeek-V3 naming) as numpy arrays of `dtype`."""
    config, mtp = model.config, params["mtp"]
    as_np = lambda a: np.ascontiguousarray(np.asarray(a).astype(dtype))  # noqa: E731
    arrays = {}
    for depth in range(config.num_mtp_layers):
        names = _depth_names(config, depth, mtp["layers"])
        block = names.pop("layers")
        for key, (name, transpose) in names.items():
            array = np.asarray(mtp[key][depth])
            arrays[name] = as_np(array.T if transpose else array)
        for key, (name, transpose) in block.items():
            array = np.asarray(mtp["layers"][key][depth])
            arrays[name] = as_np(array.T if transpose else array)
    return arrays


def save_mtp_checkpoint(model, params, folder: str, dtype=np.float32) -> str:
    """Writes a HF folder (config.json with `num_mtp_layers`, model.safetensors with the MTP
    layers at layer indices num_hidden_layers + k); returns folder."""
    os.makedirs(folder, exist_ok=True)
    config = dict(hf_config_dict(model.config), num_mtp_layers=model.config.num_mtp_layers)
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    plain = {key: value for key, value in params.items() if key != "mtp"}
    arrays = {**to_hf_arrays(model, jax.device_get(plain), dtype),
              **mtp_hf_arrays(model, jax.device_get(params), dtype)}
    write_safetensors(os.path.join(folder, "model.safetensors"), arrays,
                      metadata={"format": "pt"})
    return folder

"""A small, strict safetensors reader (numpy, memory-mapped) with clear errors.

Format: 8-byte little-endian header length N, N bytes of JSON header
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}, then the data.
bfloat16 is read through ml_dtypes (a jax dependency), so bf16 checkpoints need no torch.

Example:
    >>> tensors = read_safetensors("model.safetensors")   # doctest: +SKIP
    >>> tensors["model.norm.weight"].shape                 # doctest: +SKIP
    (576,)
"""
from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}


def read_header(path: str) -> tuple[dict, int]:
    """Parses the header; returns (entries without __metadata__, byte offset of the data)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"safetensors file not found: {path}")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: truncated or corrupt safetensors file (no header)")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > size - 8:
            raise ValueError(f"{path}: truncated or corrupt safetensors file "
                             f"(header of {header_len} bytes, file has {size})")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{path}: corrupt safetensors header ({err})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    data_start = 8 + header_len
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        if entry["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {entry['dtype']}")
        if data_start + end > size:
            raise ValueError(f"{path}: truncated or corrupt safetensors file (tensor {name!r} "
                             f"ends at byte {data_start + end}, file has {size})")
        expected = int(np.prod(entry["shape"], dtype=np.int64)) * np.dtype(_DTYPES[entry["dtype"]]).itemsize
        if end - begin != expected:
            raise ValueError(f"{path}: corrupt safetensors file (tensor {name!r} has "
                             f"{end - begin} bytes, shape needs {expected})")
    return header, data_start


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """All tensors of one file as read-only memory-mapped numpy arrays."""
    header, data_start = read_header(path)
    if not header:
        return {}
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        dtype = np.dtype(_DTYPES[entry["dtype"]])
        buf = raw[data_start + begin:data_start + end]
        out[name] = buf.view(dtype).reshape(entry["shape"])
    return out

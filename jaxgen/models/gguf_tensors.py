"""GGUF tensor checks made from the file's header alone, before any tensor data is read.

- `CheckedReader` (what `open_gguf` opens): a `gguf.GGUFReader` that, before it maps the
  tensors, checks that each one's data lies inside the file. A truncated file or a damaged
  offset is a `TensorOutsideFile` naming the tensor, its type and the byte range, where the
  plain reader fails on a numpy reshape that names neither.
- `check_tensor_types`: each weight's GGUF type is one the float loader reads: F32, F16, F64
  (cast to float32) and the types `gguf.quants.dequantize` expands. Integer tensors (I8, I16,
  I32, I64) are not weights and are refused, naming the file, the tensor and its type.

Example:
    >>> import gguf
    >>> tensor_type_readable(gguf.GGMLQuantizationType.Q8_0)
    True
    >>> tensor_type_readable(gguf.GGMLQuantizationType.I32)
    False
"""
from __future__ import annotations

import functools
import math

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

INTEGER_TYPES = ("I8", "I16", "I32", "I64")
CAST_TYPES = ("F32", "F16", "F64")  # read without gguf.quants (F64 is cast to float32)


class TensorOutsideFile(ValueError):
    """A tensor whose data (from its header offset and size) ends past the end of the file."""


class CheckedReader(GGUFReader):
    """gguf.GGUFReader that checks every tensor's byte range against the file size first;
    `path` is kept for error messages (`gguf_checkpoint.field`)."""

    def __init__(self, path: str):
        self.path = path
        super().__init__(path)

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        file_bytes = len(self.data)
        for info in fields:
            if len(info.parts) != 6:  # another gguf layout: leave the checks to the reader
                continue
            _, name, _, dims, type_id, offset = info.parts
            try:
                kind = GGMLQuantizationType(int(type_id[0]))
            except ValueError:  # the reader names an unknown type id itself
                continue
            block, block_bytes = GGML_QUANT_SIZES[kind]
            start = int(start_offs) + int(offset[0])
            end = start + math.prod(int(d) for d in dims) // block * block_bytes
            if end > file_bytes:
                label = bytes(name).decode("utf-8", "replace")
                raise TensorOutsideFile(
                    f"tensor {label!r} ({kind.name}, shape {[int(d) for d in dims]}) lies past "
                    f"the end of the file: its data spans bytes [{start}, {end}) but the file "
                    f"has {file_bytes} bytes (truncated file or corrupt tensor offset)")
        super()._build_tensors(start_offs, fields)


@functools.lru_cache(maxsize=None)
def tensor_type_readable(kind: GGMLQuantizationType) -> bool:
    """Whether the float loader reads GGUF tensor type `kind` (asks gguf.quants to expand one
    zero block: its NotImplementedError marks the types it cannot)."""
    from gguf.quants import dequantize

    if kind.name in CAST_TYPES:
        return True
    if kind.name in INTEGER_TYPES or kind not in GGML_QUANT_SIZES:
        return False
    _, block_bytes = GGML_QUANT_SIZES[kind]
    try:
        dequantize(np.zeros((1, block_bytes), np.uint8), kind)
    except NotImplementedError:
        return False
    return True


def readable_type_names() -> list[str]:
    """The names of every GGUF tensor type the float loader reads."""
    return [kind.name for kind in GGMLQuantizationType if tensor_type_readable(kind)]


def check_tensor_types(tensors: dict, names, path: str = "<gguf>") -> None:
    """ValueError naming the first of `names` (tensors of `tensors`, name -> ReaderTensor)
    whose type the float loader cannot read, with the types it can."""
    for name in names:
        kind = tensors[name].tensor_type
        if tensor_type_readable(kind):
            continue
        why = " (integer tensors are not weights)" if kind.name in INTEGER_TYPES else ""
        raise ValueError(f"{path}: tensor {name!r} has type {kind.name}{why}; supported: "
                         f"{', '.join(readable_type_names())}")

"""Reads and writes safetensors files with the `safetensors` library (numpy arrays).

Reading is lazy: `open_safetensors` parses and validates the header (the library checks that
the tensors' byte ranges exactly cover the data, so a truncated file fails here) and reads a
tensor only when it is indexed. bfloat16 tensors come back as `ml_dtypes.bfloat16` arrays
(importing ml_dtypes, a jax dependency, registers that dtype with numpy), so bf16 checkpoints
need no torch. Every malformed file raises ValueError naming its path.

Tensor dtypes come from the header (`dtype(name)`): `check_tensor_dtypes` refuses, before any
data is read, a tensor that is not a floating-point weight (FLOAT_DTYPES), e.g. an integer,
bool or FP8 one; reading an FP8 tensor (numpy has no such dtype) is refused the same way.

Example:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "w.safetensors")
    >>> write_safetensors(path, {"norm": np.ones(4, np.float32),
    ...                          "embed": np.zeros((3, 4), ml_dtypes.bfloat16)})
    >>> tensors = open_safetensors(path)
    >>> sorted(tensors), tensors["embed"].dtype, tensors["norm"].shape, tensors.shape("embed")
    (['embed', 'norm'], dtype(bfloat16), (4,), (3, 4))
    >>> write_safetensors(path, {"ids": np.zeros(3, np.int8)})
    >>> check_tensor_dtypes(open_safetensors(path))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: .../w.safetensors: tensor 'ids' is I8; allowed: F32, F16, BF16, F64 (...)
"""
from __future__ import annotations

import os
from collections.abc import Iterator, Mapping

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, which safetensors' numpy path needs)
import numpy as np
import safetensors
import safetensors.numpy

__all__ = ["FLOAT_DTYPES", "INTEGER_DTYPES", "SafetensorsFile", "TensorFiles",
           "check_tensor_dtypes", "open_safetensors", "read_safetensors", "write_safetensors"]

FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")  # header dtypes a weight may have
INTEGER_DTYPES = ("I64", "I32", "I16")  # header dtypes of the few index tensors loaders read
# header dtypes numpy cannot hold (FP8 and smaller floats): refused when read
_NO_NUMPY_DTYPE = ("F8_", "F6_", "F4", "E8M0")


def _unsupported_dtype(path: str, name: str, dtype: str, allowed: tuple[str, ...]) -> str:
    """The message refusing tensor `name` of `path`, stored as `dtype`."""
    kind = "floating-point weights" if allowed == FLOAT_DTYPES else "integer indices"
    if dtype.startswith(_NO_NUMPY_DTYPE):
        return (f"{path}: tensor {name!r} is {dtype}: FP8 (and smaller) checkpoints are not "
                f"supported, dequantize the weights first; allowed: {', '.join(allowed)}")
    return f"{path}: tensor {name!r} is {dtype}; allowed: {', '.join(allowed)} ({kind})"


class SafetensorsFile(Mapping):
    """The tensors of one safetensors file: name -> numpy array, read on access."""

    def __init__(self, path: str):
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            if os.path.exists(self.path):
                raise ValueError(f"{self.path}: not a regular file; allowed: a safetensors file")
            raise FileNotFoundError(f"safetensors file not found: {self.path}")
        try:
            self._handle = safetensors.safe_open(self.path, framework="numpy")
            self._names = tuple(self._handle.keys())
            self.metadata = dict(self._handle.metadata() or {})
        except safetensors.SafetensorError as err:
            raise ValueError(f"{self.path}: truncated or corrupt safetensors file ({err})") \
                from None
        self._name_set = frozenset(self._names)

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._name_set:
            raise KeyError(name)
        dtype = self.dtype(name)
        if dtype.startswith(_NO_NUMPY_DTYPE):
            raise ValueError(_unsupported_dtype(self.path, name, dtype, FLOAT_DTYPES))
        try:
            return self._handle.get_tensor(name)
        except (safetensors.SafetensorError, TypeError) as err:  # TypeError: unknown dtype
            raise ValueError(f"{self.path}: cannot read tensor {name!r} ({err})") from None

    def __contains__(self, name) -> bool:
        return name in self._name_set

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of tensor `name`, from the header (no data is read)."""
        try:
            return tuple(self._handle.get_slice(name).get_shape())
        except safetensors.SafetensorError as err:
            raise ValueError(f"{self.path}: cannot read tensor {name!r} ({err})") from None

    def dtype(self, name: str) -> str:
        """The stored dtype of tensor `name` as the header spells it ("F32", "BF16", "I8",
        "F8_E4M3", ...; no data is read)."""
        try:
            return str(self._handle.get_slice(name).get_dtype())
        except safetensors.SafetensorError as err:
            raise ValueError(f"{self.path}: cannot read tensor {name!r} ({err})") from None

    def path_of(self, name: str) -> str:
        """The file holding tensor `name`: this one."""
        if name not in self._name_set:
            raise KeyError(name)
        return self.path

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __repr__(self) -> str:
        return f"SafetensorsFile({self.path!r}, {len(self)} tensors)"


class TensorFiles(Mapping):
    """Several safetensors files (a sharded checkpoint) seen as one name -> array mapping.

    A tensor name found in two files is an error (ValueError naming both files).
    """

    def __init__(self, files: list[SafetensorsFile]):
        self.files = tuple(files)
        self._owner: dict[str, SafetensorsFile] = {}
        for file in self.files:
            for name in file:
                if name in self._owner:
                    raise ValueError(f"tensor {name!r} is stored twice: in "
                                     f"{self._owner[name].path} and in {file.path}")
                self._owner[name] = file

    def __getitem__(self, name: str) -> np.ndarray:
        return self._owner[name][name]

    def __contains__(self, name) -> bool:
        return name in self._owner

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of tensor `name`, from its file's header (no data is read)."""
        return self._owner[name].shape(name)

    def dtype(self, name: str) -> str:
        """The stored dtype of tensor `name`, from its file's header (no data is read)."""
        return self._owner[name].dtype(name)

    def path_of(self, name: str) -> str:
        """The file holding tensor `name`."""
        return self._owner[name].path

    def __iter__(self) -> Iterator[str]:
        return iter(self._owner)

    def __len__(self) -> int:
        return len(self._owner)


def open_safetensors(path: str) -> SafetensorsFile:
    """A lazy name -> numpy array mapping over one file (header validated now).

    Raises FileNotFoundError for a missing file and ValueError naming the path for a
    truncated or corrupt one.
    """
    return SafetensorsFile(path)


def check_tensor_dtypes(tensors: SafetensorsFile | TensorFiles, *,
                        skipped: tuple[str, ...] = (), integer: tuple[str, ...] = ()) -> None:
    """ValueError naming the file, the tensor and its dtype for the first tensor (from the
    headers, before any data is read) that is not floating point (FLOAT_DTYPES). Names
    starting with a `skipped` prefix (parts a loader does not read) are not checked; the
    tensors named in `integer` must hold integers (INTEGER_DTYPES) instead."""
    for name in tensors:
        if skipped and name.startswith(skipped):
            continue
        allowed = INTEGER_DTYPES if name in integer else FLOAT_DTYPES
        dtype = tensors.dtype(name)
        if dtype not in allowed:
            raise ValueError(_unsupported_dtype(tensors.path_of(name), name, dtype, allowed))


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """All tensors of one file as numpy arrays (read now)."""
    file = open_safetensors(path)
    return {name: file[name] for name in file}


def write_safetensors(path: str, tensors: Mapping[str, np.ndarray],
                      metadata: dict[str, str] | None = None) -> None:
    """Writes numpy arrays (bfloat16 included) to `path` with `safetensors.numpy.save_file`."""
    arrays = {name: np.ascontiguousarray(array) for name, array in tensors.items()}
    safetensors.numpy.save_file(arrays, os.fspath(path), metadata=metadata)

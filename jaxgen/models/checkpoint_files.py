"""Reading a checkpoint folder's own files: its JSON files and the shard names its index lists.

Trust: symlinks inside the folder are followed wherever they point (they are the folder
owner's choice; the Hugging Face hub cache links `snapshots/<rev>/model.safetensors` to
`../../blobs/<hash>`). Names read from the checkpoint's own JSON files (the shards of
`model.safetensors.index.json`) must stay inside the folder: a plain relative path, without
`..` and not absolute (`shard_path`). A JSON file that is not UTF-8, not JSON or nested too
deeply, and a path that is not a regular file (a folder, a FIFO, a device), raise ValueError
naming the path.

Example:
    >>> import tempfile
    >>> folder = tempfile.mkdtemp()
    >>> index = os.path.join(folder, "model.safetensors.index.json")
    >>> shard_path(folder, index, "w", "part-1.safetensors") == os.path.join(
    ...     folder, "part-1.safetensors")
    True
    >>> shard_path(folder, "index.json", "w", "../x.safetensors")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: index.json: weight_map['w']='../x.safetensors' leaves the checkpoint folder; ...
    >>> with open(os.path.join(folder, "config.json"), "w") as f:
    ...     _ = f.write("[" * 100000)
    >>> read_json_file(os.path.join(folder, "config.json"))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: .../config.json: invalid JSON (nested too deeply)
"""
from __future__ import annotations

import json
import os

__all__ = ["MAX_JSON_BYTES", "read_json_file", "read_text", "require_regular_file",
           "shard_path"]

MAX_JSON_BYTES = 64 << 20  # a config / index / side file larger than this is refused unread


def require_regular_file(path: str) -> bool:
    """Whether `path` (symlinks followed) is a regular file: False when nothing is there,
    ValueError naming it when something else is (a folder, a FIFO, a device)."""
    if os.path.isfile(path):
        return True
    if os.path.exists(path):
        raise ValueError(f"{path}: not a regular file; allowed: a file")
    return False


def read_json_file(path: str, required: bool = True):
    """The parsed content of the JSON file `path` (any JSON value), or None when it is absent
    and not `required` (FileNotFoundError when it is). ValueError naming the path for a
    file that is not UTF-8, not JSON, nested too deeply, larger than MAX_JSON_BYTES, or not a
    regular file."""
    if not require_regular_file(path):
        if required:
            raise FileNotFoundError(f"missing file: {path}")
        return None
    text = read_text(path)
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"{path}: invalid JSON (nested too deeply)") from None
    except ValueError as err:  # JSONDecodeError, or an int longer than Python parses
        raise ValueError(f"{path}: invalid JSON ({err})") from None


def read_json_object(path: str, required: bool = True) -> dict | None:
    """`read_json_file(path, required)` for a file that must hold a JSON object (config.json,
    generation_config.json): ValueError naming the path and what it holds otherwise.

    Example:
        >>> import json, os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "generation_config.json")
        >>> read_json_object(path, required=False) is None
        True
        >>> _ = open(path, "w").write(json.dumps([1]))
        >>> read_json_object(path)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: .../generation_config.json holds a list, expected an object
    """
    value = read_json_file(path, required)
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"{path} holds a {type(value).__name__}, expected an object")
    return value


def read_text(path: str) -> str:
    """The UTF-8 text of the file `path`; ValueError naming it when it holds more than
    MAX_JSON_BYTES or bytes that are not UTF-8."""
    size = os.path.getsize(path)
    if size > MAX_JSON_BYTES:
        raise ValueError(f"{path}: {size:,} bytes, past the {MAX_JSON_BYTES:,} a checkpoint's "
                         f"JSON or text file may hold (configs and indexes are kilobytes)")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") \
            from None


def shard_path(folder: str, index_path: str, tensor: str, entry) -> str:
    """The path of the shard the index `index_path` lists for `tensor` (`entry`: its
    weight_map value), checked to stay inside `folder`: a non-empty relative path without a
    `..` part. ValueError naming the index, the tensor and the entry otherwise."""
    allowed = "allowed: a file name relative to the folder, without '..'"
    where = f"{index_path}: weight_map[{tensor!r}]={entry!r}"
    if not isinstance(entry, str):
        raise ValueError(f"{where} is not a string ({type(entry).__name__}); {allowed}")
    if not entry or "\x00" in entry:
        raise ValueError(f"{where} is not a file name; {allowed}")
    if os.path.isabs(entry) or os.path.splitdrive(entry)[0] or ".." in entry.replace(
            os.sep, "/").split("/"):
        raise ValueError(f"{where} leaves the checkpoint folder; {allowed}")
    relative = os.path.normpath(entry)
    if relative in (".", "") or relative.split(os.sep)[0] == "..":
        raise ValueError(f"{where} is not a file in the checkpoint folder; {allowed}")
    return os.path.join(folder, relative)

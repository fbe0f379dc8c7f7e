"""A pytree's structure (a `PyTreeDef`) as plain JSON values, and back, without pickle.

The executable cache stores a program's output tree with it. A node is written as its type's
name and its aux data; reading resolves a type name only from an allowlist (Python's
containers, and classes defined in jaxgen's or jax's own modules), and aux data holds only
plain values: None, booleans, integers, floats, strings, tuples, lists, dicts, frozensets,
numpy dtypes, jaxgen enums and jaxgen's frozen dataclasses (rebuilt from their fields).
Anything else is `NotEncodable`; a name outside the allowlist is a ValueError on reading.
Nothing read ever runs code but a listed class's constructor.

Example:
    >>> tree = jax.tree_util.tree_structure(({"a": 1, "b": None}, [2, 3]))
    >>> encoded = encode_tree(tree)
    >>> decode_tree(json.loads(json.dumps(encoded))) == tree
    True
    >>> decode_tree({"type": "os:system", "aux": None, "children": []})
    Traceback (most recent call last):
    ...
    ValueError: tree node type 'os:system' is not an allowed pytree class
"""
from __future__ import annotations

import collections
import dataclasses
import enum
import importlib
import json  # noqa: F401  (the doctest)
import sys

import jax
import numpy as np

# containers of Python's own that may be tree nodes (and nothing else from outside jaxgen / jax)
_BUILTIN_NODES = {
    "builtins:tuple": tuple, "builtins:list": list, "builtins:dict": dict,
    "builtins:NoneType": type(None), "collections:OrderedDict": collections.OrderedDict,
}
_OWN_MODULES = ("jaxgen", "jax")  # and their submodules: code the cache key covers


class NotEncodable(ValueError):
    """A tree (or aux value) that has no plain-JSON form here."""


def _name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _own(module: str) -> bool:
    return module.split(".", 1)[0] in _OWN_MODULES


def resolve_class(name: str) -> type:
    """The class `name` ("module:qualname") names, when it is allowed: one of Python's
    containers, or a class defined in jaxgen's or jax's modules. ValueError otherwise."""
    if name in _BUILTIN_NODES:
        return _BUILTIN_NODES[name]
    module_name, _, qualname = name.partition(":")
    if not (_own(module_name) and qualname) or "<" in qualname:
        raise ValueError(f"tree node type {name!r} is not an allowed pytree class")
    module = sys.modules.get(module_name) or importlib.import_module(module_name)
    value = module
    for part in qualname.split("."):
        value = getattr(value, part)
    if not isinstance(value, type) or _name(value) != name:
        raise ValueError(f"tree node type {name!r} is not an allowed pytree class")
    return value


def encode_value(value):
    """`value` (aux data) as JSON values; NotEncodable when it is not one of the plain kinds."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int) and type(value) is int:
        return value
    if type(value) is float:
        return {"float": value.hex()}
    if type(value) is tuple:
        return {"tuple": [encode_value(item) for item in value]}
    if type(value) is list:
        return {"list": [encode_value(item) for item in value]}
    if type(value) is dict:
        return {"dict": [[encode_value(k), encode_value(v)] for k, v in value.items()]}
    if type(value) is frozenset:
        items = [encode_value(item) for item in value]
        return {"frozenset": sorted(items, key=repr)}
    if isinstance(value, np.dtype):
        return {"dtype": value.name}
    if isinstance(value, enum.Enum) and _own(type(value).__module__):
        return {"enum": _name(type(value)), "member": value.name}
    if (dataclasses.is_dataclass(value) and not isinstance(value, type)
            and type(value).__dataclass_params__.frozen
            and type(value).__module__.split(".", 1)[0] == "jaxgen"):
        fields = [[field.name, encode_value(getattr(value, field.name))]
                  for field in dataclasses.fields(value) if field.init]
        return {"dataclass": _name(type(value)), "fields": fields}
    raise NotEncodable(f"{type(value).__module__}.{type(value).__qualname__} has no plain form")


def decode_value(data):
    """The value `encode_value` wrote."""
    if data is None or isinstance(data, (bool, int, str)):
        return data
    if not isinstance(data, dict) or len(data) not in (1, 2):
        raise ValueError(f"not an encoded value: {str(data)[:80]}")
    if "float" in data:
        return float.fromhex(data["float"])
    if "tuple" in data:
        return tuple(decode_value(item) for item in data["tuple"])
    if "list" in data:
        return [decode_value(item) for item in data["list"]]
    if "dict" in data:
        return {decode_value(k): decode_value(v) for k, v in data["dict"]}
    if "frozenset" in data:
        return frozenset(decode_value(item) for item in data["frozenset"])
    if "dtype" in data:
        return np.dtype(jax.numpy.dtype(data["dtype"]))
    if "enum" in data:
        cls = resolve_class(data["enum"])
        if not issubclass(cls, enum.Enum):
            raise ValueError(f"{data['enum']} is not an enum")
        return cls[data["member"]]
    if "dataclass" in data:
        cls = resolve_class(data["dataclass"])
        if not (dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen
                and cls.__module__.split(".", 1)[0] == "jaxgen"):
            raise ValueError(f"{data['dataclass']} is not a frozen jaxgen dataclass")
        return cls(**{name: decode_value(value) for name, value in data["fields"]})
    raise ValueError(f"not an encoded value: {str(data)[:80]}")


def encode_tree(tree) -> dict | None:
    """A PyTreeDef as JSON values: None for a leaf, else {"type", "aux", "children"}.
    NotEncodable when a node type is not allowed or its aux data is not plain."""
    node = tree.node_data()
    if node is None:
        return None
    cls, aux = node
    name = _name(cls)
    try:
        allowed = resolve_class(name) is cls
    except (ValueError, ImportError, AttributeError):
        allowed = False
    if not allowed:
        raise NotEncodable(f"tree node type {name} is not jaxgen's, jax's or a container")
    return {"type": name, "aux": encode_value(aux),
            "children": [encode_tree(child) for child in tree.children()]}


_LEAF = jax.tree_util.tree_structure(0)


def decode_tree(data):
    """The PyTreeDef `encode_tree` wrote (ValueError when it names a class not allowed)."""
    if data is None:
        return _LEAF
    from jax._src.tree_util import default_registry

    cls = resolve_class(data["type"])
    children = [decode_tree(child) for child in data["children"]]
    return jax.tree_util.PyTreeDef.from_node_data_and_children(
        default_registry, (cls, decode_value(data["aux"])), children)


__all__ = ["NotEncodable", "decode_tree", "decode_value", "encode_tree", "encode_value",
           "resolve_class"]

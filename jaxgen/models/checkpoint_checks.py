"""Checks the checkpoint loaders share: the weights' dtype, every weight finite, no tensor
left unused.

Strictness: a loader raises when a file holds tensors its config does not use (a config.json
saying 1 layer over weights for 2 would otherwise load 1 layer and drop the rest). Tensors
that are expected but consumed elsewhere are let through by name prefix: each loader takes an
`allowed_extra` tuple of prefixes (empty by default, i.e. strict). That is the hook for
options that read extra tensors from the same file (e.g. multi-token-prediction layers).

Example:
    >>> require_finite("w", np.array([1.0, np.nan], np.float32), "ckpt.gguf")
    Traceback (most recent call last):
    ...
    ValueError: ckpt.gguf: tensor 'w' holds 1 non-finite value(s) (NaN or inf) out of 2
    >>> reject_unexpected(["blk.1.attn_q.weight", "extra.bias"], ["extra."], "ckpt.gguf")
    Traceback (most recent call last):
    ...
    ValueError: ckpt.gguf: 1 tensor(s) that this config does not use: blk.1.attn_q.weight
"""
from __future__ import annotations

from collections.abc import Iterable

import jax.numpy as jnp
import numpy as np

SHOWN_NAMES = 5  # how many tensor names an error lists


def require_finite(name: str, array: np.ndarray, where: str = "") -> None:
    """Raises ValueError naming `name` when a floating-point `array` holds a NaN or an inf.

    One host pass over the tensor (numpy; bfloat16 through ml_dtypes); integer tensors pass.
    """
    array = np.asarray(array)
    if array.dtype.kind in "biu":
        return
    finite = np.isfinite(array)
    if finite.all():
        return
    bad = int(finite.size - np.count_nonzero(finite))
    prefix = f"{where}: " if where else ""
    raise ValueError(f"{prefix}tensor {name!r} holds {bad} non-finite value(s) (NaN or inf) "
                     f"out of {finite.size}")


def names_list(names: list[str]) -> str:
    """'a, b, c (+N more)' with at most SHOWN_NAMES names."""
    shown = ", ".join(names[:SHOWN_NAMES])
    more = len(names) - SHOWN_NAMES
    return shown + (f" (+{more} more)" if more > 0 else "")


def reject_unexpected(unused: Iterable[str], allowed_extra: Iterable[str], where: str,
                      hint: str = "") -> None:
    """Raises ValueError listing the `unused` tensor names that no `allowed_extra` prefix
    covers (sorted; the first SHOWN_NAMES of them)."""
    prefixes = tuple(allowed_extra)
    unexpected = sorted(n for n in unused if not (prefixes and n.startswith(prefixes)))
    if not unexpected:
        return
    prefix = f"{where}: " if where else ""
    raise ValueError(f"{prefix}{len(unexpected)} tensor(s) that this config does not use: "
                     f"{names_list(unexpected)}{hint}")


LOAD_DTYPES = ("float32", "bfloat16")  # the dtypes load() gives weights


def check_load_dtype(dtype) -> jnp.dtype:
    """`dtype` as a jnp dtype when it names one of LOAD_DTYPES (jnp.float32, np.float32 and
    "float32" alike); a ValueError naming it and the allowed dtypes otherwise.

    Example:
        >>> check_load_dtype("bfloat16"), check_load_dtype(jnp.float32)
        (dtype(bfloat16), dtype('float32'))
        >>> check_load_dtype("int8")
        Traceback (most recent call last):
        ...
        ValueError: dtype='int8' is not supported; allowed: float32, bfloat16
    """
    try:
        name = None if isinstance(dtype, bool) else jnp.dtype(dtype).name
    except (TypeError, ValueError):
        name = None
    if name not in LOAD_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; allowed: {', '.join(LOAD_DTYPES)}")
    return jnp.dtype(name)

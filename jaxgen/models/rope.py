"""Rotary position embeddings as Hugging Face computes them (rotate_half convention).

Supported `rope_type`s: "default", "linear", "dynamic" (NTK-aware), "llama3". The scaling
dict is stored frozen (a sorted tuple of items) so configs stay hashable.

Dynamic NTK: HF recomputes inv_freq from seq_len = max(position_ids) + 1 whenever it grows past
`max_position_embeddings` (and keeps the grown value until seq_len drops back below it). Here
seq_len is derived, per row, from this call's position values, so it is jit-friendly:
    seq_len[b] = max(positions[b]) + 1
For one sequence decoded left to right this equals HF exactly (each new step is a new maximum).
Differences: HF takes the max over the whole batch, we take it per row (a row's numbers never
depend on its batch mates), and HF keeps a grown frequency after a rollback to a shorter length
while we recompute from the positions.

Example:
    >>> cos, sin = cos_sin(jnp.arange(4)[None], 8, 10000.0, None, 2048, jnp.float32)
    >>> cos.shape
    (1, 4, 8)
"""
from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxgen.models.config_checks import FLOAT32_MAX, INT32_MAX, check_float, check_int

ROPE_TYPES = ("default", "linear", "dynamic", "llama3")


def freeze(value: Any) -> Any:
    """dicts -> sorted tuple of (key, frozen value); lists -> tuples. Makes JSON hashable."""
    if isinstance(value, dict):
        return tuple(sorted((str(k), freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    return value


def normalize(scaling: dict | None) -> tuple | None:
    """HF `rope_scaling`/`rope_parameters` (rope_theta removed) -> frozen items or None."""
    if not scaling:
        return None
    scaling = dict(scaling)
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rope_type == "default":
        return None
    scaling["rope_type"] = rope_type
    validate(scaling)
    return freeze(scaling)


def validate(scaling: dict) -> None:
    rope_type = scaling.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
    needed = {"linear": ("factor",), "dynamic": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor")}.get(rope_type, ())
    missing = [k for k in needed if k not in scaling]
    if missing:
        raise ValueError(f"rope_type {rope_type!r} needs {missing}")
    if "factor" in needed:  # HF's rule: a scaling factor >= 1 (0 would divide by zero)
        check_float("rope_scaling.factor", scaling["factor"], 1.0, FLOAT32_MAX,
                    low_included=True)
    if rope_type == "llama3":
        low = check_float("rope_scaling.low_freq_factor", scaling["low_freq_factor"], 0.0,
                          FLOAT32_MAX)
        high = check_float("rope_scaling.high_freq_factor", scaling["high_freq_factor"], 0.0,
                           FLOAT32_MAX)
        if high <= low:  # the smoothing divides by high - low
            raise ValueError(f"rope_scaling.high_freq_factor={high} must be greater than "
                             f"low_freq_factor={low}")
        if "original_max_position_embeddings" in scaling:
            check_int("rope_scaling.original_max_position_embeddings",
                      scaling["original_max_position_embeddings"], 1, INT32_MAX)


def _exponents(dim: int) -> np.ndarray:
    return np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)  # [Dh/2]


def inv_freq(head_dim: int, theta: float, scaling: tuple | None,
             max_position_embeddings: int) -> np.ndarray:
    """Static inverse frequencies float32 [Dh/2] for default / linear / llama3 (and dynamic at
    seq_len <= max_position_embeddings)."""
    freqs = np.float32(1.0) / (np.float32(theta) ** _exponents(head_dim))  # [Dh/2]
    params = dict(scaling or ())
    rope_type = params.get("rope_type", "default")
    if rope_type == "linear":
        freqs = freqs / np.float32(params["factor"])
    elif rope_type == "llama3":
        factor = params["factor"]
        low, high = params["low_freq_factor"], params["high_freq_factor"]
        old_len = params.get("original_max_position_embeddings", max_position_embeddings)
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = np.float32(2 * math.pi) / freqs  # [Dh/2]
        scaled = np.where(wavelen > low_wavelen, freqs / np.float32(factor), freqs)  # [Dh/2]
        smooth = (np.float32(old_len) / wavelen - np.float32(low)) / np.float32(high - low)
        smoothed = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled  # [Dh/2]
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)  # [Dh/2]
        freqs = np.where(medium, smoothed, scaled)
    return freqs.astype(np.float32)


def _dynamic_inv_freq(positions: jnp.ndarray, head_dim: int, theta: float, factor: float,
                      max_position_embeddings: int) -> jnp.ndarray:
    """Per-row NTK-scaled inverse frequencies float32 [B, Dh/2] (see module docstring)."""
    seq_len = (jnp.max(positions, axis=1) + 1).astype(jnp.float32)  # [B]
    seq_len = jnp.maximum(seq_len, jnp.float32(max_position_embeddings))  # [B]
    ratio = (factor * seq_len / max_position_embeddings) - (factor - 1)  # [B]
    base = theta * ratio ** (head_dim / (head_dim - 2))  # [B]
    return 1.0 / (base[:, None] ** jnp.asarray(_exponents(head_dim)))  # [B, Dh/2]


def cos_sin(positions: jnp.ndarray, head_dim: int, theta: float, scaling: tuple | None,
            max_position_embeddings: int, dtype) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos, sin [B, S, Dh] in `dtype` for int positions [B, S] (HF: cat(freqs, freqs))."""
    params = dict(scaling or ())
    pos = positions.astype(jnp.float32)  # [B, S]
    if params.get("rope_type") == "dynamic":
        freqs_per_row = _dynamic_inv_freq(positions, head_dim, theta, float(params["factor"]),
                                          max_position_embeddings)  # [B, Dh/2]
        freqs = pos[:, :, None] * freqs_per_row[:, None, :]  # [B, S, Dh/2]
    else:
        table = jnp.asarray(inv_freq(head_dim, theta, scaling, max_position_embeddings))
        freqs = pos[:, :, None] * table  # [B, S, Dh/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # [B, S, Dh]
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


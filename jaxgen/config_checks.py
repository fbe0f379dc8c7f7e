"""Eager validation of the logits-processor and stopping fields of `GenerationConfig`.

Every error is a ValueError that names the field and the allowed values, raised when the
config is built (or, for token ids, when `init_state` sees the model's vocabulary), before
anything is compiled. Traced values (inside `jax.vmap`) are not checked.

Example:
    >>> GenerationConfig(min_p=1.5)
    Traceback (most recent call last):
    ValueError: `min_p` must be a float in [0, 1] (None disables it), got 1.5
"""
from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

FILTER_IMPLS = ("search", "sort")


def _concrete(value) -> bool:
    return not isinstance(value, jax.core.Tracer)


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _range(name: str, value, *, low=None, high=None, low_open=False, high_open=False,
           allowed: str) -> None:
    if value is None or not _concrete(value):
        return
    try:
        values = np.asarray(value, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        raise ValueError(f"`{name}` must be {allowed}, got {value!r}") from None
    bad = ~np.isfinite(values)
    if low is not None:
        bad |= (values <= low) if low_open else (values < low)
    if high is not None:
        bad |= (values >= high) if high_open else (values > high)
    if bad.any():
        raise ValueError(f"`{name}` must be {allowed}, got {value!r}")


def _int_field(name: str, value, *, allow_none: bool, allowed: str) -> None:
    if value is None:
        if allow_none:
            return
        raise ValueError(f"`{name}` must be {allowed}, got None")
    if not _concrete(value):
        return
    array = np.asarray(value)
    if (array.dtype == bool or not np.issubdtype(array.dtype, np.integer)
            or (array < 0).any()):
        raise ValueError(f"`{name}` must be {allowed}, got {value!r}")


def _id_list(name: str, value, *, allow_int: bool = False) -> tuple[int, ...]:
    allowed = "a list of non-negative token ids" + (" (or one id)" if allow_int else "")
    if allow_int and _is_int(value):
        value = [value]
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ValueError(f"`{name}` must be {allowed}, got {value!r}")
    ids = list(value)
    if not ids or any(not _is_int(t) or t < 0 for t in ids):
        raise ValueError(f"`{name}` must be {allowed} (non-empty), got {value!r}")
    return tuple(int(t) for t in ids)


def _sequence_bias_pairs(value) -> list[tuple[tuple[int, ...], Any]]:
    allowed = ("a non-empty list of [token_ids, bias] pairs (or a dict {tuple(token_ids): "
               "bias}) with non-empty lists of non-negative ids and float biases")
    if isinstance(value, dict):
        pairs = list(value.items())
    elif isinstance(value, (list, tuple)):
        pairs = list(value)
    else:
        raise ValueError(f"`sequence_bias` must be {allowed}, got {value!r}")
    if not pairs:
        raise ValueError(f"`sequence_bias` must be {allowed}, got {value!r}")
    out = []
    for pair in pairs:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ValueError(f"`sequence_bias` must be {allowed}, got the entry {pair!r}")
        ids, bias = pair
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            raise ValueError(f"`sequence_bias` must be {allowed}, got the entry {pair!r}")
        ids = list(ids)
        if not ids or any(not _is_int(t) or t < 0 for t in ids):
            raise ValueError(f"`sequence_bias` must be {allowed}, got the entry {pair!r}")
        if (isinstance(bias, bool) or not isinstance(bias, (int, float, np.floating, np.integer))
                or math.isnan(float(bias))):
            raise ValueError(f"`sequence_bias` must be {allowed}, got the bias {bias!r}")
        out.append((tuple(int(t) for t in ids), bias))
    return out


def validate_processor_fields(cfg) -> None:
    """Checks (and normalises) the processor / stopping fields of a GenerationConfig."""
    set_ = lambda k, v: object.__setattr__(cfg, k, v)  # noqa: E731
    _range("repetition_penalty", cfg.repetition_penalty, low=0.0, low_open=True,
           allowed="a float > 0 (1.0 disables it)")
    for name in ("presence_penalty", "frequency_penalty"):
        _range(name, getattr(cfg, name), low=-2.0, high=2.0,
               allowed="a float in [-2, 2] (0.0 disables it)")
    _range("min_p", cfg.min_p, low=0.0, high=1.0, allowed="a float in [0, 1] (None disables it)")
    _range("typical_p", cfg.typical_p, low=0.0, high=1.0, low_open=True,
           allowed="a float in (0, 1] (1.0 disables it)")
    for name in ("epsilon_cutoff", "eta_cutoff"):
        _range(name, getattr(cfg, name), low=0.0, high=1.0, high_open=True,
               allowed="a float in [0, 1) (0.0 disables it)")
    _int_field("min_length", cfg.min_length, allow_none=False, allowed="an int >= 0")
    _int_field("min_new_tokens", cfg.min_new_tokens, allow_none=True,
               allowed="an int >= 0 or None")
    if not _is_int(cfg.no_repeat_ngram_size) or cfg.no_repeat_ngram_size < 0:
        raise ValueError(f"`no_repeat_ngram_size` must be an int >= 0 (0 disables it), got "
                         f"{cfg.no_repeat_ngram_size!r}")
    if cfg.bad_words_ids is not None:
        value = cfg.bad_words_ids
        allowed = "a non-empty list of non-empty lists of non-negative token ids"
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or not value:
            raise ValueError(f"`bad_words_ids` must be {allowed}, got {value!r}")
        for seq in value:
            if (isinstance(seq, (str, bytes)) or not isinstance(seq, (list, tuple)) or not seq
                    or any(not _is_int(t) or t < 0 for t in seq)):
                raise ValueError(f"`bad_words_ids` must be {allowed}, got the entry {seq!r}")
    if cfg.sequence_bias is not None:
        _sequence_bias_pairs(cfg.sequence_bias)
    if cfg.forced_bos_token_id is not None and (not _is_int(cfg.forced_bos_token_id)
                                                or cfg.forced_bos_token_id < 0):
        raise ValueError(f"`forced_bos_token_id` must be a non-negative token id, got "
                         f"{cfg.forced_bos_token_id!r}")
    if cfg.forced_eos_token_id is not None:
        _id_list("forced_eos_token_id", cfg.forced_eos_token_id, allow_int=True)
    for name in ("suppress_tokens", "begin_suppress_tokens"):
        if getattr(cfg, name) is not None:
            _id_list(name, getattr(cfg, name))
    for name in ("remove_invalid_values", "renormalize_logits"):
        if not isinstance(getattr(cfg, name), (bool, np.bool_)):
            raise ValueError(f"`{name}` must be True or False, got {getattr(cfg, name)!r}")
    decay = cfg.exponential_decay_length_penalty
    if decay is not None:
        if (not isinstance(decay, (list, tuple)) or len(decay) != 2 or not _is_int(decay[0])
                or decay[0] < 0 or isinstance(decay[1], bool)
                or not isinstance(decay[1], (int, float, np.floating))
                or not math.isfinite(float(decay[1])) or float(decay[1]) <= 0):
            raise ValueError(f"`exponential_decay_length_penalty` must be a pair (start_index: "
                             f"int >= 0, decay_factor: float > 0), got {decay!r}")
        set_("exponential_decay_length_penalty", (int(decay[0]), float(decay[1])))
    strings = cfg.stop_strings
    if strings is not None:
        if isinstance(strings, str):
            strings = (strings,)
        if (not isinstance(strings, (list, tuple)) or not strings
                or any(not isinstance(s, str) or not s for s in strings)):
            raise ValueError(f"`stop_strings` must be a non-empty string or a non-empty list of "
                             f"non-empty strings, got {cfg.stop_strings!r}")
        set_("stop_strings", tuple(strings))
    impl = getattr(cfg, "filter_impl", "search")
    if impl not in FILTER_IMPLS:
        raise ValueError(f"`filter_impl` must be one of {FILTER_IMPLS}, got {impl!r}")


def validate_processor_ids(cfg, vocab_size: int) -> None:
    """Token ids named by processor fields must lie in 0..vocab_size-1."""
    def check(name, ids, shown):
        bad = sorted({t for t in ids if t >= vocab_size})
        if bad:
            raise ValueError(f"`{name}`={shown!r} holds token id(s) {bad} outside the "
                             f"vocabulary (allowed: 0..{vocab_size - 1})")

    if cfg.bad_words_ids is not None:
        check("bad_words_ids", [t for seq in cfg.bad_words_ids for t in seq], cfg.bad_words_ids)
    if cfg.sequence_bias is not None:
        pairs = _sequence_bias_pairs(cfg.sequence_bias)
        check("sequence_bias", [t for ids, _ in pairs for t in ids], cfg.sequence_bias)
    if cfg.forced_bos_token_id is not None:
        check("forced_bos_token_id", [cfg.forced_bos_token_id], cfg.forced_bos_token_id)
    if cfg.forced_eos_token_id is not None:
        check("forced_eos_token_id", _id_list("forced_eos_token_id", cfg.forced_eos_token_id,
                                              allow_int=True), cfg.forced_eos_token_id)
    for name in ("suppress_tokens", "begin_suppress_tokens"):
        if getattr(cfg, name) is not None:
            check(name, list(getattr(cfg, name)), getattr(cfg, name))

"""Eager validation of the fields of `GenerationConfig`: the shared checks (ints, floats,
token ids) and the logits-processor and stopping fields.

Every error is a ValueError that names the field and the allowed values, raised when the
config is built (or, for token ids, when `init_state` sees the model's vocabulary), before
anything is compiled. Traced values (inside `jax.vmap`) are not checked.

jaxgen computes in int32 and float32: an int past 2**31 - 1 or a float past float32's
largest finite value is refused here rather than overflowing later.

Example:
    >>> from jaxgen import GenerationConfig
    >>> GenerationConfig(min_p=1.5)
    Traceback (most recent call last):
    ValueError: `min_p` must be a float in [0, 1] (None disables it), got 1.5
    >>> GenerationConfig(max_new_tokens=2**31)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: `max_new_tokens`=2147483648 is past the int32 range ...: at most 2**31 - 1 ...
"""
from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

FILTER_IMPLS = ("search", "sort")
INT32_MAX = 2**31 - 1
FLOAT32_MAX = float(np.finfo(np.float32).max)
# Stop strings: their device tables hold vocabulary rows x strings x characters booleans
# (jaxgen/stopping/strings.py), so both axes are bounded.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 256


def check_stop_strings(strings) -> tuple[str, ...]:
    """`stop_strings` as a tuple, or a ValueError naming the field and its bounds: a non-empty
    string or list of non-empty strings, at most MAX_STOP_STRINGS of at most
    MAX_STOP_STRING_CHARS characters each.

    >>> check_stop_strings("stop")
    ('stop',)
    >>> check_stop_strings(["a" * 300])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: `stop_strings` allows at most 64 strings of at most 256 characters each, ...
    """
    given = strings
    if isinstance(strings, str):
        strings = (strings,)
    if (not isinstance(strings, (list, tuple)) or not strings
            or any(not isinstance(s, str) or not s for s in strings)):
        raise ValueError(f"`stop_strings` must be a non-empty string or a non-empty list of "
                         f"non-empty strings, got {given!r}")
    longest = max(map(len, strings))
    if len(strings) > MAX_STOP_STRINGS or longest > MAX_STOP_STRING_CHARS:
        raise ValueError(f"`stop_strings` allows at most {MAX_STOP_STRINGS} strings of at most "
                         f"{MAX_STOP_STRING_CHARS} characters each, got {len(strings)} "
                         f"string(s), the longest {longest} characters")
    return tuple(strings)


def _concrete(value) -> bool:
    return not isinstance(value, jax.core.Tracer)


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_int(name: str, value, *, low: int = 0, allowed: str | None = None,
              allow_none: bool = False, per_row: bool = False, shown: str | None = None) -> None:
    """The one int check: `value` is an int in [low, 2**31 - 1] (jaxgen computes in int32).

    allow_none: None is accepted. per_row: an int array (or a list of ints) is accepted too,
    each value checked. Traced values are not checked. `allowed` describes the valid values
    in the message (default "an int >= low"); `shown` replaces the repr of `value` after
    "got" (e.g. "the entry [1, -2]" for one element of a list field).

    Example:
        >>> from jaxgen.config.fields import check_int
        >>> check_int("top_k", 10**12)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: `top_k`=1000000000000 is past the int32 range ... (allowed: an int >= 0)
    """
    if allowed is None:
        allowed = f"an int >= {low}" + (" or None" if allow_none else "")
    custom = shown is not None
    shown = repr(value) if shown is None else shown
    if value is None:
        if allow_none:
            return
        raise ValueError(f"`{name}` must be {allowed}, got {shown}")
    if not _concrete(value):
        return
    if _is_int(value):
        values = [int(value)]
    elif per_row and not isinstance(value, (str, bytes, dict)):
        try:
            array = np.asarray(value)
        except (TypeError, ValueError, OverflowError):
            raise ValueError(f"`{name}` must be {allowed}, got {shown}") from None
        if array.dtype.kind in "iu":
            values = [int(array.min()), int(array.max())] if array.size else []
        elif array.dtype == object and all(_is_int(v) for v in array.reshape(-1)):
            values = [int(v) for v in array.reshape(-1)]
        else:
            raise ValueError(f"`{name}` must be {allowed}, got {shown}")
        custom = True
    else:
        raise ValueError(f"`{name}` must be {allowed}, got {shown}")
    if any(v < low for v in values):
        raise ValueError(f"`{name}` must be {allowed}, got {shown}")
    if any(v > INT32_MAX for v in values):
        what = f" ({shown}) holds {max(values)}, which" if custom else f"={shown}"
        raise ValueError(f"`{name}`{what} is past the int32 range jaxgen computes in: at most "
                         f"2**31 - 1 = {INT32_MAX} (allowed: {allowed})")


def check_float(name: str, value, *, low=None, high=None, low_open=False, high_open=False,
                allowed: str, shown: str | None = None) -> None:
    """A float (or, for the dynamic fields, a per-row array of floats) in a range, finite in
    float32. None and traced values are not checked. `shown` as in `check_int`."""
    if value is None or not _concrete(value):
        return
    shown = repr(value) if shown is None else shown
    if isinstance(value, (str, bytes, dict)):
        raise ValueError(f"`{name}` must be {allowed}, got {shown}")
    try:
        array = np.asarray(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"`{name}` must be {allowed}, got {shown}") from None
    if array.dtype.kind not in "iuf" and not (
            array.dtype == object and all(_is_int(v) or isinstance(v, float)
                                          for v in array.reshape(-1))):
        raise ValueError(f"`{name}` must be {allowed}, got {shown}")
    try:
        values = array.astype(np.float64).reshape(-1)
    except OverflowError:  # an int too large for a float
        values = np.array([math.inf])
    bad = ~np.isfinite(values)
    if low is not None:
        bad |= (values <= low) if low_open else (values < low)
    if high is not None:
        bad |= (values >= high) if high_open else (values > high)
    if bad.any():
        raise ValueError(f"`{name}` must be {allowed}, got {shown}")
    if (np.abs(values) > FLOAT32_MAX).any():
        raise ValueError(f"`{name}`={shown} overflows float32, the dtype jaxgen computes in "
                         f"(allowed: {allowed}, at most {FLOAT32_MAX:.4g} in magnitude)")


def check_bool(name: str, value) -> None:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"`{name}` must be True or False, got {value!r}")


def _token_ids(name: str, ids, allowed: str, shown: str) -> tuple[int, ...]:
    """Each of `ids` is a token id in [0, 2**31 - 1]; returns them as a tuple of ints."""
    for token in ids:
        check_int(name, token, low=0, allowed=allowed, shown=shown)
    return tuple(int(t) for t in ids)


def _id_list(name: str, value, *, allow_int: bool = False) -> tuple[int, ...]:
    allowed = "a non-empty list of non-negative token ids" + (" (or one id)" if allow_int else "")
    if allow_int and _is_int(value):
        check_int(name, value, allowed=allowed)
        return (int(value),)
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ValueError(f"`{name}` must be {allowed}, got {value!r}")
    ids = list(value)
    if not ids:
        raise ValueError(f"`{name}` must be {allowed}, got {value!r}")
    return _token_ids(name, ids, allowed, repr(value))


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
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__") or not list(ids):
            raise ValueError(f"`sequence_bias` must be {allowed}, got the entry {pair!r}")
        ids = _token_ids("sequence_bias", list(ids), allowed, f"the entry {pair!r}")
        if (isinstance(bias, (bool, np.bool_))
                or not isinstance(bias, (int, float, np.floating, np.integer))
                or math.isnan(float(bias))):  # +-inf is a valid bias (bans / forces)
            raise ValueError(f"`sequence_bias` must be {allowed}, got the bias {bias!r}")
        out.append((ids, bias))
    return out


def validate_processor_fields(cfg) -> None:
    """Checks (and normalises) the processor / stopping fields of a GenerationConfig."""
    set_ = lambda k, v: object.__setattr__(cfg, k, v)  # noqa: E731
    check_float("repetition_penalty", cfg.repetition_penalty, low=0.0, low_open=True,
                allowed="a float > 0 (1.0 disables it)")
    for name in ("presence_penalty", "frequency_penalty"):
        check_float(name, getattr(cfg, name), low=-2.0, high=2.0,
                    allowed="a float in [-2, 2] (0.0 disables it)")
    check_float("min_p", cfg.min_p, low=0.0, high=1.0,
                allowed="a float in [0, 1] (None disables it)")
    check_float("top_h", cfg.top_h, low=0.0, high=1.0, low_open=True,
                allowed="a float in (0, 1] (None disables it)")
    check_float("typical_p", cfg.typical_p, low=0.0, high=1.0, low_open=True,
                allowed="a float in (0, 1] (1.0 disables it)")
    for name in ("epsilon_cutoff", "eta_cutoff"):
        check_float(name, getattr(cfg, name), low=0.0, high=1.0, high_open=True,
                    allowed="a float in [0, 1) (0.0 disables it)")
    check_int("prompt_ignore_length", cfg.prompt_ignore_length, allow_none=True, per_row=True,
              allowed="an int >= 0 or one per row (leading tokens of each row the repetition "
                      "penalty ignores), or None")
    check_int("min_length", cfg.min_length, per_row=True)
    check_int("min_new_tokens", cfg.min_new_tokens, allow_none=True, per_row=True)
    check_int("no_repeat_ngram_size", cfg.no_repeat_ngram_size,
              allowed="an int >= 0 (0 disables it)")
    if cfg.bad_words_ids is not None:
        value = cfg.bad_words_ids
        allowed = "a non-empty list of non-empty lists of non-negative token ids"
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or not value:
            raise ValueError(f"`bad_words_ids` must be {allowed}, got {value!r}")
        for seq in value:
            if isinstance(seq, (str, bytes)) or not isinstance(seq, (list, tuple)) or not seq:
                raise ValueError(f"`bad_words_ids` must be {allowed}, got the entry {seq!r}")
            _token_ids("bad_words_ids", seq, allowed, f"the entry {seq!r}")
    if cfg.sequence_bias is not None:
        _sequence_bias_pairs(cfg.sequence_bias)
    check_int("forced_bos_token_id", cfg.forced_bos_token_id, allow_none=True,
              allowed="a non-negative token id or None")
    if cfg.forced_eos_token_id is not None:
        _id_list("forced_eos_token_id", cfg.forced_eos_token_id, allow_int=True)
    for name in ("suppress_tokens", "begin_suppress_tokens"):
        if getattr(cfg, name) is not None:
            _id_list(name, getattr(cfg, name))
    for name in ("remove_invalid_values", "renormalize_logits"):
        check_bool(name, getattr(cfg, name))
    decay = cfg.exponential_decay_length_penalty
    if decay is not None:
        allowed = "a pair (start_index: int >= 0, decay_factor: float > 0)"
        if (not isinstance(decay, (list, tuple)) or len(decay) != 2
                or isinstance(decay[1], (bool, np.bool_))
                or not isinstance(decay[1], (int, float, np.floating, np.integer))):
            raise ValueError(f"`exponential_decay_length_penalty` must be {allowed}, got "
                             f"{decay!r}")
        check_int("exponential_decay_length_penalty", decay[0], allowed=allowed,
                  shown=repr(decay))
        check_float("exponential_decay_length_penalty", decay[1], low=0.0, low_open=True,
                    allowed=allowed, shown=repr(decay))
        set_("exponential_decay_length_penalty", (int(decay[0]), float(decay[1])))
    if cfg.stop_strings is not None:
        set_("stop_strings", check_stop_strings(cfg.stop_strings))
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


def validate_fallback_fields(cfg) -> None:
    """The plain-step fallback of assisted decoding (jaxgen.speculative.fallback); stores
    `assistant_verify_cost` as a tuple of two floats (a static, hashable field).

    Example:
        >>> from jaxgen import GenerationConfig
        >>> GenerationConfig(assistant_verify_cost=[0, 1]).assistant_verify_cost
        (0.0, 1.0)
        >>> GenerationConfig(assistant_verify_cost=0.5)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: `assistant_verify_cost` must be a pair (fixed, per_draft) ...
    """
    check_bool("assistant_fallback", cfg.assistant_fallback)
    check_int("assistant_probe_interval", cfg.assistant_probe_interval, low=1,
              allowed="an int >= 1 (rounds before a row that stopped drafting tries again)")
    cost = cfg.assistant_verify_cost
    allowed = ("a pair (fixed, per_draft) of floats >= 0: a round verifying k >= 1 drafts "
               "costs 1 + fixed + per_draft * k one-token target steps, e.g. (0.5, 0.12)")
    if (isinstance(cost, (str, bytes, dict)) or not hasattr(cost, "__len__") or len(cost) != 2
            or any(isinstance(v, (bool, np.bool_)) or np.ndim(v) != 0 for v in cost)):
        raise ValueError(f"`assistant_verify_cost` must be {allowed}, got {cost!r}")
    for value in cost:
        check_float("assistant_verify_cost", value, low=0.0, allowed=allowed, shown=repr(cost))
    object.__setattr__(cfg, "assistant_verify_cost", (float(cost[0]), float(cost[1])))


TREE_NODES_MAX = 64  # assistant_tree_nodes: one verify forward holds N + 1 positions
TREE_WIDTH_MAX = 8  # assistant_tree_width


def validate_tree_fields(cfg) -> None:
    """Token-tree verification (jaxgen.speculative.tree_loop): `assistant_tree_nodes` None or
    an int in [1, 64], `assistant_tree_width` an int in [1, 8]; greedy or sampling (lossless),
    not with the ensemble weight.

    Example:
        >>> from jaxgen import GenerationConfig
        >>> GenerationConfig(assistant_tree_nodes=0)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: `assistant_tree_nodes` must be None (a chain of drafts) or an int in [1, 64] ...
    """
    check_int("assistant_tree_nodes", cfg.assistant_tree_nodes, low=1, allow_none=True,
              allowed=f"None (a chain of drafts) or an int in [1, {TREE_NODES_MAX}] (draft "
                      f"nodes per round)")
    nodes = cfg.assistant_tree_nodes
    if nodes is not None and nodes > TREE_NODES_MAX:
        raise ValueError(f"`assistant_tree_nodes`={nodes!r} is out of range (allowed: None or "
                         f"an int in [1, {TREE_NODES_MAX}])")
    check_int("assistant_tree_width", cfg.assistant_tree_width, low=1,
              allowed=f"an int in [1, {TREE_WIDTH_MAX}] (children per expanded node)")
    if cfg.assistant_tree_width > TREE_WIDTH_MAX:
        raise ValueError(f"`assistant_tree_width`={cfg.assistant_tree_width!r} is out of range "
                         f"(allowed: an int in [1, {TREE_WIDTH_MAX}])")
    if nodes is not None and cfg.assistant_ensemble_weight is not None:
        raise ValueError("`assistant_tree_nodes` (token-tree verification) cannot be combined "
                         "with `assistant_ensemble_weight` (allowed: "
                         "assistant_ensemble_weight=None)")

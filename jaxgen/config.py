"""`GenerationConfig`: Hugging Face's field names, eager validation, static/dynamic split.

The config is a PyTree. Its *dynamic* fields (temperature, top_k, top_p, penalties, ...)
are leaves: changing them never recompiles, and `jax.vmap` can sweep them. Everything
else (buffer sizes, the mode, which processors exist, EOS ids, n-gram sizes) is static
aux data and is part of the compiled program.

Example:
    >>> cfg = GenerationConfig(do_sample=True, temperature=0.7, top_p=0.9, max_new_tokens=32)
    >>> cfg.mode
    'sample'
    >>> cfg.replace(temperature=0.5).temperature
    0.5
"""
from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np

# Defaults Hugging Face applies to fields left unset (GenerationConfig._get_default_generation_params).
HF_DEFAULTS: dict[str, Any] = {
    "max_length": 20,
    "max_new_tokens": None,
    "min_length": 0,
    "min_new_tokens": None,
    "early_stopping": False,
    "max_time": None,
    "stop_strings": None,
    "do_sample": False,
    "num_beams": 1,
    "use_cache": True,
    "temperature": 1.0,
    "top_k": 50,
    "top_p": 1.0,
    "min_p": None,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "length_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "bad_words_ids": None,
    "renormalize_logits": False,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "remove_invalid_values": False,
    "exponential_decay_length_penalty": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "sequence_bias": None,
    "num_return_sequences": 1,
    "output_scores": False,
    "output_logits": False,
    "return_dict_in_generate": False,
    "pad_token_id": None,
    "bos_token_id": None,
    "eos_token_id": None,
    "num_assistant_tokens": 20,
    "num_assistant_tokens_schedule": "constant",
    "assistant_confidence_threshold": 0.4,
    "prompt_lookup_num_tokens": None,
    "max_matching_ngram_size": None,
    "assistant_early_exit": None,
    "assistant_lookbehind": 10,
    "target_lookbehind": 10,
    "use_mtp": False,
    "assistant_ensemble_weight": None,
    "cache_implementation": None,
    "cache_config": None,
    # jaxgen-specific (not a Hugging Face field): "search" (default) finds the top-k / top-p /
    # min-p / typical-p cut-offs by a bisection over float bits (no sort); "sort" uses the
    # exact sort-based paths that mirror HF step by step. Static.
    "filter_impl": "search",
    # jaxgen-specific: the static draft width K_max of assisted decoding with an assistant
    # model (the per-row draft length moves inside [1, K_max] under the "heuristic"
    # schedules). None: num_assistant_tokens. Static.
    "max_assistant_tokens": None,
}

# Fields Hugging Face knows that jaxgen accepts only at their neutral value (for now).
# An issue that implements one removes it from here.
NOT_YET_SUPPORTED: dict[str, str] = {
    "assistant_early_exit": "self-speculative early exit",
    "use_mtp": "multi-token prediction",
}

# Hugging Face fields jaxgen will not implement (they raise if set to a non-neutral value).
HF_FIELDS_UNSUPPORTED: dict[str, Any] = {
    "num_beam_groups": 1,
    "diversity_penalty": 0.0,
    "penalty_alpha": None,
    "encoder_repetition_penalty": 1.0,
    "encoder_no_repeat_ngram_size": 0,
    "force_words_ids": None,
    "constraints": None,
    "guidance_scale": None,
    "watermarking_config": None,
    "token_healing": False,
    "dola_layers": None,
    "low_memory": None,
    "output_attentions": False,
    "output_hidden_states": False,
    "top_h": None,
}

# Fields read from generation_config.json that are bookkeeping only.
IGNORED_FIELDS = {
    "transformers_version", "_from_model_config", "decoder_start_token_id", "is_assistant",
    "compile_config", "disable_compile", "max_cache_len", "prefill_chunk_size",
    "continuous_batching_config", "speculation_type",
}

# Dynamic fields: PyTree leaves (scalar or per-row [B]); new values never recompile.
DYNAMIC_FIELDS = (
    "temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "length_penalty",
    "assistant_ensemble_weight", "assistant_confidence_threshold",
    "min_length", "min_new_tokens",
)
STATIC_FIELDS = tuple(k for k in HF_DEFAULTS if k not in DYNAMIC_FIELDS)

MODES = ("greedy", "sample", "beam", "beam_sample", "assisted")
ASSISTANT_SCHEDULES = ("constant", "heuristic", "heuristic_transient")


def _is_concrete(value) -> bool:
    return not isinstance(value, jax.core.Tracer)


def _values(value) -> np.ndarray:
    return np.asarray(value, dtype=np.float64).reshape(-1)


def _check_range(name: str, value, *, low=None, high=None, low_open=False, high_open=False,
                 allowed: str) -> None:
    if value is None or not _is_concrete(value):
        return
    values = _values(value)
    bad = np.zeros(values.shape, bool)
    if low is not None:
        bad |= (values <= low) if low_open else (values < low)
    if high is not None:
        bad |= (values >= high) if high_open else (values > high)
    bad |= ~np.isfinite(values)
    if bad.any():
        raise ValueError(f"`{name}` must be {allowed}, got {value!r}")


def _as_id_tuple(name: str, value) -> tuple[int, ...] | None:
    if value is None:
        return None
    ids = [value] if isinstance(value, (int, np.integer)) else list(value)
    for token in ids:
        if not isinstance(token, (int, np.integer)) or isinstance(token, bool) or token < 0:
            raise ValueError(f"`{name}` must be a non-negative int or a list of them, got {value!r}")
    return tuple(int(t) for t in ids)


class GenerationConfig:
    """Generation settings with Hugging Face's names and defaults.

    Unknown fields and fields that are known but not yet implemented raise a
    `ValueError` naming them. `replace(**changes)` returns a new, re-validated config.
    """

    def __init__(self, **fields: Any):
        unknown = sorted(k for k in fields
                         if k not in HF_DEFAULTS and k not in HF_FIELDS_UNSUPPORTED
                         and k not in IGNORED_FIELDS)
        if unknown:
            raise ValueError(
                f"GenerationConfig got unknown field(s) {unknown}; known fields: "
                f"{sorted(HF_DEFAULTS)}")
        values = dict(HF_DEFAULTS)
        for key, value in fields.items():
            if key in IGNORED_FIELDS:
                continue
            if key in HF_FIELDS_UNSUPPORTED:
                if value is not None and value != HF_FIELDS_UNSUPPORTED[key]:
                    raise ValueError(
                        f"`{key}`={value!r} is not supported by jaxgen (allowed: "
                        f"{HF_FIELDS_UNSUPPORTED[key]!r} or unset)")
                continue
            values[key] = HF_DEFAULTS[key] if value is None and key != "max_new_tokens" else value
        for key, value in values.items():
            object.__setattr__(self, key, value)
        self._normalize()
        self.validate()
        object.__setattr__(self, "_active", self._compute_active())

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_dict(cls, data: dict[str, Any], **overrides: Any) -> "GenerationConfig":
        merged = {k: v for k, v in data.items() if v is not None}
        merged.update(overrides)
        return cls(**merged)

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike, **overrides: Any) -> "GenerationConfig":
        """Reads `generation_config.json` from a checkpoint folder (HF's defaults if absent)."""
        path = os.path.join(os.fspath(folder), "generation_config.json")
        if os.path.isdir(os.fspath(folder)) and not os.path.exists(path):
            return cls(**overrides)
        if not os.path.exists(path):
            raise FileNotFoundError(f"no generation_config.json in {os.fspath(folder)!r}")
        with open(path, encoding="utf-8") as handle:
            try:
                data = json.load(handle)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path} is not valid JSON: {error}") from None
        return cls.from_dict(data, **overrides)

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in HF_DEFAULTS}

    def replace(self, **changes: Any) -> "GenerationConfig":
        data = self.to_dict()
        data.update(changes)
        return GenerationConfig(**data)

    def __setattr__(self, key, value):
        raise AttributeError("GenerationConfig is immutable; use cfg.replace(...)")

    def __repr__(self) -> str:
        changed = {k: v for k, v in self.to_dict().items() if _differs(v, HF_DEFAULTS[k])}
        return f"GenerationConfig({', '.join(f'{k}={v!r}' for k, v in changed.items())})"

    def __eq__(self, other) -> bool:
        if not isinstance(other, GenerationConfig):
            return NotImplemented
        return all(not _differs(getattr(self, k), getattr(other, k)) for k in HF_DEFAULTS)

    __hash__ = None  # mutable-looking leaves; use static_key() for hashing

    # ------------------------------------------------------------------- derived
    def _normalize(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        set_("eos_token_id", _as_id_tuple("eos_token_id", self.eos_token_id))
        if isinstance(self.pad_token_id, (list, tuple)):
            set_("pad_token_id", self.pad_token_id[0] if self.pad_token_id else None)

    @property
    def mode(self) -> str:
        """HF's precedence: assisted > beam(+sample) > sample > greedy.

        "assisted" here means prompt lookup; `generate(..., assistant_model=...)` also runs
        the assisted loop for a greedy / sample config.
        """
        if self.prompt_lookup_num_tokens is not None:
            return "assisted"
        if self.num_beams > 1:
            return "beam_sample" if self.do_sample else "beam"
        return "sample" if self.do_sample else "greedy"

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self.eos_token_id or ()

    def new_token_budget(self, prompt_length: int) -> int:
        """Static number of new tokens the buffer must hold for a prompt of this length."""
        if self.max_new_tokens is not None:
            return int(self.max_new_tokens)
        return max(int(self.max_length) - int(prompt_length), 0)

    def static_key(self) -> tuple:
        """The hashable part of the config: everything that shapes the compiled program."""
        return tuple((k, _freeze(getattr(self, k))) for k in STATIC_FIELDS) + (
            ("active", self.active_dynamic()),)

    def active_dynamic(self) -> frozenset[str]:
        """Dynamic fields whose processor is part of the compiled program."""
        return self._active

    def _compute_active(self) -> frozenset[str]:
        """Dynamic fields whose processor is part of the program.

        When sampling, temperature, top-k and top-p are always present (their neutral values
        are exact identities), so sweeping them never recompiles.
        """
        active = set()
        if self.do_sample:
            active |= {"temperature", "top_k", "top_p"}
        for name in DYNAMIC_FIELDS:
            value = getattr(self, name)
            if name == "length_penalty":  # not a processor: always part of the beam program
                continue
            if value is not None and _is_concrete(value) and _differs(value, HF_DEFAULTS[name]):
                active.add(name)
        return frozenset(active)

    # ----------------------------------------------------------------- validation
    def validate(self) -> None:
        """Raises ValueError naming the field and the allowed values."""
        for name, what in NOT_YET_SUPPORTED.items():
            value = getattr(self, name)
            if _is_concrete(value) and _differs(value, HF_DEFAULTS[name]):
                raise ValueError(f"`{name}`={value!r}: {what} is not supported yet "
                                 f"(allowed: {HF_DEFAULTS[name]!r})")
        if not isinstance(self.do_sample, (bool, np.bool_)):
            raise ValueError(f"`do_sample` must be True or False, got {self.do_sample!r}")
        for name in ("max_new_tokens", "max_length"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"`{name}` must be an int >= 1, got {value!r}")
        if (not isinstance(self.num_beams, (int, np.integer)) or isinstance(self.num_beams, bool)
                or self.num_beams < 1):
            raise ValueError(f"`num_beams` must be an int >= 1, got {self.num_beams!r}")
        if self.max_time is not None and (isinstance(self.max_time, bool) or not isinstance(
                self.max_time, (int, float, np.floating, np.integer)) or not self.max_time > 0):
            raise ValueError(f"`max_time` must be a number of seconds > 0 (or None), got "
                             f"{self.max_time!r}")
        self._validate_beam_fields()
        self._validate_processor_fields()
        self._validate_cache_fields()
        self._validate_assisted_fields()
        _check_range("temperature", self.temperature, low=0.0, allowed="a float >= 0")
        if self.do_sample and _is_concrete(self.temperature) and (_values(self.temperature) == 0).any():
            raise ValueError("`temperature`=0 with do_sample=True is undefined; use do_sample=False "
                             "for greedy decoding (allowed: temperature > 0)")
        _check_range("top_p", self.top_p, low=0.0, high=1.0, low_open=True,
                     allowed="a float in (0, 1]")
        if self.top_k is not None and _is_concrete(self.top_k):
            top_k = np.asarray(self.top_k)
            if not np.issubdtype(top_k.dtype, np.integer) or (top_k < 0).any():
                raise ValueError(f"`top_k` must be an int >= 0 (0 disables it), got {self.top_k!r}")
        if self.pad_token_id is not None and (not isinstance(self.pad_token_id, (int, np.integer))
                                              or self.pad_token_id < 0):
            raise ValueError(f"`pad_token_id` must be a non-negative int, got {self.pad_token_id!r}")
        if self.bos_token_id is not None and (not isinstance(self.bos_token_id, (int, np.integer))
                                              or self.bos_token_id < 0):
            raise ValueError(f"`bos_token_id` must be a non-negative int, got {self.bos_token_id!r}")
        if self.use_cache is not True:
            raise ValueError("`use_cache` must be True (jaxgen always decodes with a KV cache)")

    def _validate_beam_fields(self) -> None:
        """Beam fields and the combinations Hugging Face's GenerationConfig.validate rejects."""
        if not (self.early_stopping is True or self.early_stopping is False
                or self.early_stopping == "never"):
            raise ValueError(f"`early_stopping` must be True, False or 'never', got "
                             f"{self.early_stopping!r}")
        _check_range("length_penalty", self.length_penalty, allowed="a finite float")
        returns = self.num_return_sequences
        if not isinstance(returns, (int, np.integer)) or isinstance(returns, bool) or returns < 1:
            raise ValueError(f"`num_return_sequences` must be an int >= 1, got {returns!r}")
        if returns > 1 and self.num_beams == 1 and not self.do_sample:
            raise ValueError(f"greedy decoding (do_sample=False, num_beams=1) does not support "
                             f"`num_return_sequences` > 1 (got {returns}); set num_beams >= "
                             f"{returns} or do_sample=True")
        if returns > 1 and self.num_beams == 1:
            raise ValueError(f"`num_return_sequences`={returns} with sampling (num_beams=1) is "
                             f"not supported yet (allowed: 1, or use num_beams >= {returns})")
        if self.num_beams > 1 and returns > self.num_beams:
            raise ValueError(f"`num_return_sequences` ({returns}) has to be smaller or equal to "
                             f"`num_beams` ({self.num_beams})")

    def _validate_assisted_fields(self) -> None:
        """Assisted / speculative decoding fields (jaxgen.speculative)."""
        def int_at_least(name, value, low, allow_none):
            if value is None and allow_none:
                return
            if (not isinstance(value, (int, np.integer)) or isinstance(value, bool)
                    or value < low):
                raise ValueError(f"`{name}` must be an int >= {low}"
                                 f"{' or None' if allow_none else ''}, got {value!r}")
        int_at_least("num_assistant_tokens", self.num_assistant_tokens, 1, False)
        int_at_least("max_assistant_tokens", self.max_assistant_tokens, 1, True)
        int_at_least("prompt_lookup_num_tokens", self.prompt_lookup_num_tokens, 1, True)
        int_at_least("max_matching_ngram_size", self.max_matching_ngram_size, 1, True)
        if self.num_assistant_tokens_schedule not in ASSISTANT_SCHEDULES:
            raise ValueError(f"`num_assistant_tokens_schedule` must be one of "
                             f"{list(ASSISTANT_SCHEDULES)}, got "
                             f"{self.num_assistant_tokens_schedule!r}")
        _check_range("assistant_ensemble_weight", self.assistant_ensemble_weight, low=0.0,
                     high=1.0, low_open=True, high_open=True,
                     allowed="a float in the open interval (0, 1) (None: lossless "
                             "speculative decoding)")
        _check_range("assistant_confidence_threshold", self.assistant_confidence_threshold,
                     low=0.0, high=1.0, allowed="a float in [0, 1] (0 or None disables it)")
        if self.prompt_lookup_num_tokens is not None:
            if self.num_beams > 1:
                raise ValueError(f"prompt lookup decoding (`prompt_lookup_num_tokens`="
                                 f"{self.prompt_lookup_num_tokens}) does not support beam "
                                 f"search (num_beams={self.num_beams}); assisted decoding "
                                 f"works with greedy or sampling (allowed: num_beams=1)")
            if self.assistant_ensemble_weight is not None:
                raise ValueError("`assistant_ensemble_weight` needs the draft's distribution "
                                 "(an assistant model); prompt lookup has none (allowed: "
                                 "assistant_ensemble_weight=None with prompt_lookup_num_tokens)")

    def _validate_cache_fields(self) -> None:
        """cache_implementation / cache_config (jaxgen.cache)."""
        from jaxgen.cache import validate_cache_config
        if self.cache_config is not None and self.cache_implementation is None:
            raise ValueError("`cache_config` needs `cache_implementation` (allowed: 'static', "
                             "'dynamic', 'quantized', 'sliding_window', 'offloaded')")
        validate_cache_config(self.cache_implementation, self.cache_config)
        if self.cache_implementation == "dynamic" and self.num_beams > 1:
            raise ValueError("cache_implementation='dynamic' (the growing cache) is not "
                             "supported with beam search (num_beams > 1) yet; use 'static'")

    def _validate_processor_fields(self) -> None:
        """Logits-processor and stopping fields (jaxgen.processors, jaxgen.stopping)."""
        from jaxgen import config_checks
        config_checks.validate_processor_fields(self)

    def vmap_axes(self, **axes: int | None) -> "GenerationConfig":
        """An `in_axes` tree for `jax.vmap` over this config's dynamic fields.

        Example:
            >>> cfg = GenerationConfig(do_sample=True, temperature=jnp.array([0.5, 1.0]))
            >>> sweep = jax.vmap(lambda c: jaxgen.generate(params, state, c).sequences,
            ...                  in_axes=(cfg.vmap_axes(temperature=0),))
        Fields not named are broadcast (None). Only dynamic fields that are set can be mapped.
        """
        for name, axis in axes.items():
            if name not in DYNAMIC_FIELDS:
                raise ValueError(f"vmap_axes: `{name}` is not a dynamic field (allowed: "
                                 f"{list(DYNAMIC_FIELDS)})")
            if axis is not None and getattr(self, name) is None:
                raise ValueError(f"vmap_axes: `{name}` is None in this config; give it a "
                                 f"value (the batch of values to sweep) before mapping it")
        leaves, aux = _flatten(self)
        return _unflatten(aux, [axes.get(name) if value is not None else None
                                for name, value in zip(DYNAMIC_FIELDS, leaves)])

    def validate_for_model(self, vocab_size: int) -> None:
        """Checks the token ids the config names against the vocabulary."""
        from jaxgen import config_checks
        config_checks.validate_processor_ids(self, vocab_size)
        for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
            value = getattr(self, name)
            ids = value if isinstance(value, tuple) else ((value,) if value is not None else ())
            for token in ids:
                if token >= vocab_size:
                    raise ValueError(f"`{name}`={value!r} is outside the vocabulary "
                                     f"(allowed: 0..{vocab_size - 1})")


def _freeze(value):
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, np.ndarray):
        return tuple(value.reshape(-1).tolist())
    return value


def _differs(value, default) -> bool:
    if value is None or default is None:
        return value is not default
    try:
        return bool(np.any(np.asarray(value) != np.asarray(default)))
    except (TypeError, ValueError):
        return value != default


def _flatten(cfg: GenerationConfig):
    leaves = tuple(getattr(cfg, name) for name in DYNAMIC_FIELDS)
    static = tuple((k, getattr(cfg, k)) for k in STATIC_FIELDS)
    return leaves, _StaticPart(static, cfg.active_dynamic())


def _unflatten(aux: "_StaticPart", leaves) -> GenerationConfig:
    cfg = object.__new__(GenerationConfig)
    for key, value in aux.static:
        object.__setattr__(cfg, key, value)
    for key, value in zip(DYNAMIC_FIELDS, leaves):
        object.__setattr__(cfg, key, value)
    object.__setattr__(cfg, "_active", aux.active)
    return cfg


class _StaticPart:
    """Aux data of a config PyTree: hashable by value."""

    def __init__(self, static: tuple, active: frozenset[str]):
        self.static = static
        self.active = active
        self._key = (tuple((k, _freeze(v)) for k, v in static), active)

    def __hash__(self):
        return hash(self._key)

    def __eq__(self, other):
        return isinstance(other, _StaticPart) and self._key == other._key


jax.tree_util.register_pytree_node(GenerationConfig, _flatten, _unflatten)

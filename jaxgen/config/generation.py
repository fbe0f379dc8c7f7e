"""`GenerationConfig`: Hugging Face's field names, eager validation, static/dynamic split.

The config is a PyTree. Its *dynamic* fields (temperature, top_k, top_p, penalties, ...)
are leaves: changing them never recompiles, and `jax.vmap` can sweep them. Each is one value
or one value per row (a list, tuple, numpy or jax array of length batch; lists and tuples are
stored as numpy arrays). Everything else (buffer sizes, the mode, which processors exist, EOS
ids, n-gram sizes) is static aux data and is part of the compiled program.

Every field Hugging Face's GenerationConfig knows is either implemented (`HF_DEFAULTS`),
accepted only at its neutral value (`NOT_YET_SUPPORTED`, `HF_FIELDS_UNSUPPORTED`: any other
value raises a ValueError naming the field and the allowed values) or bookkeeping that is
ignored (`BOOKKEEPING_FIELDS`).

Example:
    >>> from jaxgen import GenerationConfig
    >>> cfg = GenerationConfig(do_sample=True, temperature=0.7, top_p=0.9, max_new_tokens=32)
    >>> cfg.mode
    'sample'
    >>> cfg.replace(temperature=0.5).temperature
    0.5
    >>> per_row = cfg.replace(temperature=[0.5, 0.7])  # one value per row
    >>> per_row.temperature
    array([0.5, 0.7])
    >>> per_row.validate_for_batch(2)
"""
from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxgen.config import fields as config_checks
from jaxgen.config.fields import check_bool, check_float, check_int
from jaxgen.config.watermarking import parse_watermarking_config

# The implemented fields, with the defaults Hugging Face applies to fields left unset
# (GenerationConfig._get_default_generation_params), plus a few jaxgen-specific fields
# (JAXGEN_FIELDS). The NOT_YET_SUPPORTED fields are here too, pinned to their default.
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
    "top_h": None,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "repetition_penalty": 1.0,
    "length_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "bad_words_ids": None,
    "renormalize_logits": False,
    # Green-list (WatermarkingConfig) or SynthID-text (SynthIDTextWatermarkingConfig)
    # watermark, jaxgen.logits.watermark.green_list / jaxgen.logits.watermark.synthid; a dict or HF's object is
    # converted. Static.
    "watermarking_config": None,
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
    "speculation_type": None,
    "assistant_ensemble_weight": None,
    "cache_implementation": None,
    "cache_config": None,
    # The token buffer / cache length (prompt + new tokens). None: sized per call from the
    # prompt and max_new_tokens / max_length. Static.
    "max_cache_len": None,
    # Prefill in chunks of this many positions (bounded activation memory on long prompts).
    # None: the whole prompt at once. Static.
    "prefill_chunk_size": None,
    # jaxgen-specific (not Hugging Face GenerationConfig fields): OpenAI-style penalties.
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    # jaxgen-specific: the repetition penalty ignores each row's first N tokens (Hugging
    # Face's RepetitionPenaltyLogitsProcessor(prompt_ignore_length=N), which HF's
    # GenerationConfig does not expose). An int or one per row; None: every token counts.
    # Dynamic (int32): a new value never recompiles.
    "prompt_ignore_length": None,
    # jaxgen-specific: "search" (default) finds the top-k / top-p / min-p / typical-p
    # cut-offs by a bisection over float bits (no sort); "sort" uses the exact sort-based
    # paths that mirror HF step by step. Static.
    "filter_impl": "search",
    # jaxgen-specific: the static draft width K_max of assisted decoding with an assistant
    # model (the per-row draft length moves inside [1, K_max] under the "heuristic"
    # schedules). None: num_assistant_tokens. Static.
    "max_assistant_tokens": None,
    # jaxgen-specific: assisted decoding drafts only where a cost model says it pays and
    # otherwise takes plain one-token target steps (jaxgen.speculative.fallback); greedy
    # tokens are unchanged and sampling stays exact. False: every row drafts every round (HF).
    # `assistant_verify_cost` = (fixed, per_draft): a round verifying k >= 1 drafts costs
    # 1 + fixed + per_draft * k one-token target steps ((0.5, 0.12): SmolLM2-135M on 2 CPU
    # cores). `assistant_probe_interval`: rounds before a row that stopped drafting tries
    # again (doubling after each failed try). Static.
    "assistant_fallback": True,
    "assistant_verify_cost": (0.5, 0.12),
    "assistant_probe_interval": 8,
    # jaxgen-specific: token-tree verification (jaxgen.speculative.tree_loop) with an MTP
    # drafter assistant or prompt lookup: each round drafts a tree of `assistant_tree_nodes`
    # nodes per row (MTP drafter: by cumulative draft probability, `assistant_tree_width`
    # children per expanded node; prompt lookup: `assistant_tree_width` distinct matches
    # merged into a trie; depth max_assistant_tokens, num_assistant_tokens or
    # prompt_lookup_num_tokens) and verifies it in one forward
    # with tree attention (greedy, or sampling: lossless). None: a chain of drafts. Static.
    "assistant_tree_nodes": None,
    "assistant_tree_width": 2,
    # Classifier-free guidance (Hugging Face's UnbatchedClassifierFreeGuidanceLogitsProcessor,
    # jaxgen.loops.guidance): a finite float, one or one per row; None or 1 is off. Dynamic (a new
    # value never recompiles; whether guidance runs at all is part of the program). The
    # unconditional prompt is generate(negative_prompt_ids=...), else each prompt's last token.
    "guidance_scale": None,
    # jaxgen-specific: log-probs people ask for (GenerateOutput.top_ids / top_logprobs /
    # prompt_logprobs). `top_logprobs`=k: per new token the k most likely tokens and their
    # log-probs under the processed scores token_logprobs uses (0: off; at most the vocab
    # size). `prompt_logprobs`: each prompt token's log-prob given its prefix under the raw
    # model distribution, computed during prefill. Static (they change the outputs' shapes).
    "top_logprobs": 0,
    "prompt_logprobs": False,
}

# Fields of HF_DEFAULTS that Hugging Face's GenerationConfig does not have.
JAXGEN_FIELDS = frozenset({"presence_penalty", "frequency_penalty", "filter_impl",
                           "max_assistant_tokens", "prompt_ignore_length",
                           "assistant_fallback", "assistant_verify_cost",
                           "assistant_probe_interval", "assistant_tree_nodes",
                           "assistant_tree_width", "top_logprobs", "prompt_logprobs"})

# Hugging Face fields jaxgen accepts only at their default (HF_DEFAULTS) for now: name ->
# the feature they belong to. An issue that implements one removes it from here.
NOT_YET_SUPPORTED: dict[str, str] = {
    "speculation_type": "DFlash speculative decoding",
}

# Hugging Face fields jaxgen will not implement: name -> (the neutral values it accepts
# besides None, why). Any other value raises; they are not stored in the config.
_ENCODER_DECODER = "it applies to encoder-decoder models; jaxgen decodes decoder-only models"
_ON_THE_HUB = "Hugging Face moved this decoding method to the Hub (custom_generate)"
HF_FIELDS_UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "num_beam_groups": ((1,), f"group (diverse) beam search; {_ON_THE_HUB}"),
    "diversity_penalty": ((0.0,), f"group (diverse) beam search; {_ON_THE_HUB}"),
    "penalty_alpha": ((0.0,), f"contrastive search; {_ON_THE_HUB}"),
    "dola_layers": ((), f"DoLa decoding; {_ON_THE_HUB}"),
    "force_words_ids": ((), f"constrained beam search; {_ON_THE_HUB}"),
    "constraints": ((), f"constrained beam search; {_ON_THE_HUB}"),
    "low_memory": ((False,), f"sequential (low-memory) beam search; {_ON_THE_HUB}"),
    "encoder_repetition_penalty": ((1.0,), _ENCODER_DECODER),
    "encoder_no_repeat_ngram_size": ((0,), _ENCODER_DECODER),
    "decoder_start_token_id": ((), _ENCODER_DECODER),
    "token_healing": ((False,), "token healing is not implemented"),
    "output_attentions": ((False,), "jaxgen's models do not return attention weights"),
    "output_hidden_states": ((False,), "jaxgen's models do not return hidden states"),
    "compile_config": ((), "it configures torch.compile; jaxgen always compiles with jax.jit"),
    "disable_compile": ((False,), "jaxgen always compiles the decoding loop with jax.jit"),
    "continuous_batching_config": ((), "continuous batching runs outside generate: use "
                                       "jaxgen.generate_batch(model, params, prompts, cfg, "
                                       "slots=...) or jaxgen.serving.Engine (Hugging Face "
                                       "deprecated passing it in GenerationConfig)"),
    "is_assistant": ((False,), "Hugging Face sets it on its own copy of a draft model's "
                               "config; pass the draft model as generate(..., "
                               "assistant_model=(model, params)) instead"),
}

# Keys Hugging Face writes into generation_config.json as metadata (METADATA_FIELDS, plus
# the legacy `_commit_hash`): accepted and ignored.
BOOKKEEPING_FIELDS = frozenset({"transformers_version", "_from_model_config", "_commit_hash",
                                "_original_object_hash"})

# Dynamic fields: PyTree leaves (scalar or per-row [B]); new values never recompile.
DYNAMIC_FIELDS = (
    "temperature", "top_k", "top_p", "min_p", "top_h", "typical_p", "epsilon_cutoff",
    "eta_cutoff", "repetition_penalty", "presence_penalty", "frequency_penalty", "length_penalty",
    "assistant_ensemble_weight", "assistant_confidence_threshold",
    "min_length", "min_new_tokens", "prompt_ignore_length", "guidance_scale",
)
# The dynamic fields that hold ints (cast to int32 for the jit; the others to float32).
DYNAMIC_INT_FIELDS = frozenset({"top_k", "min_length", "min_new_tokens", "prompt_ignore_length"})
STATIC_FIELDS = tuple(k for k in HF_DEFAULTS if k not in DYNAMIC_FIELDS)

ASSISTANT_SCHEDULES = ("constant", "heuristic", "heuristic_transient")


def _is_concrete(value) -> bool:
    return not isinstance(value, jax.core.Tracer)


def _values(value) -> np.ndarray:
    return np.asarray(value, dtype=np.float64).reshape(-1)


def _per_row(name: str, value):
    """A dynamic field's value with lists / tuples as numpy arrays (one PyTree leaf)."""
    if not isinstance(value, (list, tuple)):
        return value
    allowed = "a number or a 1-D list of numbers (one per row)"
    if not value:
        raise ValueError(f"`{name}` must be {allowed}, got an empty {type(value).__name__}")
    if any(isinstance(v, (bool, np.bool_, str, bytes)) for v in value):
        raise ValueError(f"`{name}` must be {allowed}, got {value!r}")
    try:
        array = np.asarray(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"`{name}` must be {allowed}, got {value!r}") from None
    if array.ndim != 1:
        raise ValueError(f"`{name}` must be {allowed}, got {value!r} (shape {array.shape})")
    return array


def _as_id_tuple(name: str, value) -> tuple[int, ...] | None:
    if value is None:
        return None
    allowed = "a non-negative int or a list of them"
    if isinstance(value, (int, np.integer)):
        check_int(name, value, allowed=allowed)
        return (int(value),)
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
        raise ValueError(f"`{name}` must be {allowed}, got {value!r}")
    ids = list(value)
    for token in ids:
        check_int(name, token, allowed=allowed, shown=repr(value))
    return tuple(int(t) for t in ids)


def is_transformers_config(value) -> bool:
    """Whether `value` is a transformers.GenerationConfig (duck-typed, no import)."""
    return (type(value).__module__ or "").startswith("transformers") and callable(
        getattr(value, "to_dict", None))


def transformers_fields(config) -> dict[str, Any]:
    """The fields a transformers.GenerationConfig sets (its `to_diff_dict()`, else the
    non-None entries of `to_dict()`)."""
    diff = getattr(config, "to_diff_dict", None)
    data = diff() if callable(diff) else config.to_dict()
    return {k: v for k, v in dict(data).items() if v is not None}


class GenerationConfig:
    """Generation settings with Hugging Face's names and defaults.

    Unknown fields, and known fields set to a value jaxgen does not implement, raise a
    `ValueError` naming them and the allowed values. `replace(**changes)` returns a new,
    re-validated config. Dynamic fields take one value or one per row; as the config does
    not know the batch, `validate_for_batch(batch)` checks the per-row lengths.
    """

    def __init__(self, **fields: Any):
        unknown = sorted(k for k in fields
                         if k not in HF_DEFAULTS and k not in HF_FIELDS_UNSUPPORTED
                         and k not in BOOKKEEPING_FIELDS)
        if unknown:
            raise ValueError(
                f"GenerationConfig got unknown field(s) {unknown}; known fields: "
                f"{sorted(HF_DEFAULTS)}")
        values = dict(HF_DEFAULTS)
        for key, value in fields.items():
            if key in BOOKKEEPING_FIELDS:
                continue
            if key in HF_FIELDS_UNSUPPORTED:
                _refuse_unsupported(key, value)
                continue
            if key in DYNAMIC_FIELDS:
                value = _per_row(key, value)
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
    def from_defaults(cls, defaults: dict[str, Any], source: str,
                      **overrides: Any) -> "GenerationConfig":
        """`from_dict(defaults, **overrides)`, its error prefixed with `source` (where the
        defaults came from) when the defaults' own fields are at fault, not the overrides.

        >>> GenerationConfig.from_defaults({"top_k": -1}, "gen.json", top_k=3).top_k
        3
        >>> GenerationConfig.from_defaults({"top_k": -1}, "gen.json")
        Traceback (most recent call last):
        ...
        ValueError: gen.json: `top_k` must be an int >= 0 (0 disables it), got -1
        """
        try:
            return cls.from_dict(defaults, **overrides)
        except ValueError as error:
            try:
                cls.from_dict({k: v for k, v in defaults.items() if k not in overrides})
            except ValueError:
                raise ValueError(f"{source}: {error}") from None
            raise

    @classmethod
    def from_transformers(cls, config, **overrides: Any) -> "GenerationConfig":
        """A `transformers.GenerationConfig` object's fields, converted one by one through
        `from_dict` (the generation_config.json path: a field jaxgen does not implement is
        refused, naming it); `overrides` apply on top. transformers is not imported.

        >>> import types
        >>> hf = types.SimpleNamespace(to_diff_dict=lambda: {"max_new_tokens": 5})
        >>> GenerationConfig.from_transformers(hf, do_sample=True)
        GenerationConfig(max_new_tokens=5, do_sample=True)
        """
        fields = transformers_fields(config)
        try:
            return cls.from_dict(fields, **overrides)
        except ValueError as error:
            raise ValueError(f"generation_config (a transformers.GenerationConfig): {error}"
                             ) from None

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
        if not isinstance(data, dict):
            raise ValueError(f"{path} holds a {type(data).__name__}, expected an object")
        return cls.from_defaults(data, path, **overrides)

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
        return all(_same(getattr(self, k), getattr(other, k)) for k in HF_DEFAULTS)

    __hash__ = None  # array leaves: not hashable (the PyTree aux data of the static part is)

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
            neutral = 1.0 if name == "guidance_scale" else HF_DEFAULTS[name]  # None / 1: off
            if value is not None and _is_concrete(value) and _differs(value, neutral):
                active.add(name)
        return frozenset(active)

    # ----------------------------------------------------------------- validation
    def validate(self) -> None:
        """Raises ValueError naming the field and the allowed values."""
        for name, feature in NOT_YET_SUPPORTED.items():
            value = getattr(self, name)
            if _is_concrete(value) and _differs(value, HF_DEFAULTS[name]):
                default = HF_DEFAULTS[name]
                allowed = "None (unset)" if default is None else f"{default!r} or None (unset)"
                raise ValueError(f"`{name}`={value!r} applies to {feature}, which jaxgen does "
                                 f"not support yet (allowed: {allowed})")
        check_bool("do_sample", self.do_sample)
        check_bool("use_mtp", self.use_mtp)
        check_int("top_logprobs", self.top_logprobs, low=0,
                  allowed="an int >= 0 and at most the vocabulary size (0: off)")
        check_bool("prompt_logprobs", self.prompt_logprobs)
        for name in ("assistant_lookbehind", "target_lookbehind"):
            check_int(name, getattr(self, name), low=1,
                      allowed="an int >= 1 (tokens compared when aligning the assistant's and "
                              "the target's tokenizations)")
        for name in ("output_scores", "output_logits", "return_dict_in_generate"):
            check_bool(name, getattr(self, name))
        check_int("max_new_tokens", self.max_new_tokens, low=1, allow_none=True)
        check_int("max_length", self.max_length, low=1)
        check_int("num_beams", self.num_beams, low=1)
        check_int("max_cache_len", self.max_cache_len, low=1, allow_none=True,
                  allowed="an int >= 1 (the token buffer: prompt + new tokens) or None")
        check_int("prefill_chunk_size", self.prefill_chunk_size, low=1, allow_none=True,
                  allowed="an int >= 1 (positions per prefill chunk) or None (no chunking)")
        if (self.max_cache_len is not None and self.max_new_tokens is not None
                and self.max_new_tokens >= self.max_cache_len):
            raise ValueError(f"`max_new_tokens`={self.max_new_tokens} leaves no room for a prompt "
                             f"in the token buffer of `max_cache_len`={self.max_cache_len} "
                             f"(allowed: max_new_tokens <= {self.max_cache_len - 1}, or a larger "
                             f"max_cache_len)")
        if self.max_time is not None and (
                isinstance(self.max_time, (bool, np.bool_))
                or not isinstance(self.max_time, (int, float, np.floating, np.integer))
                or not self.max_time > 0):
            raise ValueError(f"`max_time` must be a number of seconds > 0 (or None), got "
                             f"{self.max_time!r}")
        self._validate_beam_fields()
        self._validate_processor_fields()
        self._validate_cache_fields()
        self._validate_assisted_fields()
        check_float("temperature", self.temperature, low=0.0, allowed="a float >= 0")
        if (self.do_sample and _is_concrete(self.temperature)
                and (_values(self.temperature) == 0).any()):
            raise ValueError("`temperature`=0 with do_sample=True is undefined; use "
                             "do_sample=False for greedy decoding (allowed: temperature > 0)")
        check_float("top_p", self.top_p, low=0.0, high=1.0, low_open=True,
                    allowed="a float in (0, 1]")
        check_float("guidance_scale", self.guidance_scale,
                    allowed="a finite float, one or one per row (None or 1: no guidance; "
                            "> 1 follows the prompt more, < 1 turns a negative prompt into a "
                            "positive one)")
        check_int("top_k", self.top_k, per_row=True, allowed="an int >= 0 (0 disables it)")
        for name in ("pad_token_id", "bos_token_id"):
            check_int(name, getattr(self, name), allow_none=True,
                      allowed="a non-negative int or None")
        if self.use_cache is not True:
            raise ValueError("`use_cache` must be True (jaxgen always decodes with a KV cache)")

    def _validate_beam_fields(self) -> None:
        """Beam fields and the combinations Hugging Face's GenerationConfig.validate rejects."""
        if not (self.early_stopping is True or self.early_stopping is False
                or self.early_stopping == "never"):
            raise ValueError(f"`early_stopping` must be True, False or 'never', got "
                             f"{self.early_stopping!r}")
        check_float("length_penalty", self.length_penalty, allowed="a finite float")
        check_int("num_return_sequences", self.num_return_sequences, low=1)
        returns = self.num_return_sequences
        if self.num_beams > 1 and self.top_logprobs:
            raise ValueError(f"`top_logprobs`={self.top_logprobs} is not supported with beam "
                             f"search (num_beams={self.num_beams}); use "
                             f"jaxgen.compute_transition_scores with output_scores=True "
                             f"(allowed: top_logprobs=0 with num_beams > 1)")
        if returns > 1 and self.num_beams == 1 and not self.do_sample:
            raise ValueError(f"greedy decoding (do_sample=False, num_beams=1) does not support "
                             f"`num_return_sequences` > 1 (got {returns}); set num_beams >= "
                             f"{returns} or do_sample=True")
        if self.num_beams > 1 and returns > self.num_beams:
            raise ValueError(f"`num_return_sequences` ({returns}) has to be smaller or equal to "
                             f"`num_beams` ({self.num_beams})")

    def _validate_assisted_fields(self) -> None:
        """Assisted / speculative decoding fields (jaxgen.speculative)."""
        check_int("num_assistant_tokens", self.num_assistant_tokens, low=1)
        for name in ("max_assistant_tokens", "prompt_lookup_num_tokens",
                     "max_matching_ngram_size"):
            check_int(name, getattr(self, name), low=1, allow_none=True)
        if self.num_assistant_tokens_schedule not in ASSISTANT_SCHEDULES:
            raise ValueError(f"`num_assistant_tokens_schedule` must be one of "
                             f"{list(ASSISTANT_SCHEDULES)}, got "
                             f"{self.num_assistant_tokens_schedule!r}")
        check_float("assistant_ensemble_weight", self.assistant_ensemble_weight, low=0.0,
                    high=1.0, low_open=True, high_open=True,
                    allowed="a float in the open interval (0, 1) (None: lossless "
                            "speculative decoding)")
        check_float("assistant_confidence_threshold", self.assistant_confidence_threshold,
                    low=0.0, high=1.0, allowed="a float in [0, 1] (0 disables it)")
        check_int("assistant_early_exit", self.assistant_early_exit, low=1, allow_none=True)
        config_checks.validate_fallback_fields(self)
        config_checks.validate_tree_fields(self)
        if self.assistant_early_exit is not None and self.num_beams > 1:
            raise ValueError(f"self-speculative early exit (`assistant_early_exit`="
                             f"{self.assistant_early_exit}) does not support beam search "
                             f"(num_beams={self.num_beams}); assisted decoding works with "
                             f"greedy or sampling (allowed: num_beams=1)")
        if self.assistant_early_exit is not None and self.prompt_lookup_num_tokens is not None:
            raise ValueError("pass either `assistant_early_exit` or `prompt_lookup_num_tokens`, "
                             "not both")
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
        """Logits-processor and stopping fields (jaxgen.logits.chain, jaxgen.stopping)."""
        config_checks.validate_processor_fields(self)
        object.__setattr__(self, "watermarking_config",
                           parse_watermarking_config(self.watermarking_config))

    def vmap_axes(self, **axes: int | None) -> "GenerationConfig":
        """An `in_axes` tree for `jax.vmap` over this config's dynamic fields.

        Fields not named are broadcast (None). Only dynamic fields that are set can be mapped.

        Example:
            >>> import jax, jax.numpy as jnp
            >>> from jaxgen import GenerationConfig
            >>> cfg = GenerationConfig(do_sample=True, temperature=jnp.array([0.5, 1.0]))
            >>> axes = cfg.vmap_axes(temperature=0)
            >>> jax.vmap(lambda c: c.temperature * 2, in_axes=(axes,))(cfg).tolist()
            [1.0, 2.0]

        With a model, `jax.vmap(lambda c: jaxgen.generate(params, state, c).sequences,
        in_axes=(axes,))(cfg)` sweeps the values in one compiled program.
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
                                for name, value in zip(DYNAMIC_FIELDS, leaves)] + [None])

    @property
    def sample_copies(self) -> int:
        """Rows per prompt that init_state builds: num_return_sequences when sampling without
        beams (each copy samples on its own, as HF expands the input), else 1."""
        return int(self.num_return_sequences) if self.num_beams == 1 else 1

    def repeat_rows(self, batch: int, times: int) -> "GenerationConfig":
        """The config with per-row [batch] dynamic leaves repeated to [batch * times] rows
        (row b becomes rows b*times .. b*times+times-1); scalars stay as they are.

        >>> from jaxgen import GenerationConfig
        >>> GenerationConfig(do_sample=True, temperature=[0.5, 0.7]).repeat_rows(2, 2).temperature
        Array([0.5, 0.5, 0.7, 0.7], dtype=float32)
        """
        if times == 1:
            return self
        leaves, aux = _flatten(self)
        out = []
        for value in leaves[:len(DYNAMIC_FIELDS)]:
            if value is not None and np.ndim(value) >= 1 and np.shape(value)[0] == batch:
                value = jnp.repeat(jnp.asarray(value), times, axis=0)
            out.append(value)
        return _unflatten(aux, out + [leaves[-1]])

    def validate_for_batch(self, batch: int) -> None:
        """Checks the per-row dynamic values against the batch: each is one value (a scalar)
        or one value per row (1-D, length `batch`). Raises ValueError naming the field.

        Only shapes are read, so traced values (inside `jax.vmap` / `jax.jit`) are checked
        too: under `vmap` a mapped field holds its per-call value.

        Example:
            >>> from jaxgen import GenerationConfig
            >>> cfg = GenerationConfig(do_sample=True, temperature=[0.5, 0.7, 0.9])
            >>> cfg.validate_for_batch(3)
            >>> cfg.validate_for_batch(2)  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ValueError: `temperature` has 3 values but the batch has 2 rows; pass one value or ...
        """
        check_int("batch", batch, low=1)
        for name in DYNAMIC_FIELDS:
            value = getattr(self, name)
            if value is None:
                continue
            shape = tuple(np.shape(value))
            if len(shape) == 0 or shape == (batch,):
                continue
            if len(shape) == 1:
                raise ValueError(f"`{name}` has {shape[0]} values but the batch has {batch} "
                                 f"rows; pass one value or one per row")
            raise ValueError(f"`{name}` has shape {shape} but a per-row value is 1-D (the "
                             f"batch has {batch} rows); pass one value or one per row")

    def validate_for_model(self, vocab_size: int) -> None:
        """Checks the token ids the config names against the vocabulary."""
        config_checks.validate_processor_ids(self, vocab_size)
        if self.top_logprobs > vocab_size:
            raise ValueError(f"`top_logprobs`={self.top_logprobs} is more than the vocabulary "
                             f"size (allowed: 0..{vocab_size})")
        for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
            value = getattr(self, name)
            ids = value if isinstance(value, tuple) else ((value,) if value is not None else ())
            for token in ids:
                if token >= vocab_size:
                    raise ValueError(f"`{name}`={value!r} is outside the vocabulary "
                                     f"(allowed: 0..{vocab_size - 1})")


def _refuse_unsupported(key: str, value) -> None:
    """A HF_FIELDS_UNSUPPORTED field: None and its neutral values pass, anything else raises."""
    neutral, why = HF_FIELDS_UNSUPPORTED[key]
    if value is None or any(_same(value, v) for v in neutral):
        return
    allowed = " or ".join([repr(v) for v in neutral] + ["None (unset)"])
    raise ValueError(f"`{key}`={value!r} is not supported by jaxgen: {why} (allowed: "
                     f"{allowed})")


def _freeze(value):
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, np.ndarray):
        return tuple(value.reshape(-1).tolist())
    return value


def _differs(value, default) -> bool:
    """Whether `value` (a scalar or per-row array) is anywhere other than `default`."""
    if value is None or default is None:
        return value is not default
    try:
        return bool(np.any(np.asarray(value) != np.asarray(default)))
    except (TypeError, ValueError):
        return bool(value != default)


def _same(a, b) -> bool:
    """Equal values of the same shape (a per-row [0.5, 0.5] is not 0.5). Floats compare as
    float32, the dtype jaxgen computes in (a list and a float32 jax array can be equal)."""
    if a is None or b is None:
        return a is b
    if isinstance(a, (bool, np.bool_)) != isinstance(b, (bool, np.bool_)):
        return False
    try:
        x, y = np.asarray(a), np.asarray(b)
        if x.dtype.kind in "biuf" and y.dtype.kind in "biuf":
            if "f" in (x.dtype.kind, y.dtype.kind):
                x, y = x.astype(np.float32), y.astype(np.float32)
            return x.shape == y.shape and bool(np.all(x == y))
    except (TypeError, ValueError, OverflowError):
        pass
    try:
        return bool(a == b)
    except (TypeError, ValueError):
        return False


# In the static part of a program config (jaxgen.config.program) in place of the EOS ids,
# which are then the PyTree child after the dynamic fields.
_DYNAMIC_EOS = "<dynamic: the EosTable leaf>"


def _flatten(cfg: GenerationConfig):
    """Children: the DYNAMIC_FIELDS values, then the EOS table of a program config (else
    None); aux: every static field (the EOS ids as a marker when they are a table)."""
    eos = cfg.eos_token_id
    table = None if eos is None or isinstance(eos, tuple) else eos  # an EosTable
    leaves = tuple(getattr(cfg, name) for name in DYNAMIC_FIELDS) + (table,)
    static = tuple((k, _DYNAMIC_EOS if k == "eos_token_id" and table is not None
                    else getattr(cfg, k)) for k in STATIC_FIELDS)
    return leaves, _StaticPart(static, cfg.active_dynamic())


def _unflatten(aux: "_StaticPart", leaves) -> GenerationConfig:
    cfg = object.__new__(GenerationConfig)
    leaves = tuple(leaves)
    for key, value in aux.static:
        object.__setattr__(cfg, key, leaves[-1] if value is _DYNAMIC_EOS else value)
    for key, value in zip(DYNAMIC_FIELDS, leaves):
        object.__setattr__(cfg, key, value)
    object.__setattr__(cfg, "_active", aux.active)
    return cfg


def with_static(cfg: GenerationConfig, **fields) -> GenerationConfig:
    """`cfg` with static fields replaced as they are, without validation (for the program
    form, jaxgen.config.program; users call `cfg.replace`)."""
    unknown = sorted(set(fields) - set(STATIC_FIELDS))
    if unknown:
        raise ValueError(f"with_static: {unknown} are not static fields")
    leaves, aux = _flatten(cfg)
    out = _unflatten(aux, leaves)
    for key, value in fields.items():
        object.__setattr__(out, key, value)
    return out


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

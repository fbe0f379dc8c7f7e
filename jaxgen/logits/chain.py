"""Logits processors: pure transforms `(scores [B, V], ctx) -> scores`, chained in Hugging
Face's order (transformers 5.x `GenerationMixin._get_logits_processor`).

Numeric parameters come from the config's dynamic leaves (scalar or per-row [B]), so a
new temperature, top-p or penalty never recompiles; which processors run is static
(`cfg.active_dynamic()` plus the static fields). The processors themselves live in
    jaxgen/logits/warpers.py   temperature, top-k, top-p, min-p, typical, epsilon, eta
    jaxgen/logits/history.py    repetition / presence / frequency, no-repeat-ngram,
                                    sequence bias, bad words
    jaxgen/logits/position.py   min length, forced BOS/EOS, suppression, decay, clean-ups

The chain (`process_logits`), HF's order, each step present only when configured:
     1 sequence_bias               2 repetition_penalty    3 presence/frequency (jaxgen)
     4 no_repeat_ngram_size        5 bad_words_ids         6 min_length / min_new_tokens
     7 forced_bos_token_id         8 forced_eos_token_id   9 remove_invalid_values
    10 exponential_decay_length_penalty                   11 suppress_tokens
    12 begin_suppress_tokens      13 user processors (HF merges custom lists here)
    sampling only: 14 temperature 15 top_h 16 top_k 17 top_p 18 min_p 19 typical_p
    20 epsilon 21 eta
    22 watermarking_config (green list or SynthID, jaxgen.logits.watermark.green_list)
    23 renormalize_logits (always last)

Example:
    >>> cfg = GenerationConfig(do_sample=True, top_k=2)
    >>> ctx = ProcessorContext(tokens=jnp.zeros((1, 4), jnp.int32), length=jnp.array([1]),
    ...                        prompt_len=jnp.array([1]))
    >>> process_logits(cfg, jnp.array([[1.0, 3.0, 2.0, 0.0]]), ctx)
    Array([[-inf,   3.,   2., -inf]], dtype=float32)
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from jaxgen.config.generation import GenerationConfig
from jaxgen.logits.history import (  # noqa: F401  (re-exported)
    bad_words_as_bias,
    no_repeat_ngram,
    normalize_sequence_bias,
    presence_frequency_penalty,
    repetition_penalty,
    sequence_bias,
    token_counts,
    token_presence,
    valid_positions,
)
from jaxgen.logits.position import (  # noqa: F401
    begin_suppress_tokens,
    exponential_decay_length_penalty,
    forced_bos,
    forced_eos,
    min_length_mask,
    remove_invalid_values,
    renormalize,
    row_max_length,
    suppress_tokens,
)
from jaxgen.logits.warpers import (  # noqa: F401
    NEG_INF,
    epsilon_filter,
    eta_filter,
    kth_largest,
    min_p_filter,
    per_row,
    search_threshold,
    temperature_scale,
    top_h_filter,
    top_h_filter_sorted,
    top_k_filter,
    top_k_filter_sorted,
    top_p_filter,
    top_p_filter_sorted,
    typical_filter,
    typical_filter_sorted,
)
from jaxgen.logits.watermark.green_list import watermark_scores

LogitsProcessorFn = Callable[[jax.Array, "ProcessorContext"], jax.Array]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ProcessorContext:
    """What a processor may read besides the scores.

    tokens:     int32 [B, T] prompt + generated so far (entries at index >= length are padding);
    length:     int32 [B] number of real tokens (the token being chosen goes at index `length`);
    prompt_len: int32 [B];
    max_new:    int32 [B] per-row budget of new tokens, or None (then the row's max_length is
                the buffer length T). Forced EOS fires when length == prompt_len + max_new - 1.
    """

    tokens: jax.Array
    length: jax.Array
    prompt_len: jax.Array
    max_new: jax.Array | None = None


def min_tokens_to_keep_for(cfg: GenerationConfig) -> int:
    """HF: 1, or (#EOS + 1, at least 2) for beam sampling."""
    if cfg.num_beams > 1:
        return max(2, len(cfg.eos_ids) + 1)
    return 1


def use_exact_filters(cfg: GenerationConfig) -> bool:
    """True when the config asks for the sort-based filters (jaxgen field `filter_impl`)."""
    return getattr(cfg, "filter_impl", "search") == "sort"


def process_logits(cfg: GenerationConfig, logits: jax.Array, ctx: ProcessorContext, *,
                   exact: bool | None = None, min_tokens_to_keep: int | None = None,
                   extra: Sequence[LogitsProcessorFn] = ()) -> jax.Array:
    """Applies the processors `cfg` enables, in Hugging Face's order.

    logits: float32 [B, V] raw next-token logits. Returns processed scores [B, V].
    exact: sort paths for top-k / top-p / min-p / top-H / typical-p (default: cfg.filter_impl).
    min_tokens_to_keep: override of HF's value (1, or #EOS + 1 for beam sampling).
    extra: user processors `(scores, ctx) -> scores`, applied where HF merges a custom
        `logits_processor` list: after the built-in processors, before the sampling warpers.
    """
    exact = use_exact_filters(cfg) if exact is None else exact
    keep = min_tokens_to_keep_for(cfg) if min_tokens_to_keep is None else int(min_tokens_to_keep)
    scores = logits.astype(jnp.float32)  # [B, V]
    active = cfg.active_dynamic()
    eos = cfg.eos_ids

    if cfg.sequence_bias is not None:
        scores = sequence_bias(scores, ctx, normalize_sequence_bias(cfg.sequence_bias))
    if "repetition_penalty" in active:
        scores = repetition_penalty(scores, ctx, cfg.repetition_penalty,
                                    cfg.prompt_ignore_length)
    if "presence_penalty" in active or "frequency_penalty" in active:
        scores = presence_frequency_penalty(scores, ctx, cfg.presence_penalty,
                                            cfg.frequency_penalty)
    if cfg.no_repeat_ngram_size:
        scores = no_repeat_ngram(scores, ctx, cfg.no_repeat_ngram_size)
    if cfg.bad_words_ids is not None:
        table = bad_words_as_bias(cfg.bad_words_ids, eos)
        if table:
            scores = sequence_bias(scores, ctx, table)
    if eos and "min_new_tokens" in active:  # HF: min_new_tokens overrides min_length
        scores = min_length_mask(scores, ctx, eos, min_new_tokens=cfg.min_new_tokens)
    elif eos and "min_length" in active:
        scores = min_length_mask(scores, ctx, eos, min_length=cfg.min_length)
    if cfg.forced_bos_token_id is not None:
        scores = forced_bos(scores, ctx, cfg.forced_bos_token_id)
    if cfg.forced_eos_token_id is not None:
        scores = forced_eos(scores, ctx, _ids(cfg.forced_eos_token_id))
    if cfg.remove_invalid_values:
        scores = remove_invalid_values(scores)
    if cfg.exponential_decay_length_penalty is not None and eos:
        start, factor = cfg.exponential_decay_length_penalty
        scores = exponential_decay_length_penalty(scores, ctx, start, factor, eos)
    if cfg.suppress_tokens is not None:
        scores = suppress_tokens(scores, _ids(cfg.suppress_tokens))
    if cfg.begin_suppress_tokens is not None:
        scores = begin_suppress_tokens(scores, ctx, _ids(cfg.begin_suppress_tokens),
                                       cfg.forced_bos_token_id)
    for processor in extra:
        scores = _check_user_output(processor, processor(scores, ctx), scores)

    if cfg.do_sample:
        scores = sampling_warpers(cfg, scores, active=active, exact=exact, keep=keep)
    if cfg.watermarking_config is not None:  # HF: after every other processor
        scores = watermark_scores(scores, ctx, cfg.watermarking_config)
    if cfg.renormalize_logits:
        scores = renormalize(scores)
    return scores


def sampling_warpers(cfg: GenerationConfig, scores: jax.Array, *, active=None, exact=None,
                     keep=None) -> jax.Array:
    """The sampling warpers of `cfg` in HF's order (temperature, top-H, top-k, top-p, min-p,
    typical-p, epsilon, eta): the vocabulary-agnostic part of the chain. scores [B, V]."""
    active = cfg.active_dynamic() if active is None else active
    exact = use_exact_filters(cfg) if exact is None else exact
    keep = min_tokens_to_keep_for(cfg) if keep is None else keep
    if "temperature" in active:
        scores = temperature_scale(scores, cfg.temperature)
    if "top_h" in active:
        scores = (top_h_filter_sorted if exact else top_h_filter)(scores, cfg.top_h)
    if "top_k" in active:
        scores = (top_k_filter_sorted if exact else top_k_filter)(scores, cfg.top_k, keep)
    if "top_p" in active:
        scores = (top_p_filter_sorted if exact else top_p_filter)(scores, cfg.top_p, keep)
    if "min_p" in active:
        scores = min_p_filter(scores, cfg.min_p, keep, exact=exact)
    if "typical_p" in active:
        scores = (typical_filter_sorted if exact else typical_filter)(scores, cfg.typical_p, keep)
    if "epsilon_cutoff" in active:
        scores = epsilon_filter(scores, cfg.epsilon_cutoff, keep)
    if "eta_cutoff" in active:
        scores = eta_filter(scores, cfg.eta_cutoff, keep)
    return scores


def _ids(value) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _check_user_output(processor, out, scores: jax.Array) -> jax.Array:
    if not hasattr(out, "shape") or tuple(out.shape) != tuple(scores.shape):
        raise ValueError(f"logits processor {processor!r} must return scores of shape "
                         f"{tuple(scores.shape)}, got {getattr(out, 'shape', type(out))}")
    return jnp.asarray(out, jnp.float32)

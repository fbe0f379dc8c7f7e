"""Stopping criteria as objects, for people who build their own loops on jaxgen's pieces
(Hugging Face's `transformers.generation.stopping_criteria`, the JAX way).

A criterion is a callable `criterion(ctx, scores) -> bool [B]` (True = stop the row), where
`ctx` is a `jaxgen.logits.chain.ProcessorContext` (tokens [B, T] and the per-row `length`, the
newest token included) and `scores` the processed scores [B, V] the newest token came from.
That is the contract of `generate(..., stopping_criteria=...)` too, so every criterion here
also works there (rows they stop get stop reason `custom`). Each is a pure JAX function of
its inputs (jit-able per-row flags), except `MaxTimeCriteria`, which reads the host clock and
so only runs eagerly between steps (inside generate, use the `max_time` config field).

Rows are ragged: where Hugging Face reads `input_ids.shape[1]` or `input_ids[:, -1]` of a
padded batch, a criterion here reads each row's own `length` and newest token, i.e. what HF
computes for the row alone.

Example:
    >>> import jax.numpy as jnp
    >>> from jaxgen.logits.chain import ProcessorContext
    >>> criteria = StoppingCriteriaList([MaxLengthCriteria(4), EosTokenCriteria(2)])
    >>> ctx = ProcessorContext(tokens=jnp.array([[5, 2, 0, 0], [5, 6, 7, 8], [5, 6, 0, 0]]),
    ...                        length=jnp.array([2, 4, 2]), prompt_len=jnp.array([1, 1, 1]))
    >>> criteria(ctx, None).tolist()
    [True, True, False]
"""
from __future__ import annotations

import dataclasses
import inspect
import time
import warnings
from typing import Any, Iterable, Sequence

import jax
import jax.numpy as jnp

from jaxgen.config.fields import check_float, check_int
from jaxgen.stopping.strings import StopStringTables, build_stop_tables, stop_string_hit


def _newest(ctx, back: int = 0) -> jax.Array:
    """int32 [B]: each row's token `back` places before its newest one (-1 before the row)."""
    index = ctx.length - 1 - back  # [B]
    token = jnp.take_along_axis(ctx.tokens, jnp.clip(index, 0, None)[:, None], axis=1)[:, 0]
    return jnp.where(index >= 0, token, -1)  # [B]


def _batch(ctx) -> int:
    return ctx.length.shape[0]


@dataclasses.dataclass(frozen=True)
class MaxLengthCriteria:
    """Stops a row once it holds `max_length` tokens (prompt included), HF's rule per row.

    >>> import jax.numpy as jnp
    >>> from jaxgen.logits.chain import ProcessorContext
    >>> ctx = ProcessorContext(tokens=jnp.zeros((2, 8), jnp.int32), length=jnp.array([5, 10]),
    ...                        prompt_len=jnp.array([1, 1]))
    >>> MaxLengthCriteria(10)(ctx, None).tolist()
    [False, True]
    """

    max_length: int
    max_position_embeddings: int | None = None  # HF only warns past it; kept for parity

    def __post_init__(self):
        check_int("max_length", self.max_length, low=1)
        check_int("max_position_embeddings", self.max_position_embeddings, low=1,
                  allow_none=True)

    def __call__(self, ctx, scores=None) -> jax.Array:
        return ctx.length >= self.max_length  # [B]


@dataclasses.dataclass(frozen=True)
class EosTokenCriteria:
    """Stops a row when one of its last `new_token_length` tokens is an EOS id.

    >>> import jax.numpy as jnp
    >>> from jaxgen.logits.chain import ProcessorContext
    >>> ctx = ProcessorContext(tokens=jnp.array([[4, 0, 9], [4, 1, 9]]), length=jnp.array([2, 2]),
    ...                        prompt_len=jnp.array([1, 1]))
    >>> EosTokenCriteria(eos_token_id=0)(ctx, None).tolist()
    [True, False]
    """

    eos_token_id: Any
    new_token_length: int = 1

    def __post_init__(self):
        ids = self.eos_token_id
        ids = ids.tolist() if hasattr(ids, "tolist") else ids  # an array (torch / numpy / jax)
        ids = list(ids) if isinstance(ids, (list, tuple)) else [ids]
        allowed = "a non-negative token id or a non-empty list of them"
        if not ids:
            raise ValueError(f"`eos_token_id` must be {allowed}, got {self.eos_token_id!r}")
        for token in ids:
            check_int("eos_token_id", token, allowed=allowed, shown=repr(self.eos_token_id))
        object.__setattr__(self, "eos_token_id", tuple(int(t) for t in ids))
        check_int("new_token_length", self.new_token_length, low=1)

    def __call__(self, ctx, scores=None) -> jax.Array:
        eos = jnp.asarray(self.eos_token_id, jnp.int32)  # [E]
        hit = jnp.zeros((_batch(ctx),), bool)  # [B]
        for back in range(self.new_token_length):
            hit |= jnp.isin(_newest(ctx, back), eos)
        return hit  # [B]


@dataclasses.dataclass(frozen=True)
class ConfidenceCriteria:
    """Stops a row when its newest token had probability < `assistant_confidence_threshold`
    under the scores it was chosen from (HF's rule for drafting, per row).

    >>> import jax.numpy as jnp
    >>> from jaxgen.logits.chain import ProcessorContext
    >>> ctx = ProcessorContext(tokens=jnp.array([[0, 1], [0, 0]]), length=jnp.array([2, 2]),
    ...                        prompt_len=jnp.array([1, 1]))
    >>> scores = jnp.log(jnp.array([[0.7, 0.3], [0.7, 0.3]]))
    >>> ConfidenceCriteria(0.4)(ctx, scores).tolist()
    [True, False]
    """

    assistant_confidence_threshold: float

    def __post_init__(self):
        check_float("assistant_confidence_threshold", self.assistant_confidence_threshold,
                    low=0.0, high=1.0, allowed="a float in [0, 1]")

    def __call__(self, ctx, scores) -> jax.Array:
        if scores is None:
            raise ValueError("ConfidenceCriteria needs the scores the newest token came from")
        probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1)  # [B, V]
        token = jnp.clip(_newest(ctx), 0, scores.shape[-1] - 1)  # [B]
        p = jnp.take_along_axis(probs, token[:, None], axis=-1)[:, 0]  # [B]
        return p < self.assistant_confidence_threshold  # [B]


@dataclasses.dataclass(frozen=True, eq=False)
class StopStringCriteria:
    """Stops a row when a stop string ends inside its newest token (HF's StopStringCriteria
    semantics; the tables come from `jaxgen.stopping.strings`, built once per tokenizer).

    tokenizer: a `tokenizers.Tokenizer`, jaxgen's tokenizer wrapper or an HF tokenizer.
    vocab_size: the model's vocabulary, when it is larger than the tokenizer's.
    Hashed by identity (its tables are arrays): reuse the object to reuse a compile.
    """

    tokenizer: Any
    stop_strings: str | Sequence[str]
    vocab_size: int = 0
    tables: StopStringTables | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "tables", build_stop_tables(self.tokenizer, self.stop_strings,
                                                             self.vocab_size))

    def __call__(self, ctx, scores=None) -> jax.Array:
        return stop_string_hit(self.tables, ctx.tokens, ctx.length)  # [B]


@dataclasses.dataclass(frozen=True)
class MaxTimeCriteria:
    """Stops every row once `max_time` seconds have passed since `initial_timestamp`
    (default: when the object is made). It reads the host clock, so it runs eagerly only:
    call it between steps of a host loop; inside `generate` use `GenerationConfig(max_time=)`.

    >>> import jax.numpy as jnp, time
    >>> from jaxgen.logits.chain import ProcessorContext
    >>> ctx = ProcessorContext(tokens=jnp.zeros((2, 4), jnp.int32), length=jnp.array([1, 2]),
    ...                        prompt_len=jnp.array([1, 1]))
    >>> MaxTimeCriteria(0.1, initial_timestamp=time.time() - 0.2)(ctx, None).tolist()
    [True, True]
    """

    max_time: float
    initial_timestamp: float | None = None

    def __post_init__(self):
        check_float("max_time", self.max_time, low=0.0, low_open=True,
                    allowed="a number of seconds > 0")
        if self.initial_timestamp is None:
            object.__setattr__(self, "initial_timestamp", time.time())

    def __call__(self, ctx, scores=None) -> jax.Array:
        if isinstance(ctx.length, jax.core.Tracer):
            raise ValueError("MaxTimeCriteria reads the host clock and cannot run inside a "
                             "compiled program; call it between steps, or pass "
                             "GenerationConfig(max_time=...) to generate")
        done = time.time() - self.initial_timestamp > self.max_time
        return jnp.full((_batch(ctx),), done)  # [B]


def accepted_kwargs(function, kwargs: dict) -> dict:
    """The entries of `kwargs` that `function` accepts as keywords (all of them when it takes
    **kwargs; none when its signature cannot be read).

    >>> accepted_kwargs(lambda ctx, scores=None: None, {"scores": 1, "step": 2})
    {'scores': 1}
    """
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(kwargs)
    named = {name for name, p in parameters.items()
             if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                           inspect.Parameter.KEYWORD_ONLY)}
    return {k: v for k, v in kwargs.items() if k in named}


class StoppingCriteriaList(list):
    """Criteria combined by OR, as Hugging Face's list: `criteria(ctx, scores, **kwargs) ->
    bool [B]`. Each criterion gets `scores` and the keyword arguments only where its
    signature accepts them (a criterion `(ctx) -> bool [B]` is fine).

    `generate(..., stopping_criteria=the_list)` takes its entries (a list is not hashable,
    its entries are).

    >>> import jax.numpy as jnp
    >>> from jaxgen.logits.chain import ProcessorContext
    >>> ctx = ProcessorContext(tokens=jnp.zeros((2, 4), jnp.int32), length=jnp.array([2, 3]),
    ...                        prompt_len=jnp.array([1, 1]))
    >>> at_3 = lambda ctx: ctx.length >= 3              # takes no scores
    >>> late = lambda ctx, scores, *, step: ctx.length >= step
    >>> StoppingCriteriaList([at_3, late])(ctx, None, step=2, unused=0).tolist()
    [True, True]
    """

    def __call__(self, ctx, scores=None, **kwargs) -> jax.Array:
        done = jnp.zeros((_batch(ctx),), bool)  # [B]
        for criterion in self:
            hit = call_criterion(criterion, ctx, scores, **kwargs)
            done |= jnp.broadcast_to(jnp.asarray(hit, bool), done.shape)
        return done

    @property
    def max_length(self) -> int | None:
        """The max_length of the first MaxLengthCriteria in the list (None if there is none)."""
        for criterion in self:
            if isinstance(criterion, MaxLengthCriteria):
                return criterion.max_length
        return None


def call_criterion(criterion, first, scores, **kwargs):
    """`criterion(first, scores, **kwargs)` with `scores` (positional, or by name) and the
    keyword arguments only where the criterion's signature accepts them."""
    takes = accepted_kwargs(criterion, {"scores": scores, **kwargs})
    if _takes_second_positional(criterion):
        takes.pop("scores", None)
        return criterion(first, scores, **takes)
    return criterion(first, **takes)


def _takes_second_positional(function) -> bool:
    """Whether `function` takes a second positional argument (the scores) after ctx."""
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return True
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters):
        return True
    positional = [p for p in parameters if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                      inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2


def validate_stopping_criteria(criteria: Iterable, max_length: int) -> StoppingCriteriaList:
    """A copy of `criteria` that stops at `max_length` (HF's validate_stopping_criteria):
    a MaxLengthCriteria is appended when there is none; one with another max_length stays
    (with a UserWarning, as in HF).

    >>> validate_stopping_criteria(StoppingCriteriaList(), 11).max_length
    11
    """
    check_int("max_length", max_length, low=1)
    out = StoppingCriteriaList(criteria)
    if out.max_length is None:
        out.append(MaxLengthCriteria(max_length=max_length))
    elif out.max_length != max_length:
        warnings.warn(f"the stopping criteria stop at max_length={out.max_length} but "
                      f"max_length={max_length} was given", UserWarning, stacklevel=2)
    return out


def flatten_criteria(criteria) -> tuple:
    """The criteria of a StoppingCriteriaList (nested ones too) as a flat tuple; other values
    pass through as one-element tuples (used by `jaxgen.core.extensions`)."""
    if isinstance(criteria, StoppingCriteriaList):
        return tuple(c for item in criteria for c in flatten_criteria(item))
    return (criteria,)


__all__ = ["ConfidenceCriteria", "EosTokenCriteria", "MaxLengthCriteria", "MaxTimeCriteria",
           "StopStringCriteria", "StoppingCriteriaList", "accepted_kwargs", "call_criterion",
           "validate_stopping_criteria"]

"""The context a call may use: the prompt plus `max_new_tokens` must fit the model's positions
(`max_position_embeddings`), checked before anything is allocated or compiled; an opt-in
truncation keeps the end of a prompt that is too long (as transformers' pipelines do with
truncation from the left).

Example:
    >>> check_context(8, [3, 6], 2)
    >>> check_context(8, [3, 7], 2)
    Traceback (most recent call last):
    jaxgen.core.context.ContextTooLong: row 1: the prompt (7 tokens) plus max_new_tokens=2 needs 9 positions; the model has 8 (max_position_embeddings). Shorten the prompt, lower max_new_tokens, or truncate the prompt from the left (truncation="left")
    >>> truncate_left([1, 2, 3, 4, 5, 6, 7], 8, 2)
    [2, 3, 4, 5, 6, 7]
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

TRUNCATIONS = (None, "left")


class ContextTooLong(ValueError):
    """A prompt plus its new tokens past the model's positions; `row` is the prompt's index."""

    def __init__(self, message: str, row: int):
        super().__init__(message)
        self.row = row


def model_positions(model) -> int | None:
    """The model's `max_position_embeddings` (None when its config does not say, or when its
    RoPE scaling is "dynamic": dynamic NTK recomputes the frequencies for longer sequences,
    so transformers runs such models past max_position_embeddings by design).

    >>> from types import SimpleNamespace as NS
    >>> model_positions(NS(config=NS(max_position_embeddings=64)))
    64
    >>> model_positions(NS(config=NS(max_position_embeddings=64,
    ...                              rope_scaling=(("factor", 2.0), ("rope_type", "dynamic")))))
    >>> model_positions(object())
    """
    config = getattr(model, "config", None)
    value = getattr(config, "max_position_embeddings", None)
    if value is None or _rope_type(getattr(config, "rope_scaling", None)) == "dynamic":
        return None
    return int(value)


def _rope_type(scaling) -> str | None:
    """The rope_type of a rope_scaling setting (a dict or a tuple of pairs), else None."""
    if not scaling:
        return None
    try:
        scaling = dict(scaling)
    except (TypeError, ValueError):
        return None
    return scaling.get("rope_type", scaling.get("type"))


def check_context(max_positions: int | None, prompt_lengths: Sequence[int],
                  max_new_tokens, *, where: Callable[[int], str] | None = None,
                  limit_name: str = "max_position_embeddings") -> None:
    """ContextTooLong for the first prompt whose length plus max_new_tokens passes
    max_positions (None: no limit). max_new_tokens: one int, or one per prompt. `where(row)`
    names the row in the message (default "row N"; the CLI gives file:line); `limit_name`
    says what the limit is (default the model's max_position_embeddings).

    >>> check_context(10, [3, 4], [7, 7], limit_name="buffer")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    jaxgen.core.context.ContextTooLong: row 1: ... needs 11 positions; that does not fit the buffer of 10. ...
    """
    if max_positions is None:
        return
    lengths = [int(n) for n in prompt_lengths]
    budgets = ([int(max_new_tokens)] * len(lengths) if np.ndim(max_new_tokens) == 0
               else [int(n) for n in np.asarray(max_new_tokens).reshape(-1)])
    if len(budgets) != len(lengths):
        raise ValueError(f"check_context: {len(budgets)} budgets for {len(lengths)} prompts")
    for row, (length, budget) in enumerate(zip(lengths, budgets)):
        needed = length + budget
        if needed > max_positions:
            name = where(row) if where is not None else f"row {row}"
            limit = (f"the model has {max_positions} (max_position_embeddings)"
                     if limit_name == "max_position_embeddings" else
                     f"that does not fit the {limit_name} of {max_positions}")
            raise ContextTooLong(
                f"{name}: the prompt ({length} tokens) plus max_new_tokens={budget} needs "
                f"{needed} positions; {limit}. Shorten the prompt, lower max_new_tokens, or "
                f"truncate the prompt from the left (truncation=\"left\")", row)


def truncate_left(ids: Sequence[int], max_positions: int | None, max_new_tokens: int) -> list:
    """The last max_positions - max_new_tokens ids of a prompt (all of them when they fit).
    ValueError when max_new_tokens alone leaves no room for one prompt token."""
    ids = list(ids)
    if max_positions is None:
        return ids
    room = int(max_positions) - int(max_new_tokens)
    if room < 1:
        raise ValueError(f"`max_new_tokens`={int(max_new_tokens)} leaves no room for a prompt "
                         f"in the model's {max_positions} positions (allowed: at most "
                         f"{max_positions - 1})")
    return ids[-room:] if len(ids) > room else ids


__all__ = ["ContextTooLong", "TRUNCATIONS", "check_context", "model_positions", "truncate_left"]

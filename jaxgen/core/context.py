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

TRUNCATIONS = (None, "left")


class ContextTooLong(ValueError):
    """A prompt plus its new tokens past the model's positions; `row` is the prompt's index."""

    def __init__(self, message: str, row: int):
        super().__init__(message)
        self.row = row


def model_positions(model) -> int | None:
    """The model's `max_position_embeddings` (None when its config does not say)."""
    value = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return int(value) if value is not None else None


def check_context(max_positions: int | None, prompt_lengths: Sequence[int],
                  max_new_tokens: int, *, where: Callable[[int], str] | None = None) -> None:
    """ContextTooLong for the first prompt whose length plus max_new_tokens passes
    max_positions (None: no limit). `where(row)` names the row in the message (default
    "row N"; the CLI gives file:line)."""
    if max_positions is None:
        return
    for row, length in enumerate(prompt_lengths):
        needed = int(length) + int(max_new_tokens)
        if needed > max_positions:
            name = where(row) if where is not None else f"row {row}"
            raise ContextTooLong(
                f"{name}: the prompt ({int(length)} tokens) plus max_new_tokens="
                f"{int(max_new_tokens)} needs {needed} positions; the model has {max_positions} "
                f"(max_position_embeddings). Shorten the prompt, lower max_new_tokens, or "
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

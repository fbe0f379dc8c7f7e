"""Hugging Face's alignment rules for universal assisted decoding, one row at a time (host).

Greedy (HF's AssistedCandidateGeneratorDifferentTokenizers), per row and round, with T the
row's target ids:

  1. assistant input: the first round converts all of T (target text -> assistant ids).
     Later rounds convert only the target window T[prev_len - target_lookbehind:] and align
     it with the tail of the previous assistant ids (prompt + drafts) by the longest diagonal
     of their equality matrix: the assistant ids after the aligned run that disagree with the
     window are replaced (the rejected drafts: both sides roll back to the aligned point) and
     the window's tokens after it are appended. No common token: the window is appended.
  2. the assistant drafts d (compiled, jaxgen.speculative.uad.drafter).
  3. target drafts: the window of the last `assistant_lookbehind` assistant ids (input +
     drafts) is converted to target ids and aligned with T's tail the same way; the target
     drafts are the converted tokens after the aligned run (no common token: all of them).

Sampling (HF's UniversalSpeculativeDecodingGenerator): each assistant draft is its own target
token (the vocabulary map), so a round only drops the rejected drafts from the assistant ids
and appends the new target token: by the map when it has an assistant counterpart, else by
text.

Deliberate difference: HF slices the assistant window from `n - assistant_lookbehind`, which
is negative for short inputs and then wraps around to the end; here it starts at 0.

Example:
    >>> tokens_diag([5, 6, 7, 8], [6, 7, 9, 4])      # aligned run 6 7: 8 -> 9, then 4 is new
    (1, [4], [9])
    >>> tokens_diag([1, 2], [3])
    (None, None, None)
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np


def longest_diagonal(match: np.ndarray) -> tuple[int, int, int]:
    """(i, j, length) of the longest run of True along a diagonal of `match` [N, P]; ties go
    to the run whose start comes first in row-major order (HF's choice). match.any() must hold.

    >>> longest_diagonal(np.array([[1, 0, 0], [0, 1, 0], [1, 0, 1]], bool))
    (0, 0, 3)
    """
    rows, cols = match.shape
    best = (0, 0, 0)
    for i, j in zip(*np.nonzero(match)):  # row-major order
        if i > 0 and j > 0 and match[i - 1, j - 1]:
            continue  # inside a run that started earlier
        length = 1
        while i + length < rows and j + length < cols and match[i + length, j + length]:
            length += 1
        if length > best[2]:
            best = (int(i), int(j), length)
    return best


def tokens_diag(prompt: Sequence[int], extended: Sequence[int]):
    """HF's `_get_tokens_diag`: align `extended` (a re-encoded suffix plus new tokens) with
    `prompt` (the ids it should continue). Returns (discrepancy_length, new_only,
    discrepancy_only): how many trailing prompt ids disagree, the tokens after the replaced
    ones, and the replacements; (None, None, None) when the two share no token."""
    a, b = np.asarray(prompt, np.int64), np.asarray(extended, np.int64)
    match = b[:, None] == a[None, :]  # [N, P]
    if not match.any():
        return None, None, None
    i, j, length = longest_diagonal(match)
    new_start = i + length
    discrepancy = len(a) - (j + length)
    return (discrepancy, b[new_start + discrepancy:].tolist(),
            b[new_start:new_start + discrepancy].tolist())


def _tail(ids: list, n: int) -> list:
    """ids[-n:] with Python's n == 0 quirk (the whole list), as HF slices."""
    return ids[-n:] if n else list(ids)


@dataclasses.dataclass
class GreedyRow:
    """One row's alignment state (HF's prev_assistant_ids / prev_target_ids_len)."""

    prev_assistant: Optional[list] = None  # assistant ids of the last round (input + drafts)
    prev_target_len: int = 0

    def target_window(self, target: Sequence[int], lookbehind: int) -> tuple[list, bool]:
        """(target ids to convert, whether they are the full sequence)."""
        if self.prev_assistant is not None and self.prev_target_len > lookbehind:
            return list(target[self.prev_target_len - lookbehind:]), False
        return list(target), True

    def assistant_input(self, target: Sequence[int], converted: list, full: bool) -> list:
        """Rule 1: the assistant ids to draft from, given the converted window."""
        if full:
            self.prev_target_len = len(target)
            ids = list(converted)
        else:
            prompt_use = _tail(self.prev_assistant, len(converted))
            discrepancy, new_only, replacement = tokens_diag(prompt_use, converted)
            ids = list(self.prev_assistant)
            if new_only is None:
                ids += converted
            else:
                if discrepancy > 0 and replacement:
                    if discrepancy == len(replacement):
                        ids[-discrepancy:] = replacement
                    elif discrepancy > len(replacement):
                        ids = ids[:-(discrepancy - len(replacement))]
                        ids[-len(replacement):] = replacement
                ids += new_only
        self.prev_assistant = ids
        return ids

    def assistant_window(self, drafts: Sequence[int], lookbehind: int) -> list:
        """The assistant ids (input + drafts) whose text rule 3 converts."""
        start = max(len(self.prev_assistant) - lookbehind, 0)
        return (list(self.prev_assistant) + list(drafts))[start:]

    def target_drafts(self, target: Sequence[int], drafts: Sequence[int],
                      converted: list) -> list:
        """Rule 3: the target drafts; records the round (input + drafts, target length)."""
        _, new_only, _ = tokens_diag(_tail(list(target), len(converted)), converted)
        self.prev_assistant = list(self.prev_assistant) + list(drafts)
        self.prev_target_len = len(target)
        return list(converted) if new_only is None else new_only


@dataclasses.dataclass
class SampleRow:
    """One row's state for sampling across vocabularies (HF's _prev_assistant_ids and
    _target_seq_len_with_candidates)."""

    prev_assistant: Optional[list] = None
    target_len_with_drafts: int = 0

    def new_target(self, target: Sequence[int]) -> list:
        """The target ids the assistant has not seen: all of them first, then the last one."""
        return list(target) if self.prev_assistant is None else list(target[-1:])

    def assistant_input(self, target: Sequence[int], new_ids: list) -> list:
        """Drops the rejected drafts and appends the new token's assistant ids."""
        if self.prev_assistant is None:
            return list(new_ids)
        remove = self.target_len_with_drafts + 1 - len(target)
        kept = self.prev_assistant[:-remove] if remove > 0 else list(self.prev_assistant)
        return kept + list(new_ids)

    def record(self, assistant_input: list, drafts: Sequence[int], target_len: int) -> None:
        self.prev_assistant = list(assistant_input) + list(drafts)
        self.target_len_with_drafts = target_len + len(drafts)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix.

    >>> common_prefix([1, 2, 3], [1, 2, 4, 5])
    2
    """
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x, y = np.asarray(a[:n]), np.asarray(b[:n])
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n


__all__ = ["GreedyRow", "SampleRow", "common_prefix", "longest_diagonal", "tokens_diag"]

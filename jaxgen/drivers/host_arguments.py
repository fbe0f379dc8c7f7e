"""The host-side arguments of a streamed call, checked before anything compiles.

    streamer     None, one streamer (batch 1, as Hugging Face) or a list with one per row: an
                 object with `put(token_ids)` and `end()` (transformers' BaseStreamer protocol,
                 e.g. jaxgen.drivers.streamers.TextStreamer); a streamer is one row's sink, so
                 the same object twice in the list is refused
    stop_event   None or an object with `is_set()` (a threading.Event)

A wrong type is a TypeError and a repeated streamer a ValueError, both naming the argument,
raised by `check_host_arguments` (jaxgen.api.plan.make_plan and the text / ids entry points)
rather than deep inside the chunked driver.

Example:
    >>> import threading
    >>> check_host_arguments(None, threading.Event())
    >>> check_host_arguments(None, True)
    Traceback (most recent call last):
    TypeError: `stop_event` must be an object with is_set() (e.g. a threading.Event), got bool
    >>> as_streamers(["a streamer"], 1)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    TypeError: `streamer[0]` must be a streamer, an object with put(token_ids) and end() ...
"""
from __future__ import annotations

STREAMER_PROTOCOL = ("an object with put(token_ids) and end() (as transformers' BaseStreamer, "
                     "e.g. jaxgen.drivers.streamers.TextStreamer)")


def _is_streamer(value) -> bool:
    return callable(getattr(value, "put", None)) and callable(getattr(value, "end", None))


def check_streamer(streamer) -> None:
    """TypeError unless `streamer` is None, a streamer or a list / tuple of streamers;
    ValueError when one streamer object appears twice in the list."""
    if streamer is None:
        return
    if not isinstance(streamer, (list, tuple)):
        if not _is_streamer(streamer):
            raise TypeError(f"`streamer` must be a streamer, {STREAMER_PROTOCOL}, or a list "
                            f"with one per row, got {type(streamer).__name__}")
        return
    first_row: dict[int, int] = {}  # id(streamer) -> the row it was first given for
    for row, each in enumerate(streamer):
        if not _is_streamer(each):
            raise TypeError(f"`streamer[{row}]` must be a streamer, {STREAMER_PROTOCOL}, got "
                            f"{type(each).__name__}")
        if id(each) in first_row:
            raise ValueError(f"`streamer`: the same streamer object is given for rows "
                             f"{first_row[id(each)]} and {row}; a streamer takes one row's "
                             f"tokens, so pass a separate streamer for every row")
        first_row[id(each)] = row


def check_stop_event(stop_event) -> None:
    """TypeError unless `stop_event` is None or has an is_set() method."""
    if stop_event is not None and not callable(getattr(stop_event, "is_set", None)):
        raise TypeError(f"`stop_event` must be an object with is_set() (e.g. a "
                        f"threading.Event), got {type(stop_event).__name__}")


def check_host_arguments(streamer, stop_event) -> None:
    """Both checks above (the row count is `as_streamers`', once the batch is known)."""
    check_streamer(streamer)
    check_stop_event(stop_event)


def as_streamers(streamer, batch: int) -> list | None:
    """None, one streamer (batch 1 only, as HF) or one per row -> a list of B streamers,
    checked (`check_streamer`)."""
    check_streamer(streamer)
    if streamer is None:
        return None
    if isinstance(streamer, (list, tuple)):
        if len(streamer) != batch:
            raise ValueError(f"`streamer`: got {len(streamer)} streamers for {batch} rows; pass "
                             f"one per row")
        return list(streamer)
    if batch != 1:
        raise ValueError(f"`streamer`: one streamer cannot take a batch of {batch} rows; pass a "
                         f"list with one streamer per row")
    return [streamer]


__all__ = ["STREAMER_PROTOCOL", "as_streamers", "check_host_arguments", "check_stop_event",
           "check_streamer"]

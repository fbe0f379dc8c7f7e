"""Streamers with Hugging Face's protocol: `put(token_ids)` then `end()`.

A jitted `while_loop` cannot call Python, so streaming is driven from the host: the chunked
driver (jaxgen.drivers.chunked) runs the decode body N steps per jit call and hands each row's new
tokens to its streamer between chunks. The first `put` of a stream receives the prompt.

Batches: one streamer per row (pass a list, one per row) — a streamer is a text sink for one
sequence, exactly HF's contract, so every existing consumer (a printer, an iterator on another
thread, an async iterator) works unchanged per row. A single streamer with a batch of more
than one row is an error, as in HF.

    BaseStreamer               the protocol (put / end), plus `fail(exc)`, `cancel()` /
                               `cancelled`
    TextStreamer               prints words as they complete (holds back partial words and
                               incomplete UTF-8), `skip_prompt`, decode kwargs
    TextIteratorStreamer       a queue for a consumer on another thread (`timeout`)
    AsyncTextIteratorStreamer  the same for asyncio (`async for`)

Cancelling: a consumer calls `streamer.cancel()` (or sets the `stop_event` it passed in);
the driver checks between chunks, so generation ends within one chunk.

Failing: when generation raises (a bad config found in `generate`, a processor that raises,
an error on the device), the producer calls `streamer.fail(exc)` instead of `end()`. An
iterator streamer's consumer then re-raises `exc` (the same exception object) instead of
waiting for text that will never come; the other streamers print what they hold, as `end()`.
`end()` and `fail()` are idempotent: once a stream is ended or failed, further calls are
no-ops until the next `put` starts a new stream. Every consumer ends: with the text, with
the producer's exception, or (with `timeout`) with its timeout.

Example (a tiny random model, so the text is noise; the stream equals the result):
    >>> import jaxgen
    >>> from jaxgen.models import TINY_VOCAB, tiny_llama, tiny_tokenizer
    >>> tok = tiny_tokenizer()
    >>> model, params = tiny_llama(vocab_size=TINY_VOCAB)
    >>> class Collect(TextStreamer):
    ...     def on_finalized_text(self, text, stream_end=False):
    ...         self.text = getattr(self, "text", "") + text
    >>> streamer = Collect(tok, skip_prompt=True)
    >>> [answer] = jaxgen.generate_text(model, params, tok, "the stop", streamer=streamer,
    ...                                 max_new_tokens=8)
    >>> streamer.text == answer
    True
"""
from __future__ import annotations

import asyncio
import queue
import threading
from typing import Any

import numpy as np


class BaseStreamer:
    """Receives token ids as they are generated. `put` gets an int array [n] (or [1, n])."""

    def __init__(self, stop_event: threading.Event | None = None):
        self._stop_event = stop_event if stop_event is not None else threading.Event()

    def put(self, value) -> None:
        raise NotImplementedError

    def end(self) -> None:
        raise NotImplementedError

    def fail(self, exc: BaseException) -> None:
        """Ends the stream because generation raised `exc` (default: `end()`).

        Streamers with a consumer on another thread override it so that the consumer raises
        `exc` instead of waiting forever.
        """
        _check_exception(exc)
        self.end()

    def cancel(self) -> None:
        """Asks the generation feeding this streamer to stop (honoured between chunks)."""
        self._stop_event.set()

    @property
    def cancelled(self) -> bool:
        return self._stop_event.is_set()


def _check_exception(exc) -> None:
    if not isinstance(exc, BaseException):
        raise TypeError(f"fail() takes the exception that ended generation, got "
                        f"{type(exc).__name__}")


class _Failed:
    """Queue item: the producer failed with `error` (re-raised by the consumer)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


def _as_ids(value) -> list[int]:
    array = np.asarray(value)
    if array.ndim > 1:
        if array.shape[0] > 1:
            raise ValueError("a streamer takes one sequence; for a batch pass one streamer per row")
        array = array[0]
    return [int(t) for t in array.reshape(-1)]


def _is_cjk(codepoint: int) -> bool:
    """CJK ideographs: printable one at a time (no spaces between words)."""
    return (0x4E00 <= codepoint <= 0x9FFF or 0x3400 <= codepoint <= 0x4DBF
            or 0x20000 <= codepoint <= 0x2A6DF or 0x2A700 <= codepoint <= 0x2B73F
            or 0x2B740 <= codepoint <= 0x2B81F or 0x2B820 <= codepoint <= 0x2CEAF
            or 0xF900 <= codepoint <= 0xFAFF or 0x2F800 <= codepoint <= 0x2FA1F)


class TextStreamer(BaseStreamer):
    """Decodes the token stream and emits text as words complete (HF's `TextStreamer`).

    Text is flushed at a newline, after a CJK character, or up to the last space; a trailing
    replacement character (an incomplete UTF-8 sequence) is never emitted before the end.
    `on_finalized_text` prints; subclasses override it. `fail(exc)` flushes what is held, like
    `end()`, and records the exception in `error`; `on_failed(text, exc)` is the hook.
    """

    def __init__(self, tokenizer, skip_prompt: bool = False, *,
                 stop_event: threading.Event | None = None, **decode_kwargs: Any):
        if tokenizer is None or not callable(getattr(tokenizer, "decode", None)):
            raise TypeError(f"{type(self).__name__} needs a tokenizer with a decode() method "
                            f"to turn token ids into text, got "
                            f"{'None' if tokenizer is None else type(tokenizer).__name__}")
        super().__init__(stop_event)
        self.tokenizer = tokenizer
        self.skip_prompt = skip_prompt
        self.decode_kwargs = decode_kwargs
        self.token_cache: list[int] = []
        self.print_len = 0
        self.next_tokens_are_prompt = True
        self.error: BaseException | None = None  # set by fail()
        self._closed = False  # ended or failed; the next put() opens a new stream
        self._close_lock = threading.Lock()

    def _close(self) -> bool:
        """Marks the stream closed; False when it already was (end / fail are idempotent)."""
        with self._close_lock:
            if self._closed:
                return False
            self._closed = True
            return True

    def _flush(self) -> str:
        if self.token_cache:
            text = self.tokenizer.decode(self.token_cache, **self.decode_kwargs)
            printable = text[self.print_len:]
        else:
            printable = ""
        self.token_cache, self.print_len = [], 0
        self.next_tokens_are_prompt = True
        return printable

    def put(self, value) -> None:
        ids = _as_ids(value)
        if self._closed:  # a new stream (the streamer is reused for another generation)
            with self._close_lock:
                self._closed = False
            self.error = None
        if self.skip_prompt and self.next_tokens_are_prompt:
            self.next_tokens_are_prompt = False
            return
        self.next_tokens_are_prompt = False
        self.token_cache.extend(ids)
        text = self.tokenizer.decode(self.token_cache, **self.decode_kwargs)
        if text.endswith("\n"):
            printable = text[self.print_len:]
            self.token_cache, self.print_len = [], 0
        elif text and _is_cjk(ord(text[-1])):
            printable = text[self.print_len:]
            self.print_len += len(printable)
        else:
            cut = text.rfind(" ") + 1
            partial = text.find("\ufffd", self.print_len)
            if partial != -1:
                cut = min(cut, partial)
            printable = text[self.print_len:max(cut, self.print_len)]
            self.print_len += len(printable)
        self.on_finalized_text(printable)

    def end(self) -> None:
        """Flushes the held-back text and ends the stream. A second call is a no-op."""
        if self._close():
            self.on_finalized_text(self._flush(), stream_end=True)

    def fail(self, exc: BaseException) -> None:
        """Ends the stream because generation raised `exc`. A no-op once ended or failed."""
        _check_exception(exc)
        if self._close():
            self.error = exc
            self.on_failed(self._flush(), exc)

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        print(text, flush=True, end="" if not stream_end else None)

    def on_failed(self, text: str, exc: BaseException) -> None:
        """Called once by `fail()` with the held-back text; default: as the end of a stream."""
        self.on_finalized_text(text, stream_end=True)


class TextIteratorStreamer(TextStreamer):
    """Text chunks through a queue: run generation on a worker thread, iterate on this one.

    `timeout` (seconds) bounds each wait; a wait that times out raises `queue.Empty`.
    When generation fails the producer calls `fail(exc)`: the consumer gets the text produced
    so far, then `exc` is raised from the iteration.

    Example:
        >>> import jaxgen
        >>> from jaxgen.models import TINY_VOCAB, tiny_llama, tiny_tokenizer
        >>> tok = tiny_tokenizer()
        >>> model, params = tiny_llama(vocab_size=TINY_VOCAB)
        >>> streamer = TextIteratorStreamer(tok, skip_prompt=True, timeout=60)
        >>> result = []
        >>> worker = threading.Thread(target=lambda: result.extend(jaxgen.generate_text(
        ...     model, params, tok, "the stop", streamer=streamer, max_new_tokens=8)))
        >>> worker.start()
        >>> text = "".join(streamer)   # raises what generate_text raised, if it did
        >>> worker.join(); text == result[0]
        True
    """

    def __init__(self, tokenizer, skip_prompt: bool = False, timeout: float | None = None, *,
                 stop_event: threading.Event | None = None, **decode_kwargs: Any):
        super().__init__(tokenizer, skip_prompt, stop_event=stop_event, **decode_kwargs)
        self.text_queue: queue.Queue = queue.Queue()
        self.stop_signal = None
        self.timeout = timeout

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        self.text_queue.put(text, timeout=self.timeout)
        if stream_end:
            self.text_queue.put(self.stop_signal, timeout=self.timeout)

    def on_failed(self, text: str, exc: BaseException) -> None:
        if text:
            self.text_queue.put(text)
        self.text_queue.put(_Failed(exc))

    def __iter__(self):
        return self

    def __next__(self) -> str:
        value = self.text_queue.get(timeout=self.timeout)
        if value is self.stop_signal:
            raise StopIteration()
        if isinstance(value, _Failed):
            raise value.error
        return value


class AsyncTextIteratorStreamer(TextStreamer):
    """Text chunks for asyncio: `async for text in streamer` inside the event loop.

    Create it inside a running event loop; generation runs in a thread (e.g.
    `loop.run_in_executor`). A wait longer than `timeout` raises `TimeoutError`. After
    `fail(exc)` (from any thread) the `async for` raises `exc`.
    """

    def __init__(self, tokenizer, skip_prompt: bool = False, timeout: float | None = None, *,
                 stop_event: threading.Event | None = None, **decode_kwargs: Any):
        super().__init__(tokenizer, skip_prompt, stop_event=stop_event, **decode_kwargs)
        self.text_queue: asyncio.Queue = asyncio.Queue()
        self.stop_signal = None
        self.timeout = timeout
        self.loop = asyncio.get_running_loop()

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        self.loop.call_soon_threadsafe(self.text_queue.put_nowait, text)
        if stream_end:
            self.loop.call_soon_threadsafe(self.text_queue.put_nowait, self.stop_signal)

    def on_failed(self, text: str, exc: BaseException) -> None:
        try:
            if text:
                self.loop.call_soon_threadsafe(self.text_queue.put_nowait, text)
            self.loop.call_soon_threadsafe(self.text_queue.put_nowait, _Failed(exc))
        except RuntimeError:  # the event loop is closed: no consumer is left to wake
            pass

    def __aiter__(self):
        return self

    async def __anext__(self) -> str:
        try:
            value = await asyncio.wait_for(self.text_queue.get(), self.timeout)
        except asyncio.TimeoutError:
            raise TimeoutError() from None
        if value is self.stop_signal:
            raise StopAsyncIteration()
        if isinstance(value, _Failed):
            raise value.error
        return value

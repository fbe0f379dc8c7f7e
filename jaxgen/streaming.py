"""Streamers with Hugging Face's protocol: `put(token_ids)` then `end()`.

A jitted `while_loop` cannot call Python, so streaming is driven from the host: the chunked
driver (jaxgen.chunked) runs the decode body N steps per jit call and hands each row's new
tokens to its streamer between chunks. The first `put` of a stream receives the prompt.

Batches: one streamer per row (pass a list, one per row) — a streamer is a text sink for one
sequence, exactly HF's contract, so every existing consumer (a printer, an iterator on another
thread, an async iterator) works unchanged per row. A single streamer with a batch of more
than one row is an error, as in HF.

    BaseStreamer               the protocol (put / end), plus `cancel()` / `cancelled`
    TextStreamer               prints words as they complete (holds back partial words and
                               incomplete UTF-8), `skip_prompt`, decode kwargs
    TextIteratorStreamer       a queue for a consumer on another thread (`timeout`)
    AsyncTextIteratorStreamer  the same for asyncio (`async for`)

Cancelling: a consumer calls `streamer.cancel()` (or sets the `stop_event` it passed in);
the driver checks between chunks, so generation ends within one chunk.

Example:
    >>> streamer = TextStreamer(tokenizer, skip_prompt=True)
    >>> jaxgen.generate_text(model, params, tokenizer, "Hi", chat=True, streamer=streamer)
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

    def cancel(self) -> None:
        """Asks the generation feeding this streamer to stop (honoured between chunks)."""
        self._stop_event.set()

    @property
    def cancelled(self) -> bool:
        return self._stop_event.is_set()


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
    `on_finalized_text` prints; subclasses override it.
    """

    def __init__(self, tokenizer, skip_prompt: bool = False, *,
                 stop_event: threading.Event | None = None, **decode_kwargs: Any):
        super().__init__(stop_event)
        self.tokenizer = tokenizer
        self.skip_prompt = skip_prompt
        self.decode_kwargs = decode_kwargs
        self.token_cache: list[int] = []
        self.print_len = 0
        self.next_tokens_are_prompt = True

    def put(self, value) -> None:
        ids = _as_ids(value)
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
        if self.token_cache:
            text = self.tokenizer.decode(self.token_cache, **self.decode_kwargs)
            printable = text[self.print_len:]
        else:
            printable = ""
        self.token_cache, self.print_len = [], 0
        self.next_tokens_are_prompt = True
        self.on_finalized_text(printable, stream_end=True)

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        print(text, flush=True, end="" if not stream_end else None)


class TextIteratorStreamer(TextStreamer):
    """Text chunks through a queue: run generation on a worker thread, iterate on this one.

    `timeout` (seconds) bounds each wait; a wait that times out raises `queue.Empty`.

    Example:
        >>> streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, timeout=60)
        >>> threading.Thread(target=jaxgen.generate_text, args=(model, params, tokenizer, "Hi"),
        ...                  kwargs=dict(streamer=streamer)).start()
        >>> text = "".join(streamer)
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

    def __iter__(self):
        return self

    def __next__(self) -> str:
        value = self.text_queue.get(timeout=self.timeout)
        if value is self.stop_signal:
            raise StopIteration()
        return value


class AsyncTextIteratorStreamer(TextStreamer):
    """Text chunks for asyncio: `async for text in streamer` inside the event loop.

    Create it inside a running event loop; generation runs in a thread (e.g.
    `loop.run_in_executor`). A wait longer than `timeout` raises `TimeoutError`.
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

    def __aiter__(self):
        return self

    async def __anext__(self) -> str:
        try:
            value = await asyncio.wait_for(self.text_queue.get(), self.timeout)
        except asyncio.TimeoutError:
            raise TimeoutError() from None
        if value is self.stop_signal:
            raise StopAsyncIteration()
        return value

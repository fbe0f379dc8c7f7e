"""Streamers: the text they emit, against transformers' TextStreamer on the same token ids."""
from __future__ import annotations

import asyncio
import contextlib
import io
import queue
import threading

import numpy as np
import pytest
from streamer_threads import consume_on_a_thread

from jaxgen.drivers.streamers import (
    AsyncTextIteratorStreamer,
    TextIteratorStreamer,
    TextStreamer,
)
from jaxgen.models import DEFAULT_MODEL, load

TEXTS = [
    "The quick brown fox jumps over the lazy dog.\nSecond line here.",
    "東京は日本の首都です。富士山はとても高い山です。",
    "Emoji time: 🎉🚀 and a family 👨‍👩‍👧 with skin tone 👍🏽 done.",
    "Accents: crème brûlée, naïve façade, Ångström, São Paulo, Dvořák.",
    "Numbers 12345 and code `x = [1, 2, 3]` plus tabs\tand  double  spaces.",
    "Ελληνικά και русский текст, 한국어 문장, עברית.",
]


def printed(streamer_cls, tokenizer, ids, **kwargs) -> str:
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        streamer = streamer_cls(tokenizer, **kwargs)
        streamer.put(np.array([ids[:1]]))  # the prompt
        for token in ids[1:]:
            streamer.put(np.array([token]))
        streamer.end()
    return buffer.getvalue()


@pytest.fixture(scope="module")
def tokenizers_pair():
    from transformers import PreTrainedTokenizerFast

    _, _, tokenizer = load(DEFAULT_MODEL)
    return tokenizer, PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip_prompt", [False, True])
def test_text_streamer_prints_what_transformers_prints(tokenizers_pair, text, skip_prompt):
    from transformers import TextStreamer as HFTextStreamer

    ours_tok, hf_tok = tokenizers_pair
    ids = ours_tok.encode(text)
    ours = printed(TextStreamer, ours_tok, ids, skip_prompt=skip_prompt)
    theirs = printed(HFTextStreamer, hf_tok, ids, skip_prompt=skip_prompt)
    assert ours == theirs
    start = 1 if skip_prompt else 0
    assert ours == ours_tok.decode(ids[start:]) + "\n"


def test_partial_utf8_is_held_back(tokenizers_pair):
    ours_tok, _ = tokenizers_pair
    ids = ours_tok.encode("a 🚀 b")
    chunks = []

    class Capture(TextStreamer):
        def on_finalized_text(self, text, stream_end=False):
            chunks.append(text)

    streamer = Capture(ours_tok)
    for token in ids:
        streamer.put([token])
        assert "\ufffd" not in "".join(chunks)
    streamer.end()
    assert "".join(chunks) == "a 🚀 b"


def test_skip_special_tokens_is_passed_to_decode(tokenizers_pair):
    ours_tok, _ = tokenizers_pair
    ids = ours_tok.encode("<|im_start|>user\nhello there<|im_end|>")
    out = printed(TextStreamer, ours_tok, ids, skip_special_tokens=True)
    assert "<|im_start|>" not in out and "hello there" in out


def test_iterator_streamer_from_another_thread(tokenizers_pair):
    ours_tok, _ = tokenizers_pair
    ids = ours_tok.encode(TEXTS[0])
    streamer = TextIteratorStreamer(ours_tok, timeout=10)

    def produce():
        for token in ids:
            streamer.put([token])
        streamer.end()

    worker = threading.Thread(target=produce)
    worker.start()
    text = "".join(streamer)
    worker.join()
    assert text == ours_tok.decode(ids)


class CharTokenizer:
    """Token id i is chr(i): enough to decode in the streamer tests without a model."""

    @staticmethod
    def decode(ids, **_):
        return "".join(chr(i) for i in ids)


def test_iterator_streamer_times_out():
    streamer = TextIteratorStreamer(CharTokenizer(), timeout=0.05)
    with pytest.raises(queue.Empty):
        next(streamer)


def test_async_streamer_inside_an_event_loop(tokenizers_pair):
    ours_tok, _ = tokenizers_pair
    ids = ours_tok.encode(TEXTS[2])

    async def consume():
        streamer = AsyncTextIteratorStreamer(ours_tok, timeout=10)

        def produce():
            for token in ids:
                streamer.put([token])
            streamer.end()

        loop = asyncio.get_running_loop()
        producer = loop.run_in_executor(None, produce)
        parts = [part async for part in streamer]
        await producer
        return "".join(parts)

    assert asyncio.run(consume()) == ours_tok.decode(ids)


def test_async_streamer_times_out():
    async def wait():
        streamer = AsyncTextIteratorStreamer(CharTokenizer(), timeout=0.05)
        with pytest.raises(TimeoutError):
            await streamer.__anext__()

    asyncio.run(wait())


def test_batch_into_one_streamer_is_an_error(tokenizers_pair):
    ours_tok, _ = tokenizers_pair
    with pytest.raises(ValueError, match="one streamer per row"):
        TextStreamer(ours_tok).put([[1, 2], [3, 4]])


def test_cancel_sets_the_flag(tokenizers_pair):
    event = threading.Event()
    streamer = TextStreamer(tokenizers_pair[0], stop_event=event)
    assert not streamer.cancelled
    event.set()
    assert streamer.cancelled


@pytest.mark.parametrize("cls", [TextStreamer, TextIteratorStreamer])
def test_a_text_streamer_needs_a_tokenizer(cls):
    with pytest.raises(TypeError, match="needs a tokenizer"):
        cls(None)
    with pytest.raises(TypeError, match="needs a tokenizer"):
        cls(object())


def test_async_streamer_needs_a_tokenizer():
    async def build():
        with pytest.raises(TypeError, match="needs a tokenizer"):
            AsyncTextIteratorStreamer(None)

    asyncio.run(build())


def test_fail_wakes_a_consumer_waiting_without_timeout():
    streamer = TextIteratorStreamer(CharTokenizer())  # no timeout: waits forever without fail
    thread, result = consume_on_a_thread(streamer)
    streamer.put([ord("p")])  # the prompt
    for char in "hello wor":
        streamer.put([ord(char)])
    error = RuntimeError("device lost")
    threading.Timer(0.1, streamer.fail, args=(error,)).start()  # from another thread
    thread.join(timeout=30)
    assert not thread.is_alive(), "the consumer still waits after fail()"
    assert result["error"] is error
    assert "".join(result["parts"]) == "phello wor"  # the held-back word is delivered first


def test_fail_before_any_token_wakes_the_consumer():
    streamer = TextIteratorStreamer(CharTokenizer())
    thread, result = consume_on_a_thread(streamer)
    streamer.fail(ValueError("bad config"))
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert isinstance(result["error"], ValueError) and result["parts"] == []


def test_end_and_fail_are_idempotent():
    streamer = TextIteratorStreamer(CharTokenizer(), timeout=5)
    streamer.put([ord("a")])
    streamer.end()
    streamer.end()
    streamer.fail(RuntimeError("late"))
    assert "".join(streamer) == "a"
    assert streamer.text_queue.empty()  # one stop signal, no failure queued after end()
    assert streamer.error is None

    failed = TextIteratorStreamer(CharTokenizer(), timeout=5)
    first = RuntimeError("first")
    failed.fail(first)
    failed.fail(RuntimeError("second"))
    failed.end()
    with pytest.raises(RuntimeError, match="first"):
        next(failed)
    assert failed.text_queue.empty() and failed.error is first


def test_a_put_after_end_starts_a_new_stream():
    streamer = TextIteratorStreamer(CharTokenizer(), timeout=5)
    for text in ("ab", "cd"):
        for char in text:
            streamer.put([ord(char)])
        streamer.end()
        assert "".join(streamer) == text


def test_fail_takes_an_exception():
    with pytest.raises(TypeError, match="exception"):
        TextIteratorStreamer(CharTokenizer()).fail("oops")


def test_text_streamer_fail_prints_what_it_holds_and_ends_the_line(capsys):
    streamer = TextStreamer(CharTokenizer())
    for char in "hi the":
        streamer.put([ord(char)])
    streamer.fail(RuntimeError("x"))
    streamer.end()  # no-op
    assert capsys.readouterr().out == "hi the\n"
    assert isinstance(streamer.error, RuntimeError)


def test_base_streamer_fail_defaults_to_end():
    from jaxgen.drivers.streamers import BaseStreamer

    class Recorder(BaseStreamer):
        ended = 0

        def put(self, value):
            pass

        def end(self):
            self.ended += 1

    recorder = Recorder()
    recorder.fail(RuntimeError("x"))
    assert recorder.ended == 1


def test_async_fail_wakes_the_consumer():
    async def run():
        streamer = AsyncTextIteratorStreamer(CharTokenizer())  # no timeout
        loop = asyncio.get_running_loop()

        def produce():
            streamer.put([ord("a")])
            streamer.put([ord(" ")])
            streamer.fail(KeyError("gone"))

        parts = []
        with pytest.raises(KeyError, match="gone"):
            await asyncio.wait_for(_collect(streamer, parts, loop.run_in_executor(None, produce)),
                                   timeout=30)
        return parts

    assert "".join(asyncio.run(run())) == "a "


async def _collect(streamer, parts, producer):
    await producer
    async for part in streamer:
        parts.append(part)

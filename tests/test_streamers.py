"""Streamers: the text they emit, against transformers' TextStreamer on the same token ids."""
from __future__ import annotations

import asyncio
import contextlib
import io
import queue
import threading

import numpy as np
import pytest

from jaxgen.streaming import AsyncTextIteratorStreamer, TextIteratorStreamer, TextStreamer
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


def test_iterator_streamer_times_out():
    streamer = TextIteratorStreamer(tokenizer=None, timeout=0.05)
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
        streamer = AsyncTextIteratorStreamer(tokenizer=None, timeout=0.05)
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

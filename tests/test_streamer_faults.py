"""No consumer waits forever: when generation fails, every row's streamer is ended.

The contract (jaxgen.generate / generate_ids / generate_text and the chunked driver): on every
exit path each streamer gets `end()` (success) or `fail(exc)` (generation raised), so an
iterator streamer's consumer, waiting on another thread with no timeout, raises the
producer's exception instead of hanging. Each consumer runs on a daemon thread joined with a
timeout; a consumer still alive afterwards is the bug these tests catch.
"""
from __future__ import annotations

import asyncio
import threading

import jax
import jax.numpy as jnp
import pytest
from streamer_threads import consume_on_a_thread
from stubs import BigramStub, LetterTokenizer, random_table

import jaxgen
from jaxgen.drivers.streamers import AsyncTextIteratorStreamer, TextIteratorStreamer

VOCAB = 16
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
JOIN_S = 60


def consumers(streamers):
    """One consumer thread per streamer; returns (threads, results)."""
    pairs = [consume_on_a_thread(streamer) for streamer in streamers]
    return [thread for thread, _ in pairs], [result for _, result in pairs]


def assert_all_failed_with(threads, results, error_type, match: str = ""):
    for thread in threads:
        thread.join(timeout=JOIN_S)
    alive = [i for i, t in enumerate(threads) if t.is_alive()]
    assert not alive, f"consumers of rows {alive} still wait after generate raised"
    for row, result in enumerate(results):
        assert "error" in result, f"row {row} ended without the producer's error: {result}"
        assert isinstance(result["error"], error_type), (row, result["error"])
        assert match in str(result["error"]), (row, result["error"])


@pytest.fixture(scope="module")
def stub():
    return BigramStub(VOCAB), random_table(VOCAB, seed=3)


def streamers_for(rows):
    return [TextIteratorStreamer(LetterTokenizer()) for _ in rows]  # no timeout


def test_stop_strings_without_tokenizer_end_every_row(stub):
    model, params = stub
    cfg = jaxgen.GenerationConfig(max_new_tokens=6)
    state = jaxgen.init_state(model, PROMPTS, cfg, jax.random.key(0))  # no stop tables
    streamers = streamers_for(PROMPTS)
    threads, results = consumers(streamers)
    with pytest.raises(ValueError, match="stop_strings") as raised:
        jaxgen.generate(params, state, cfg.replace(stop_strings=["ab"]), streamer=streamers)
    assert_all_failed_with(threads, results, ValueError, "stop_strings")
    assert all(r["error"] is raised.value for r in results)


def test_max_time_with_beam_search_ends_every_row(stub):
    model, params = stub
    cfg = jaxgen.GenerationConfig(max_new_tokens=6, num_beams=2, max_time=5.0)
    state = jaxgen.init_state(model, PROMPTS, cfg, jax.random.key(0))
    streamers = streamers_for(PROMPTS)
    threads, results = consumers(streamers)
    with pytest.raises(ValueError):
        jaxgen.generate(params, state, cfg, streamer=streamers)
    assert_all_failed_with(threads, results, ValueError)


class ProcessorError(RuntimeError):
    pass


def raising_processor(scores, ctx):
    raise ProcessorError("the processor broke")


def test_a_raising_logits_processor_ends_every_row(stub):
    model, params = stub
    cfg = jaxgen.GenerationConfig(max_new_tokens=6)
    state = jaxgen.init_state(model, PROMPTS, cfg, jax.random.key(0))
    streamers = streamers_for(PROMPTS)
    threads, results = consumers(streamers)
    with pytest.raises(ProcessorError):
        jaxgen.generate(params, state, cfg, streamer=streamers,
                        logits_processor=[raising_processor])
    assert_all_failed_with(threads, results, ProcessorError, "the processor broke")


def test_a_failing_row_streamer_does_not_strand_the_others(stub):
    model, params = stub

    class Broken(TextIteratorStreamer):
        def put(self, value):
            if getattr(self, "seen", 0) >= 2:  # the prompt, one token, then it breaks
                raise OSError("the socket of row 0 closed")
            self.seen = getattr(self, "seen", 0) + 1
            super().put(value)

    cfg = jaxgen.GenerationConfig(max_new_tokens=12)
    state = jaxgen.init_state(model, PROMPTS, cfg, jax.random.key(0))
    streamers = [Broken(LetterTokenizer())] + streamers_for(PROMPTS[1:])
    threads, results = consumers(streamers)
    with pytest.raises(OSError, match="row 0"):
        jaxgen.generate(params, state, cfg, streamer=streamers, chunk_size=2)
    assert_all_failed_with(threads, results, OSError, "row 0")


def test_generate_ids_ends_streamers_when_the_config_is_invalid(stub):
    model, params = stub
    streamers = streamers_for(PROMPTS)
    threads, results = consumers(streamers)
    with pytest.raises(ValueError):
        jaxgen.generate_ids(model, params, PROMPTS, max_new_tokens=4, do_sample=True,
                            temperature=-1.0, streamer=streamers)
    assert_all_failed_with(threads, results, ValueError)


def test_generate_text_ends_streamers_when_the_config_is_invalid(stub):
    model, params = stub
    streamers = streamers_for(PROMPTS)
    threads, results = consumers(streamers)
    with pytest.raises(ValueError):
        jaxgen.generate_text(model, params, LetterTokenizer(), ["bcd", "ef", "ghij"],
                             max_new_tokens=4, do_sample=True, temperature=-1.0,
                             streamer=streamers)
    assert_all_failed_with(threads, results, ValueError)


def test_generate_text_ends_streamers_when_a_processor_raises(stub):
    model, params = stub
    streamers = streamers_for(PROMPTS)
    threads, results = consumers(streamers)
    with pytest.raises(ProcessorError):
        jaxgen.generate_text(model, params, LetterTokenizer(), ["bcd", "ef", "ghij"],
                             max_new_tokens=4, streamer=streamers,
                             logits_processor=[raising_processor])
    assert_all_failed_with(threads, results, ProcessorError)


def test_success_still_ends_every_row(stub):
    model, params = stub
    streamers = streamers_for(PROMPTS)
    threads, results = consumers(streamers)
    rows = jaxgen.generate_ids(model, params, PROMPTS, max_new_tokens=5, streamer=streamers)
    for thread in threads:
        thread.join(timeout=JOIN_S)
    assert not any(t.is_alive() for t in threads)
    for row, result in zip(rows, results):
        assert result.get("ended") and "".join(result["parts"]) == LetterTokenizer.decode(row)


def test_async_consumer_raises_the_producer_error(stub):
    model, params = stub
    cfg = jaxgen.GenerationConfig(max_new_tokens=6)

    async def run():
        streamer = AsyncTextIteratorStreamer(LetterTokenizer())  # no timeout
        state = jaxgen.init_state(model, [PROMPTS[0]], cfg, jax.random.key(0))
        loop = asyncio.get_running_loop()
        producer = loop.run_in_executor(None, lambda: jaxgen.generate(
            params, state, cfg, streamer=streamer, logits_processor=[raising_processor]))

        async def consume():
            return [part async for part in streamer]

        with pytest.raises(ProcessorError):
            await asyncio.wait_for(consume(), timeout=JOIN_S)
        with pytest.raises(ProcessorError):
            await producer

    asyncio.run(run())


def test_a_cancelled_generation_ends_the_streamers(stub):
    """Cancelling is a success path: every consumer ends normally (no error)."""
    model, params = stub
    event = threading.Event()
    event.set()
    streamers = [TextIteratorStreamer(LetterTokenizer(), stop_event=event) for _ in PROMPTS]
    threads, results = consumers(streamers)
    out = jaxgen.generate(params, jaxgen.init_state(model, PROMPTS,
                                                    jaxgen.GenerationConfig(max_new_tokens=20),
                                                    jax.random.key(0)),
                          jaxgen.GenerationConfig(max_new_tokens=20), streamer=streamers)
    for thread in threads:
        thread.join(timeout=JOIN_S)
    assert not any(t.is_alive() for t in threads)
    assert all(r.get("ended") for r in results)
    assert (jnp.asarray(out.stop_reason) == jaxgen.stopping.CANCELLED).all()

"""The chunked driver: identical tokens, streaming, cancellation and max_time."""
from __future__ import annotations

import asyncio
import threading
import time

import jax
import numpy as np
import pytest
from stubs import BigramStub, random_table

import jaxgen
from jaxgen import stopping
from jaxgen.drivers.chunked import ChunkTimings
from jaxgen.drivers.streamers import (
    AsyncTextIteratorStreamer,
    BaseStreamer,
    TextIteratorStreamer,
    TextStreamer,
)
from jaxgen.models import DEFAULT_MODEL, load

QUESTIONS = ["What is the capital of France?", "Translate 'good morning' into Japanese.",
             "Write one sentence with an emoji in it.", "Say 'crème brûlée' three times."]


@pytest.fixture(scope="module")
def smollm2():
    return load(DEFAULT_MODEL)


class Collect(BaseStreamer):
    def __init__(self):
        super().__init__()
        self.puts, self.ended = [], False

    def put(self, value):
        self.puts.append(np.asarray(value).reshape(-1).tolist())

    def end(self):
        self.ended = True


@pytest.mark.parametrize("do_sample", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 3, 16])
def test_chunked_equals_single_call_on_stub(do_sample, chunk_size):
    model, params = BigramStub(8), random_table(8, seed=4)
    cfg = jaxgen.GenerationConfig(max_new_tokens=12, eos_token_id=5, do_sample=do_sample,
                                  top_k=0, output_scores=True)
    prompts = [[1, 2], [4], [3, 3, 3]]
    single = jaxgen.generate(params, jaxgen.init_state(model, prompts, cfg, jax.random.key(1)), cfg)
    streamers = [Collect() for _ in prompts]
    chunked = jaxgen.generate(params, jaxgen.init_state(model, prompts, cfg, jax.random.key(1)),
                              cfg, streamer=streamers, chunk_size=chunk_size)
    for name in ("sequences", "lengths", "stop_reason", "token_logprobs", "scores"):
        np.testing.assert_array_equal(np.asarray(getattr(single, name)),
                                      np.asarray(getattr(chunked, name)), err_msg=name)
    for b, streamer in enumerate(streamers):
        assert streamer.ended
        assert streamer.puts[0] == prompts[b]  # the prompt first, then one token per put
        assert all(len(p) == 1 for p in streamer.puts[1:])
        streamed = sum(streamer.puts, [])
        assert streamed == np.asarray(single.sequences)[b, :int(single.lengths[b])].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("do_sample", [False, True])
def test_smollm2_chunked_tokens_and_streamed_text(smollm2, do_sample):
    model, params, tokenizer = smollm2
    cfg = jaxgen.default_config(model, max_new_tokens=40, do_sample=do_sample, temperature=0.8)
    for question in QUESTIONS[:2] if do_sample else QUESTIONS:
        row = tokenizer.apply_chat_template([{"role": "user", "content": question}])
        single = jaxgen.generate_ids(model, params, [row], cfg, key=jax.random.key(2))[0]
        pieces = []

        class Capture(TextStreamer):
            def on_finalized_text(self, text, stream_end=False):
                pieces.append(text)

        chunked = jaxgen.generate_ids(model, params, [row], cfg, key=jax.random.key(2),
                                      streamer=Capture(tokenizer, skip_prompt=True))[0]
        assert chunked == single
        assert "".join(pieces) == tokenizer.decode(single[len(row):])


def test_iterator_streamer_on_a_worker_thread_and_early_stop(smollm2):
    model, params, tokenizer = smollm2
    row = tokenizer.apply_chat_template([{"role": "user", "content": "Count from 1 to 200."}])
    cfg = jaxgen.default_config(model, max_new_tokens=200)
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, timeout=120)
    result = {}

    def work():
        state = jaxgen.init_state(model, [row], cfg)
        result["out"] = jaxgen.generate(params, state, cfg, streamer=streamer, chunk_size=4)

    worker = threading.Thread(target=work)
    worker.start()
    received = ""
    for text in streamer:
        received += text
        if len(received) > 20:
            seen = len(tokenizer.encode(received))
            streamer.cancel()
            break
    worker.join(timeout=300)
    out = result["out"]
    new_tokens = int(out.lengths[0] - out.prompt_lengths[0])
    assert int(out.stop_reason[0]) == stopping.CANCELLED
    # The consumer stopped after `seen` tokens; at most one more chunk (4 steps) was decoded
    # after the chunk it was reading, plus tokens held back as a partial word.
    assert new_tokens <= seen + 2 * 4 + 4
    assert new_tokens < 200


@pytest.mark.slow
def test_async_streamer_inside_an_event_loop(smollm2):
    model, params, tokenizer = smollm2
    row = tokenizer.apply_chat_template([{"role": "user", "content": "Name two colors."}])
    cfg = jaxgen.default_config(model, max_new_tokens=24)
    expected = jaxgen.generate_ids(model, params, [row], cfg)[0]

    async def consume():
        streamer = AsyncTextIteratorStreamer(tokenizer, skip_prompt=True, timeout=120)
        loop = asyncio.get_running_loop()
        job = loop.run_in_executor(None, lambda: jaxgen.generate_ids(
            model, params, [row], cfg, streamer=streamer))
        parts = [part async for part in streamer]
        return "".join(parts), await job

    text, ids = asyncio.run(consume())
    assert ids[0] == expected
    assert text == tokenizer.decode(expected[len(row):])


def test_stop_event_cancels_between_chunks():
    model, params = BigramStub(8), random_table(8, seed=4)
    cfg = jaxgen.GenerationConfig(max_new_tokens=30)
    event = threading.Event()
    event.set()
    out = jaxgen.generate(params, jaxgen.init_state(model, [[1]], cfg), cfg, stop_event=event)
    assert int(out.lengths[0]) == 2  # the first chunk (prefill + one token) only
    assert int(out.stop_reason[0]) == stopping.CANCELLED


@pytest.mark.slow
def test_max_time_stops_within_one_chunk(smollm2):
    model, params, tokenizer = smollm2
    row = tokenizer.apply_chat_template([{"role": "user", "content": "Tell a long story."}])
    cfg = jaxgen.default_config(model, max_new_tokens=512, min_new_tokens=512)
    warm = cfg.replace(max_time=1e-3)  # compiles both chunk programs
    jaxgen.generate(params, jaxgen.init_state(model, [row], warm), warm, chunk_size=8)
    timings = ChunkTimings()
    limit = 1.5
    timed = cfg.replace(max_time=limit)
    start = time.perf_counter()
    out = jaxgen.generate(params, jaxgen.init_state(model, [row], timed), timed, chunk_size=8,
                          timings=timings)
    elapsed = time.perf_counter() - start
    assert int(out.stop_reason[0]) == stopping.MAX_TIME
    assert int(out.lengths[0] - out.prompt_lengths[0]) < 512
    longest_chunk = max(timings.chunk_s) if timings.chunk_s else 0.0
    assert elapsed >= limit
    assert elapsed - limit <= longest_chunk + 0.25, (elapsed, timings.chunk_s)


def test_streaming_errors_are_clear():
    model, params = BigramStub(8), random_table(8)
    cfg = jaxgen.GenerationConfig(max_new_tokens=3)
    with pytest.raises(ValueError, match="one streamer per row"):
        jaxgen.generate(params, jaxgen.init_state(model, [[1], [2]], cfg), cfg,
                        streamer=Collect())
    with pytest.raises(ValueError, match="one per row"):
        jaxgen.generate(params, jaxgen.init_state(model, [[1], [2]], cfg), cfg,
                        streamer=[Collect()])
    with pytest.raises(ValueError, match="max_time"):
        jaxgen.GenerationConfig(max_time=0)
    with pytest.raises(ValueError, match="chunk_size"):
        jaxgen.generate(params, jaxgen.init_state(model, [[1]], cfg), cfg, streamer=Collect(),
                        chunk_size=0)


@pytest.mark.parametrize("do_sample,assistant", [
    (False, "prompt_lookup"), (True, "prompt_lookup"), (False, "draft_model"),
    pytest.param(True, "draft_model", marks=pytest.mark.slow)])
def test_assisted_chunked_equals_single_call(do_sample, assistant):
    model, params = BigramStub(8), random_table(8, seed=6)
    fields = dict(max_new_tokens=16, eos_token_id=5, do_sample=do_sample, top_k=0)
    kwargs = {}
    if assistant == "prompt_lookup":
        fields["prompt_lookup_num_tokens"] = 3
    else:
        fields["num_assistant_tokens"] = 3
        kwargs["assistant_model"] = (model, random_table(8, seed=7))
    cfg = jaxgen.GenerationConfig(**fields)
    prompts = [[1, 2, 1, 2, 1, 2, 3], [4, 4, 4], [6]]
    single = jaxgen.generate(params, jaxgen.init_state(model, prompts, cfg, jax.random.key(3)),
                             cfg, **kwargs)
    streamers = [Collect() for _ in prompts]
    chunked = jaxgen.generate(params, jaxgen.init_state(model, prompts, cfg, jax.random.key(3)),
                              cfg, streamer=streamers, chunk_size=2, **kwargs)
    np.testing.assert_array_equal(np.asarray(single.sequences), np.asarray(chunked.sequences))
    np.testing.assert_array_equal(np.asarray(single.lengths), np.asarray(chunked.lengths))
    assert int(single.speculative.target_forwards) == int(chunked.speculative.target_forwards)
    for b, streamer in enumerate(streamers):
        streamed = sum(streamer.puts, [])
        assert streamed == np.asarray(single.sequences)[b, :int(single.lengths[b])].tolist()


@pytest.mark.slow
def test_smollm2_prompt_lookup_streams_the_same_text(smollm2):
    model, params, tokenizer = smollm2
    passage = "The river runs past the old mill, under the stone bridge, and into the sea."
    row = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Repeat this sentence exactly: {passage}"}])
    cfg = jaxgen.default_config(model, max_new_tokens=32, prompt_lookup_num_tokens=5)
    single = jaxgen.generate_ids(model, params, [row], cfg)[0]
    pieces = []

    class Capture(TextStreamer):
        def on_finalized_text(self, text, stream_end=False):
            pieces.append(text)

    chunked = jaxgen.generate_ids(model, params, [row], cfg,
                                  streamer=Capture(tokenizer, skip_prompt=True))[0]
    assert chunked == single
    assert "".join(pieces) == tokenizer.decode(single[len(row):])


@pytest.mark.slow
def test_growing_cache_streams_through_the_same_driver():
    from jaxgen.models import Llama, LlamaConfig

    model = Llama(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2,
                              num_heads=2, num_kv_heads=1, head_dim=8))
    params = model.init_params(jax.random.key(1))
    static = jaxgen.GenerationConfig(max_new_tokens=50, do_sample=True, top_k=0)
    dynamic = static.replace(cache_implementation="dynamic",
                             cache_config={"initial_length": 16, "chunk_size": 4})
    ref = jaxgen.generate(params, jaxgen.init_state(model, [[1, 2]], static, jax.random.key(0)),
                          static)
    streamer = Collect()
    out = jaxgen.generate(params, jaxgen.init_state(model, [[1, 2]], dynamic, jax.random.key(0)),
                          dynamic, streamer=streamer)
    np.testing.assert_array_equal(np.asarray(out.sequences), np.asarray(ref.sequences))
    assert sum(streamer.puts, []) == np.asarray(ref.sequences)[0, :int(ref.lengths[0])].tolist()
    # it grew 16 -> 32 -> 64 for 51 positions, never to the 66-token buffer
    assert out.state.cache.max_len == 64 < out.sequences.shape[1] == 66

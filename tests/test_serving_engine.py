"""Continuous batching (jaxgen.serving): every request's tokens equal its solo generate call,
slots are reused as requests end or are cancelled, nothing recompiles as requests come and
go, the waiting queue is bounded and close() never hangs."""
import jax
import numpy as np
import pytest

import jaxgen
from jaxgen.serving import Engine, EngineClosed, QueueFull, generate_batch

WAIT = 300  # seconds: a bound so a broken engine fails the test instead of hanging it


@pytest.fixture(scope="module")
def tiny():
    from jaxgen.models import tiny_llama
    return tiny_llama()


def _requests(count, seed=0):
    """(prompt, budget) pairs of mixed prompt and answer lengths (prompts of one bucket)."""
    rng = np.random.default_rng(seed)
    return [(rng.integers(1, 32, size=int(rng.integers(2, 15))).tolist(),
             int(rng.integers(2, 24))) for _ in range(count)]


def _solo(model, params, prompt, cfg, **settings):
    return jaxgen.generate_ids(model, params, [prompt], cfg, **settings)[0]


def test_twelve_requests_through_four_slots_equal_solo_calls_without_recompiling(tiny):
    model, params = tiny
    cfg = jaxgen.GenerationConfig(max_new_tokens=24)
    requests = _requests(12)
    expected = [_solo(model, params, p, cfg, max_new_tokens=n) for p, n in requests]
    engine = Engine(model, params, cfg, slots=4, max_len=48, chunk_size=4, max_waiting=16)
    try:
        engine.warm_up(prompt_lengths=[14])
        before = jaxgen.trace_count()
        first = [engine.submit(p, max_new_tokens=n) for p, n in requests[:6]]
        first[0].result(timeout=WAIT)  # the rest come while these run
        later = [engine.submit(p, max_new_tokens=n) for p, n in requests[6:]]
        results = [h.result(timeout=WAIT) for h in first + later]
        assert jaxgen.trace_count() == before  # admissions and chunks reuse their programs
    finally:
        engine.close(cancel=True, timeout=WAIT)
    assert [r.ids for r in results] == expected
    assert all(r.status == "finished" for r in results)
    assert [len(r.new_ids) for r in results] == [n for _, n in requests]
    streamed = list(first[1].tokens(timeout=WAIT))
    assert streamed == results[1].new_ids


@pytest.mark.parametrize("do_sample", [False, True])
def test_prompts_of_any_length_prefill_in_chunks_without_new_programs(tiny, do_sample):
    """Prompts of 1 to 62 tokens, prefilled 10 positions a chunk into a 64-token slot (the
    last chunk of the 62-token prompt moved back to end inside the buffer): every result
    equals its solo call, and after warm_up no prompt length compiles anything."""
    model, params = tiny
    cfg = jaxgen.GenerationConfig(max_new_tokens=8, do_sample=do_sample, temperature=0.8)
    rng = np.random.default_rng(3)
    lengths = [1, 9, 10, 11, 25, 40, 55, 62]
    requests = [(rng.integers(1, 32, size=n).tolist(), min(8, 64 - n)) for n in lengths]
    keys = [jax.random.key(100 + i) for i in range(len(requests))]
    expected = [_solo(model, params, p, cfg, max_new_tokens=n, key=k)
                for (p, n), k in zip(requests, keys)]
    engine = Engine(model, params, cfg, slots=3, max_len=64, chunk_size=4, prefill_width=10)
    try:
        engine.warm_up()
        before = jaxgen.trace_count()
        handles = [engine.submit(p, max_new_tokens=n, key=k)
                   for (p, n), k in zip(requests, keys)]
        results = [h.result(timeout=WAIT) for h in handles]
        assert jaxgen.trace_count() == before
    finally:
        engine.close(cancel=True, timeout=WAIT)
    assert [r.ids for r in results] == expected


def test_chunks_attend_over_the_cache_their_rows_reach_with_the_same_tokens(tiny):
    """A 300-position slot buffer runs its chunks on the cache cropped to 128 ... 300
    positions (whatever every live row reaches): rows that cross 128 and 256 mid-request,
    and a slot reused after a long request, give their solo calls' tokens, and no rung
    compiles after warm_up."""
    model, params = tiny
    cfg = jaxgen.GenerationConfig(max_new_tokens=8)
    rng = np.random.default_rng(5)
    shapes = [(100, 60), (20, 10), (230, 60), (5, 30), (120, 20), (250, 45), (40, 90)]
    requests = [(rng.integers(1, 32, size=n).tolist(), budget) for n, budget in shapes]
    expected = [_solo(model, params, p, cfg, max_new_tokens=n) for p, n in requests]
    runs = {}
    for ladder in ((128, 192, 256, 300), (300,)):  # cropped; the whole buffer every chunk
        engine = Engine(model, params, cfg, slots=2, max_len=300, chunk_size=4,
                        prefill_width=32)
        assert engine._ladder == (128, 192, 256, 300)
        engine._ladder = ladder
        try:
            engine.warm_up()
            before = jaxgen.trace_count()
            handles = [engine.submit(p, max_new_tokens=n) for p, n in requests]
            results = [h.result(timeout=WAIT) for h in handles]
            assert jaxgen.trace_count() == before
        finally:
            engine.close(cancel=True, timeout=WAIT)
        runs[ladder] = ([r.ids for r in results], [h.token_logprobs for h in handles])
    (ids, logprobs), (whole_ids, whole_logprobs) = runs.values()
    assert ids == expected == whole_ids
    for mine, whole in zip(logprobs, whole_logprobs):  # the scores too, not only the argmax
        np.testing.assert_allclose(mine, whole, rtol=1e-5, atol=1e-5)


def test_a_layer_by_layer_forward_keeps_the_slots_cache_per_layer_with_the_same_tokens(tiny):
    """With the weights laid out layer by layer (layout="split"), the slots' cache stays one
    buffer per layer between calls (no call stacks it back), admissions of every chunk
    width and cropped chunks read and write it so, and every request gives its solo call's
    tokens and log-probs."""
    from jaxgen.cache.layer_forms import holds_layer_tuples

    model, params = tiny
    cfg = jaxgen.GenerationConfig(max_new_tokens=40)
    rng = np.random.default_rng(11)
    shapes = [(3, 20), (37, 12), (150, 30), (9, 40), (200, 10)]
    requests = [(rng.integers(1, 32, size=n).tolist(), budget) for n, budget in shapes]
    solo = []
    for prompt, budget in requests:
        out = jaxgen.generate(params, jaxgen.init_state(model, [prompt], cfg,
                                                        max_new_tokens=budget), cfg)
        solo.append((np.asarray(out.sequences[0, :int(out.lengths[0])]).tolist(),
                     np.asarray(out.token_logprobs[0, :budget])))
    engine = Engine(model, params, cfg, slots=2, max_len=300, chunk_size=4,
                    prefill_width=32, layout="split")
    try:
        assert holds_layer_tuples(engine._state.cache)
        engine.warm_up()
        before = jaxgen.trace_count()
        handles = [engine.submit(p, max_new_tokens=n) for p, n in requests]
        results = [h.result(timeout=WAIT) for h in handles]
        assert jaxgen.trace_count() == before
        assert holds_layer_tuples(engine._state.cache)
    finally:
        engine.close(cancel=True, timeout=WAIT)
    for result, handle, (ids, logprobs) in zip(results, handles, solo):
        assert result.ids == ids
        np.testing.assert_allclose(handle.token_logprobs, logprobs, rtol=1e-5, atol=1e-5)


def test_an_engine_keeps_its_programs_alive_and_gives_the_room_back(tiny):
    """An engine raises the live-program limit by its own programs (every chunk rung and
    every admission width) while it runs, so other calls cannot evict them, and
    lowers it again when it closes."""
    from jaxgen.runtime.compiled import set_max_programs

    model, params = tiny
    limit = set_max_programs(16)
    try:
        engine = Engine(model, params, jaxgen.GenerationConfig(max_new_tokens=2), slots=2,
                        max_len=300)
        # 4 rungs (128 .. 300), 2 newcomer counts x 4 chunk widths (16 .. 64)
        assert set_max_programs(16 + 12) == 16 + len(engine._ladder) + 2 * 4 == 16 + 12
        engine.close(timeout=WAIT)
        assert set_max_programs(16) == 16
    finally:
        set_max_programs(limit)


def test_cancel_frees_the_slot_for_the_next_request(tiny):
    model, params = tiny
    cfg = jaxgen.GenerationConfig(max_new_tokens=40)
    prompt, other = [5, 6, 7], [9, 8]
    engine = Engine(model, params, cfg, slots=1, max_len=64, chunk_size=2)
    try:
        long = engine.submit(prompt)
        tokens = long.tokens(timeout=WAIT)
        next(tokens)  # it runs
        waiting = engine.submit(other, max_new_tokens=5)
        long.cancel()
        cancelled = long.result(timeout=WAIT)
        done = waiting.result(timeout=WAIT)
    finally:
        engine.close(cancel=True, timeout=WAIT)
    assert cancelled.status == "cancelled" and 1 <= len(cancelled.new_ids) < 40
    assert done.status == "finished"
    assert done.ids == _solo(model, params, other, cfg, max_new_tokens=5)


def test_the_waiting_queue_is_bounded(tiny):
    model, params = tiny
    engine = Engine(model, params, jaxgen.GenerationConfig(max_new_tokens=40), slots=1,
                    max_len=64, chunk_size=2, max_waiting=2)
    handles = []
    try:
        with pytest.raises(QueueFull, match="max_waiting"):
            for _ in range(5):  # one may already sit in the slot; then two wait
                handles.append(engine.submit([1, 2, 3]))
        assert 2 <= len(handles) <= 3  # max_waiting waiting, plus the one in the slot
    finally:
        engine.close(cancel=True, timeout=WAIT)
    assert all(h.result(timeout=WAIT).status in ("closed", "finished") for h in handles)


def test_per_row_temperatures_equal_their_solo_sampled_calls(tiny):
    model, params = tiny
    cfg = jaxgen.GenerationConfig(max_new_tokens=12, do_sample=True, top_k=0)
    settings = [{"temperature": 0.5, "key": jax.random.key(1)},
                {"temperature": 1.5, "key": jax.random.key(2)},
                {"temperature": 1.5, "top_p": 0.9, "key": jax.random.key(3)}]
    prompt = [3, 1, 4, 1, 5]
    engine = Engine(model, params, cfg, slots=2, max_len=32, chunk_size=3)
    try:
        results = [h.result(timeout=WAIT).ids
                   for h in [engine.submit(prompt, **s) for s in settings]]
    finally:
        engine.close(cancel=True, timeout=WAIT)
    solo = [_solo(model, params, prompt, cfg.replace(**{k: v for k, v in s.items()
                                                          if k != "key"}), key=s["key"])
            for s in settings]
    assert results == solo
    assert results[1] != results[2] or results[0] != results[1]  # the settings matter


def test_close_ends_in_flight_requests_and_refuses_new_ones(tiny):
    model, params = tiny
    engine = Engine(model, params, jaxgen.GenerationConfig(max_new_tokens=60), slots=2,
                    max_len=80, chunk_size=2)
    handles = [engine.submit([1, 2, 3 + i]) for i in range(5)]
    next(handles[0].tokens(timeout=WAIT))  # decoding has begun
    engine.close(cancel=True, timeout=WAIT)
    statuses = [h.result(timeout=WAIT).status for h in handles]
    assert statuses.count("closed") >= 3 and set(statuses) <= {"closed", "finished"}
    assert all(list(h.tokens(timeout=WAIT)) is not None for h in handles)  # streams ended
    with pytest.raises(EngineClosed):
        engine.submit([1, 2])
    engine.close(timeout=WAIT)  # a second close is harmless


def test_generate_batch_returns_solo_results_in_order(tiny):
    model, params = tiny
    cfg = jaxgen.GenerationConfig(max_new_tokens=7)
    prompts = [p for p, _ in _requests(5, seed=3)]
    rows = generate_batch(model, params, prompts, cfg, slots=2, chunk_size=3, timeout=WAIT)
    assert rows == [_solo(model, params, p, cfg) for p in prompts]


def test_bad_settings_are_refused_clearly(tiny):
    model, params = tiny
    with pytest.raises(ValueError, match="num_beams"):
        Engine(model, params, jaxgen.GenerationConfig(num_beams=2, max_new_tokens=3))
    with pytest.raises(ValueError, match="slots"):
        Engine(model, params, jaxgen.GenerationConfig(max_new_tokens=3), slots=0)
    engine = Engine(model, params, jaxgen.GenerationConfig(max_new_tokens=3), slots=1,
                    max_len=16)
    try:
        with pytest.raises(ValueError, match="sampling engine"):
            engine.submit([1, 2], temperature=0.5)
        with pytest.raises(ValueError, match="program-wide"):
            engine.submit([1, 2], eos_token_id=3)
        with pytest.raises(ValueError, match="max_len"):
            engine.submit(list(range(1, 15)))
        with pytest.raises(ValueError, match="prompt_ids"):
            engine.submit([])
    finally:
        engine.close(timeout=WAIT)


def test_continuous_batching_config_points_at_generate_batch():
    with pytest.raises(ValueError, match="generate_batch"):
        jaxgen.GenerationConfig(continuous_batching_config={"slots": 4})

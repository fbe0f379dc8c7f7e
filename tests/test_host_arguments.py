"""`streamer=` and `stop_event=` of the wrong kind are refused by the argument checks, naming the
argument, before anything compiles (jaxgen.drivers.host_arguments); the other streamers of the
call are still ended, so no consumer waits."""
from __future__ import annotations

import threading

import pytest
from streamer_threads import consume_on_a_thread
from stubs import BigramStub, LetterTokenizer, random_table

import jaxgen
from jaxgen.drivers.streamers import BaseStreamer, TextIteratorStreamer

VOCAB = 16
PROMPTS = [[1, 2, 3], [4, 5]]
JOIN_S = 60


class Collect(BaseStreamer):
    def __init__(self):
        super().__init__()
        self.tokens = []

    def put(self, value):
        self.tokens += [int(t) for t in value.reshape(-1)]

    def end(self):
        pass


@pytest.fixture(scope="module")
def stub():
    return BigramStub(VOCAB), random_table(VOCAB, seed=3)


def entry_points(stub):
    """Each public entry point, called on PROMPTS with the given keyword arguments."""
    model, params = stub
    cfg = jaxgen.GenerationConfig(max_new_tokens=4)

    def via_generate(**kwargs):
        return jaxgen.generate(params, jaxgen.init_state(model, PROMPTS, cfg), cfg, **kwargs)

    def via_ids(**kwargs):
        return jaxgen.generate_ids(model, params, PROMPTS, cfg, **kwargs)

    def via_text(**kwargs):
        return jaxgen.generate_text(model, params, LetterTokenizer(), ["bcd", "ef"], cfg,
                                    **kwargs)

    return {"generate": via_generate, "generate_ids": via_ids, "generate_text": via_text}


@pytest.mark.parametrize("entry", ["generate", "generate_ids", "generate_text"])
@pytest.mark.parametrize("stop_event", [True, "stop", 1])
def test_a_stop_event_without_is_set_is_a_type_error(stub, entry, stop_event):
    before = jaxgen.trace_count()
    with pytest.raises(TypeError, match=r"`stop_event` must be an object with is_set\(\) "
                                        r"\(e\.g\. a threading\.Event\), got "
                                        + type(stop_event).__name__):
        entry_points(stub)[entry](stop_event=stop_event)
    assert jaxgen.trace_count() == before


@pytest.mark.parametrize("entry", ["generate", "generate_ids", "generate_text"])
@pytest.mark.parametrize("streamer, needle", [
    (lambda: object(), r"`streamer` must be a streamer, an object with put\(token_ids\) and "
                       r"end\(\).*got object"),
    (lambda: [Collect(), "row 1"], r"`streamer\[1\]` must be a streamer.*got str"),
    (lambda: [None, Collect()], r"`streamer\[0\]` must be a streamer.*got NoneType"),
])
def test_a_streamer_without_put_and_end_is_a_type_error(stub, entry, streamer, needle):
    before = jaxgen.trace_count()
    with pytest.raises(TypeError, match=needle):
        entry_points(stub)[entry](streamer=streamer())
    assert jaxgen.trace_count() == before


@pytest.mark.parametrize("entry", ["generate", "generate_ids", "generate_text"])
def test_one_streamer_object_for_several_rows_is_refused(stub, entry):
    shared = Collect()
    before = jaxgen.trace_count()
    with pytest.raises(ValueError, match=r"`streamer`: the same streamer object is given for "
                                         r"rows 0 and 1"):
        entry_points(stub)[entry](streamer=[shared, shared])
    assert jaxgen.trace_count() == before and shared.tokens == []


def test_the_good_streamers_of_a_refused_call_are_ended(stub):
    waiting = TextIteratorStreamer(LetterTokenizer())  # no timeout: a hang is the bug
    thread, result = consume_on_a_thread(waiting)
    with pytest.raises(TypeError, match=r"`streamer\[1\]`"):
        entry_points(stub)["generate_ids"](streamer=[waiting, object()])
    thread.join(timeout=JOIN_S)
    assert not thread.is_alive()
    assert isinstance(result.get("error"), TypeError)


def test_duck_typed_stop_events_and_separate_streamers_still_run(stub):
    class NeverSet:
        def is_set(self):
            return False

    model, params = stub
    cfg = jaxgen.GenerationConfig(max_new_tokens=4)
    plain = jaxgen.generate_ids(model, params, PROMPTS, cfg)
    for stop_event in (NeverSet(), threading.Event()):
        rows = [Collect(), Collect()]
        streamed = jaxgen.generate_ids(model, params, PROMPTS, cfg, streamer=rows,
                                       stop_event=stop_event)
        assert streamed == plain
        assert [r.tokens for r in rows] == plain

"""Continuing a finished call (jaxgen.continue_state) and shared prefixes (jaxgen.prefill_prefix):
the next call prefills only the new tokens and gives the tokens of a call from scratch."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
import pytest

import jaxgen
from jaxgen.api.text import encode_prompts
from jaxgen.core.continuation import continue_to
from jaxgen.core.output import outputs_to_lists
from jaxgen.core.state import prompt_bucket
from jaxgen.models import tiny_llama


@dataclasses.dataclass(frozen=True)
class CountingModel:
    """A model that records, at run time, every multi-token forward (a prefill block): its
    first position per row and its width. `tag` keeps its programs apart from other tests'."""

    inner: Any
    tag: str
    sink: list = dataclasses.field(default_factory=list, compare=False, hash=False)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, params, tokens, positions, cache, **kwargs):
        width = tokens.shape[1]
        if width > 1:
            jax.debug.callback(lambda first: self.sink.append((width, np.asarray(first).tolist())),
                               positions[:, 0])
        return self.inner(params, tokens, positions, cache, **kwargs)

    def blocks(self):
        jax.effects_barrier()
        seen = list(self.sink)
        self.sink.clear()
        return seen


def _turns(seed: int, count: int, rows: int = 2) -> list[list[list[int]]]:
    rng = np.random.RandomState(seed)
    return [[rng.randint(1, 32, size=rng.randint(1, 4)).tolist() for _ in range(rows)]
            for _ in range(count)]


def _from_scratch(model, params, rows, cfg, budgets, key=None):
    state = jaxgen.init_state(model, rows, cfg, key, max_new_tokens=budgets)
    return outputs_to_lists(jaxgen.generate(params, state, cfg))


def test_six_turn_chat_prefills_only_each_turn():
    model, params = tiny_llama()
    counting = CountingModel(model, "six-turns")
    cfg = jaxgen.GenerationConfig(max_new_tokens=3)
    budgets = [3, 2]  # row 1 stops a step early: its cache then holds its last token too
    turns = _turns(0, 6)
    state = jaxgen.init_state(counting, turns[0], cfg, max_new_tokens=budgets)
    history = [list(row) for row in turns[0]]
    previous = None
    for t, new in enumerate(turns):
        if t:
            held = np.asarray(previous.state.cache.length)
            unread = np.asarray(previous.lengths) - held  # the last answer token, if unfed
            state = jaxgen.continue_state(previous, new, cfg, max_new_tokens=budgets)
            history = [h + n for h, n in zip(history, new)]
            own = np.array([len(n) for n in new]) + unread
            assert (np.asarray(state.cached) == held).all()
            assert (np.asarray(state.prompt_len - state.cached) == own).all()
            assert state.prefill_width == prompt_bucket(int(own.max()))
        out = jaxgen.generate(params, state, cfg)
        blocks = counting.blocks()
        first = [0, 0] if t == 0 else np.asarray(previous.state.cache.length).tolist()
        width = prompt_bucket(max(map(len, history))) if t == 0 else state.prefill_width
        assert blocks == [(width, first)], (t, blocks)  # one block, from each row's cache
        rows = outputs_to_lists(out)
        assert rows == _from_scratch(model, params, history, cfg, budgets), t
        history, previous = rows, out
    assert state.prompt_bucket > state.prefill_width  # the history outgrew one block


def test_sampling_continues_with_the_same_keys():
    model, params = tiny_llama(seed=1)
    cfg = jaxgen.GenerationConfig(max_new_tokens=3, do_sample=True, temperature=1.3)
    key = jax.random.key(7)
    turns = _turns(1, 2)
    out = jaxgen.generate(params, jaxgen.init_state(model, turns[0], cfg, key), cfg)
    history = outputs_to_lists(out)
    for new in turns[1:]:
        out = jaxgen.generate(params, jaxgen.continue_state(out, new, cfg), cfg)
        history = [h + n for h, n in zip(history, new)]
        rows = outputs_to_lists(out)
        assert rows == _from_scratch(model, params, history, cfg, None, key)
        history = rows


def test_no_recompilation_across_turns_of_one_bucket():
    model, params = tiny_llama(seed=2, num_layers=2)
    cfg = jaxgen.GenerationConfig(max_new_tokens=1)
    out = jaxgen.generate(params, jaxgen.init_state(model, [[1, 2, 3], [4]], cfg), cfg)
    seen, repeated = set(), 0
    for t in range(6):
        state = jaxgen.continue_state(out, [[5 + t], [6, 7]], cfg)
        program = (state.prompt_bucket, state.prefill_width, state.buffer_len,
                   state.cache.max_len)
        before = jaxgen.trace_count()
        out = jaxgen.generate(params, state, cfg)
        traced = jaxgen.trace_count() - before
        if program in seen:
            repeated += 1
            assert traced == 0, (t, program)
        assert traced <= 1
        seen.add(program)
    assert repeated >= 2


def test_prefix_reused_across_calls_and_rows():
    model, params = tiny_llama(seed=3)
    counting = CountingModel(model, "prefix")
    cfg = jaxgen.GenerationConfig(max_new_tokens=5)
    system = list(range(1, 21))  # 20 tokens: a bucket of its own
    prefix = jaxgen.prefill_prefix(counting, params, system, cfg)
    counting.blocks()
    for prompts in ([[3], [4, 5, 6], [7, 8]], [[9, 10, 11, 12], [13], [14, 15]]):
        state = jaxgen.init_state(counting, prompts, cfg, prefix=prefix)
        assert state.cached.tolist() == [20, 20, 20]
        out = jaxgen.generate(params, state, cfg)
        assert counting.blocks() == [(16, [20, 20, 20])]  # the prompts' own tokens only
        expected = jaxgen.generate_ids(model, params, [system + p for p in prompts], cfg)
        assert outputs_to_lists(out) == expected


SLOW = pytest.mark.slow  # the default suite keeps the ring kind, whose copy re-slots
CACHES = [
    pytest.param("dynamic", {"initial_length": 16, "chunk_size": 8}, marks=SLOW, id="dynamic"),
    pytest.param("quantized", {}, marks=SLOW, id="quantized"),
    pytest.param("quantized", {"residual_length": 4}, marks=SLOW, id="quantized-ring"),
    pytest.param("sliding_window", {"sliding_window": 8}, id="window"),  # < the history
    pytest.param("offloaded", {}, marks=SLOW, id="offloaded"),
]


@pytest.mark.parametrize("kind,options", CACHES)
def test_cache_kinds_continue(kind, options):
    model, params = tiny_llama(seed=4)
    cfg = jaxgen.GenerationConfig(max_new_tokens=4, cache_implementation=kind,
                                  cache_config=options)
    turns = _turns(4, 2)
    out = jaxgen.generate(params, jaxgen.init_state(model, turns[0], cfg), cfg)
    history = outputs_to_lists(out)
    for new in turns[1:]:
        state = jaxgen.continue_state(out, new, cfg)
        assert state.cache.kind == kind
        out = jaxgen.generate(params, state, cfg)
        history = [h + n for h, n in zip(history, new)]
        rows = outputs_to_lists(out)
        assert rows == _from_scratch(model, params, history, cfg, None)
        history = rows


@pytest.mark.slow
def test_split_layout_continues():
    """The CPU backend's per-layer layout: the caller's cache is stacked, as continuing needs."""
    model, params = tiny_llama(seed=5, num_layers=2)
    cfg = jaxgen.GenerationConfig(max_new_tokens=3)
    turns = _turns(5, 2)
    out = jaxgen.generate(params, jaxgen.init_state(model, turns[0], cfg), cfg, layout="split")
    history = outputs_to_lists(out)
    for new in turns[1:]:
        out = jaxgen.generate(params, jaxgen.continue_state(out, new, cfg), cfg, layout="split")
        history = [h + n for h, n in zip(history, new)]
        rows = outputs_to_lists(out)
        assert rows == _from_scratch(model, params, history, cfg, None)
        history = rows


def test_continue_to_recomputes_from_where_rows_differ():
    model, params = tiny_llama(seed=6)
    cfg = jaxgen.GenerationConfig(max_new_tokens=3)
    out = jaxgen.generate(params, jaxgen.init_state(model, [[1, 2, 3, 4, 5]], cfg), cfg)
    [held] = outputs_to_lists(out)
    edited = held[:3] + [9, 9] + held[5:] + [7]  # differs from position 3 on
    state = continue_to(out, [edited], cfg)
    assert state.cached.tolist() == [3]
    rows = outputs_to_lists(jaxgen.generate(params, state, cfg))
    assert rows == _from_scratch(model, params, [edited], cfg, None)


def test_refusals():
    model, params = tiny_llama()
    other, _ = tiny_llama(num_layers=2)
    cfg = jaxgen.GenerationConfig(max_new_tokens=2)
    beam = jaxgen.GenerationConfig(max_new_tokens=2, num_beams=2)
    beamed = jaxgen.generate(params, jaxgen.init_state(model, [[1, 2]], beam), beam)
    with pytest.raises(ValueError, match="beam-search output"):
        jaxgen.continue_state(beamed, [[3]], cfg)
    out = jaxgen.generate(params, jaxgen.init_state(model, [[1, 2]], cfg), cfg)
    with pytest.raises(ValueError, match="another model"):
        jaxgen.continue_state(out, [[3]], cfg, model=other)
    prefix = jaxgen.prefill_prefix(model, params, [1, 2, 3], cfg)
    with pytest.raises(ValueError, match="another model"):
        jaxgen.init_state(other, [[4]], cfg, prefix=prefix)
    with pytest.raises(ValueError, match="one token-id list per row"):
        jaxgen.continue_state(out, [[3], [4]], cfg)
    with pytest.raises(ValueError, match="cache this config builds"):
        jaxgen.continue_state(out, [[3]], cfg.replace(cache_implementation="quantized"))
    state = jaxgen.continue_state(out, [[3]], cfg)
    with pytest.raises(ValueError, match="greedy or sampling decoding only"):
        jaxgen.generate(params, state, beam)
    jaxgen.generate(params, jaxgen.continue_state(out, [[3]], cfg), cfg)
    jaxgen.generate(params, jaxgen.continue_state(out, [[4]], cfg), cfg)  # out stays valid


@pytest.mark.slow
def test_smollm2_six_turn_chat_matches_from_scratch():
    model, params, tokenizer = jaxgen.models.load("smollm2-135m-instruct")
    cfg = jaxgen.default_config(model, max_new_tokens=12, do_sample=False)
    questions = ["Hi!", "What is 2+2?", "And 3+3?", "Name a colour.", "Another one?",
                 "Thanks, bye."]
    messages, out = [], None
    for question in questions:
        messages.append({"role": "user", "content": question})
        [row] = encode_prompts(tokenizer, [list(messages)], chat=True)
        state = (jaxgen.init_state(model, [row], cfg) if out is None
                 else continue_to(out, [row], cfg))
        out = jaxgen.generate(params, state, cfg)
        [got] = outputs_to_lists(out)
        [expected] = jaxgen.generate_ids(model, params, [row], cfg)
        assert got == expected, question
        reply = tokenizer.decode(got[len(row):], skip_special_tokens=True)
        messages.append({"role": "assistant", "content": reply.strip()})

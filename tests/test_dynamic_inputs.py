"""Budgets, stop strings and EOS ids are dynamic inputs of the compiled program, and the number
of live programs is bounded (issue 36): a long-lived process does not grow with the values it
has seen. Memory is measured as the process's memory maps (/proc/self/maps lines) and RSS
after a warm-up, with generous bounds (no timings)."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxgen
from jaxgen.core.state import new_token_bucket, prompt_bucket
from jaxgen.models import TINY_VOCAB, tiny_llama, tiny_tokenizer
from jaxgen.runtime import compiled

PROMPTS = ["the stop", "a b"]


@pytest.fixture(scope="module")
def tiny():
    model, params = tiny_llama(vocab_size=TINY_VOCAB)
    return model, params, tiny_tokenizer()


def _maps() -> int:
    with open("/proc/self/maps") as handle:
        return sum(1 for _ in handle)


def _rss_mb() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _settings(kind: str, i: int, tok) -> dict:
    """Call i's new value of the field under test."""
    if kind == "stop_strings":
        return dict(max_new_tokens=12, stop_strings=[f"{'ab'[i % 2]}{i % 7}{'xyz'[i % 3]}",
                                                     f"q{i}"])
    if kind == "max_new_tokens":
        return dict(max_new_tokens=1 + i % 60)
    return dict(max_new_tokens=10, eos_token_id=i % TINY_VOCAB)


def _many_calls(tiny, kind: str, calls: int, warm: int = 10):
    """(traces, maps growth, RSS growth in MB) over `calls` generate_text calls, each with a
    new value of `kind`, measured after `warm` calls."""
    model, params, tok = tiny
    start = jaxgen.trace_count()
    for i in range(calls):
        if i == warm:
            maps, rss = _maps(), _rss_mb()
        jaxgen.generate_text(model, params, tok, PROMPTS, **_settings(kind, i, tok))
    return jaxgen.trace_count() - start, _maps() - maps, _rss_mb() - rss


KINDS = ["stop_strings", "max_new_tokens", "eos_token_id"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_hundred_new_values_compile_a_handful_and_memory_stays_flat(tiny, kind):
    traces, maps, rss = _many_calls(tiny, kind, 100)
    assert traces <= 3, f"{traces} compilations for 100 new {kind} values"
    assert maps <= 40, f"{maps} new memory maps after warm-up"
    assert rss <= 60, f"RSS grew {rss:.0f} MB after warm-up"


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_a_thousand_new_values_compile_a_handful_and_memory_stays_flat(tiny, kind):
    traces, maps, rss = _many_calls(tiny, kind, 1000, warm=20)
    assert traces <= 3, f"{traces} compilations for 1000 new {kind} values"
    assert maps <= 40, f"{maps} new memory maps after warm-up"
    assert rss <= 100, f"RSS grew {rss:.0f} MB after warm-up"


# ------------------------------------------------------------ same outputs as before
def _reference(model, params, prompts, cfg, **kwargs):
    """The call with the buffer fixed to prompt bucket + max budget (the unbucketed shape
    every call had before budgets were bucketed)."""
    longest = max(len(p) for p in prompts)
    buffer_len = prompt_bucket(longest) + int(cfg.max_new_tokens)
    state = jaxgen.init_state(model, prompts, cfg, buffer_len=buffer_len, **kwargs)
    return jaxgen.generate(params, state, cfg)


@pytest.mark.parametrize("settings", [
    dict(max_new_tokens=5),
    dict(max_new_tokens=70, eos_token_id=[3, 9]),
    dict(max_new_tokens=7, do_sample=True, top_k=5, output_scores=True, output_logits=True),
    dict(max_new_tokens=6, num_beams=3, num_return_sequences=2, return_dict_in_generate=True,
         output_scores=True),
    dict(max_new_tokens=6, prompt_lookup_num_tokens=3),
])
def test_bucketed_buffers_return_what_the_exact_buffer_returns(settings):
    model, params = tiny_llama()
    prompts = [[1, 2, 3, 1, 2], [4, 5]]
    cfg = jaxgen.GenerationConfig(**settings)
    state = jaxgen.init_state(model, prompts, cfg, jax.random.key(3))
    assert state.buffer_len == state.prompt_bucket + new_token_bucket(cfg.max_new_tokens)
    out = jaxgen.generate(params, state, cfg)
    ref = _reference(model, params, prompts, cfg, key=jax.random.key(3))
    width = prompt_bucket(5) + cfg.max_new_tokens
    assert out.sequences.shape[1] == ref.sequences.shape[1] == width
    for name in ("sequences", "lengths", "stop_reason", "token_logprobs", "scores", "logits",
                 "beam_indices", "sequences_scores"):
        a, b = getattr(out, name), getattr(ref, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.shape == b.shape, name
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5,
                                       err_msg=name)


def test_stop_strings_hit_as_with_exact_tables(tiny):
    """Padded tables stop where the stop string ends, as a host scan of the text says."""
    model, params, tok = tiny
    free = jaxgen.generate_text(model, params, tok, PROMPTS, max_new_tokens=24)
    for text in free:
        if len(text) < 4:
            continue
        stop = text[2:4]  # a piece the free run produces: the stopped run must end on it
        stopped = jaxgen.generate_text(model, params, tok, PROMPTS, max_new_tokens=24,
                                       stop_strings=[stop, "never-there"])
        for full, cut in zip(free, stopped):
            assert full.startswith(cut)
            if stop in full:  # it stops at the first occurrence, which ends in its last token
                assert stop in cut and cut.index(stop) == full.index(stop)
        return
    pytest.fail("the free run produced no text to take a stop string from")


def test_a_new_eos_id_stops_where_it_first_appears(tiny):
    model, params, _ = tiny
    prompt = [[5, 6, 7]]
    free = jaxgen.generate_ids(model, params, prompt, max_new_tokens=16, eos_token_id=None,
                               pad_token_id=0)[0][3:]
    before = jaxgen.trace_count()
    for eos in sorted(set(free))[:4]:
        ids = jaxgen.generate_ids(model, params, prompt, max_new_tokens=16, eos_token_id=eos,
                                  pad_token_id=0)[0][3:]
        assert ids == free[:free.index(eos) + 1]
    assert jaxgen.trace_count() - before <= 1  # the first EOS config, then none


# ------------------------------------------------------------ bounded live programs
def test_least_recently_used_programs_are_cleared_and_memory_is_returned():
    model, params = tiny_llama()
    cfg = jaxgen.GenerationConfig(max_new_tokens=2)
    buckets = [[1] * 3, [1] * 17, [1] * 21]  # prompt buckets 16, 20, 24: three programs
    previous = compiled.set_max_programs(2)
    try:
        def cycle():
            for prompt in buckets:
                jaxgen.generate(params, jaxgen.init_state(model, [prompt], cfg), cfg)
                assert compiled.live_programs() <= 2
        cycle()
        maps, before = _maps(), jaxgen.trace_count()
        cycle()
        cycle()
        assert jaxgen.trace_count() - before == 6  # each was evicted before it came back
        assert _maps() - maps <= 40  # the evicted programs' code pages were returned
    finally:
        compiled.set_max_programs(previous)


def test_max_programs_must_be_a_positive_int():
    with pytest.raises(ValueError, match="max_programs"):
        compiled.set_max_programs(0)


# ------------------------------------------------------------ vmap over states
def test_vmap_over_a_stack_of_states_equals_each_state_alone():
    model, params = tiny_llama()
    cfg = jaxgen.GenerationConfig(max_new_tokens=4)
    prompts = ([[1, 2, 3], [4, 5]], [[6, 7], [8, 9, 10]])
    alone = [jaxgen.generate(params, jaxgen.init_state(model, p, cfg), cfg).sequences
             for p in prompts]
    states = [jaxgen.init_state(model, p, cfg) for p in prompts]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *states)
    out = jax.vmap(lambda s: jaxgen.generate(params, s, cfg).sequences)(stacked)
    assert out.shape == (2,) + alone[0].shape
    for i in range(2):
        np.testing.assert_array_equal(np.asarray(out[i]), np.asarray(alone[i]))


def test_vmap_over_one_states_rows_says_what_to_map_instead():
    model, params = tiny_llama()  # one layer: with one row every leading axis has size 1
    cfg = jaxgen.GenerationConfig(max_new_tokens=4)
    state = jaxgen.init_state(model, [[1, 2, 3]], cfg)
    before = jaxgen.trace_count()
    with pytest.raises(ValueError, match=r"stack of states.*vmap_axes"):
        jax.vmap(lambda s: jaxgen.generate(params, s, cfg).sequences)(state)
    assert jaxgen.trace_count() == before

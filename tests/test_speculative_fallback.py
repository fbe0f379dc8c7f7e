"""The plain-step fallback of assisted decoding (jaxgen.speculative.fallback): failing drafts
stop, the tokens stay plain greedy's, repetitive rows keep drafting, stopped rows probe
again, no extra compilation, the chunked driver carries the state, bad config values."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from stubs import BigramStub, random_table

import jaxgen
from jaxgen import GenerationConfig, generate, init_state
from jaxgen.api.generate import outputs_to_lists
from jaxgen.speculative.fallback import FallbackState, gate_rows
from jaxgen.speculative.loop import draft_buckets

V = 12
MODEL = BigramStub(vocab_size=V, pad_token_id=0)
PARAMS = random_table(V, 0, scale=3.0)
NEVER = {"table": -PARAMS["table"]}  # its argmax is never the target's: every draft fails
PROMPTS = [[3, 4, 5, 3, 4], [7, 8], [2, 3, 4, 5, 6, 7, 2, 3], [9]]
BASE = GenerationConfig(max_new_tokens=24, pad_token_id=0)


def _run(prompts, cfg, **kw):
    out = generate(PARAMS, init_state(MODEL, prompts, cfg), cfg, **kw)
    return outputs_to_lists(out), out


def test_failing_drafts_turn_into_plain_steps_with_greedy_tokens():
    cfg = BASE.replace(num_assistant_tokens=3, assistant_confidence_threshold=0.0)
    ref, _ = _run(PROMPTS, BASE)
    got, out = _run(PROMPTS, cfg, assistant_model=(MODEL, NEVER))
    assert got == ref
    spec = out.speculative
    rounds = np.asarray(spec.rounds)  # [B] about one token a round: nothing is accepted
    assert np.all(np.asarray(spec.accepted) == 0) and np.all(np.asarray(spec.plain_steps) > 0)
    # drafting (3 a round without the fallback) stops after a few failed rounds and probes
    assert np.all(np.asarray(spec.drafted) < 3 * rounds // 2)
    assert int(spec.verified_positions) < 2 * int(rounds.max())
    chunked = generate(PARAMS, init_state(MODEL, PROMPTS, cfg), cfg, chunk_size=3,
                       assistant_model=(MODEL, NEVER))  # the state crosses chunk borders
    assert outputs_to_lists(chunked) == ref
    np.testing.assert_array_equal(np.asarray(chunked.speculative.plain_steps),
                                  np.asarray(spec.plain_steps))


def test_repetitive_row_keeps_drafting_under_prompt_lookup():
    """Greedy decoding of a bigram table cycles: a prompt made of that cycle is repetitive
    from the start, and every lookup round is accepted in full."""
    cycle, _ = _run([[3]], BASE.replace(max_new_tokens=63))
    prompt = cycle[0][10:40]
    got, out = _run([prompt], BASE.replace(prompt_lookup_num_tokens=3))
    assert got[0] == cycle[0][10:64]  # plain greedy goes on along the cycle
    spec = out.speculative
    assert int(spec.plain_steps[0]) == 0
    assert int(spec.accepted[0]) == int(spec.drafted[0]) > 0
    assert float(spec.tokens_per_round[0]) > 3.0


def test_stopped_rows_probe_with_backoff_and_resume():
    """Row 0 (acceptance ~0) skips drafting and probes with one draft after 2, then 4 more
    rounds; row 1 (acceptance 0.9) always drafts. A probe whose draft passes brings the row
    back (its outcome replaces the row's failed history)."""
    cfg = BASE.replace(assistant_probe_interval=2)
    state = FallbackState(hits=jnp.array([0.0, 9.0]), trials=jnp.array([10.0, 10.0]),
                          wait=jnp.array([2, 2]), interval=jnp.array([2, 2]),
                          probing=jnp.array([False, False]))
    want, live = jnp.array([4, 4]), jnp.array([True, True])
    drafts = []
    for _ in range(8):
        k_want, probing, state = gate_rows(state, want, live, draft_buckets(4), cfg)
        drafts.append(np.asarray(k_want).tolist())
        assert bool(probing[0]) == (drafts[-1][0] > 0) and not bool(probing[1])
    assert [d[0] for d in drafts] == [0, 0, 1, 0, 0, 0, 0, 1]
    assert all(d[1] == 4 for d in drafts)
    passed = state.observe(jnp.array([1, 4]), jnp.array([1, 4]))  # the probe's draft passed
    k_want, _, _ = gate_rows(passed, want, live, draft_buckets(4), cfg)
    assert np.asarray(k_want).tolist() == [4, 4]
    failed = state.observe(jnp.array([1, 4]), jnp.array([0, 4]))
    k_want, _, _ = gate_rows(failed, want, live, draft_buckets(4), cfg)
    assert np.asarray(k_want).tolist() == [0, 4]


def test_fallback_adds_no_compilation():
    cfg = BASE.replace(prompt_lookup_num_tokens=3, max_new_tokens=8)
    first = []
    for on in (True, False):
        flagged = cfg.replace(assistant_fallback=on)
        before = jaxgen.trace_count()
        _run(PROMPTS, flagged)
        first.append(jaxgen.trace_count() - before)
        before = jaxgen.trace_count()
        _run([p[::-1] for p in PROMPTS], flagged)  # same buckets, new data
        assert jaxgen.trace_count() == before
    assert first[0] == first[1]


@pytest.mark.parametrize("fields, match", [
    (dict(assistant_fallback="yes"), "`assistant_fallback` must be True or False"),
    (dict(assistant_probe_interval=0), "`assistant_probe_interval` must be an int >= 1"),
    (dict(assistant_verify_cost=0.5), r"`assistant_verify_cost` must be a pair"),
    (dict(assistant_verify_cost=(0.5, -0.1)), r"`assistant_verify_cost` must be a pair"),
    (dict(assistant_verify_cost=(0.5, float("nan"))), r"`assistant_verify_cost` must be a pair"),
    (dict(assistant_verify_cost="cheap"), r"`assistant_verify_cost` must be a pair"),
])
def test_bad_fallback_config(fields, match):
    with pytest.raises(ValueError, match=match):
        GenerationConfig(**fields)

"""Speculative decoding in the continuous batcher (jaxgen.serving.spec_slots): with prompt
lookup or a draft model every request's greedy tokens equal its solo generate call, each row
accepts its own drafts, admission resets the newcomers' carry rows, nothing recompiles as
requests come and go, and cancelling still frees the slot."""
import numpy as np
import pytest

import jaxgen
from jaxgen.serving import Engine

WAIT = 300  # seconds: a bound so a broken engine fails the test instead of hanging it
LOOKUP = 3  # prompt_lookup_num_tokens


@pytest.fixture(scope="module")
def tiny():
    from jaxgen.models import tiny_llama
    return tiny_llama()


@pytest.fixture(scope="module")
def requests_and_solo(tiny):
    """8 (prompt, budget) pairs of mixed lengths, repetitive so prompt lookup finds matches,
    and each one's solo greedy generate_ids call with prompt lookup."""
    model, params = tiny
    rng = np.random.default_rng(0)
    requests = []
    for _ in range(8):
        motif = rng.integers(1, 32, size=int(rng.integers(3, 5))).tolist()
        requests.append(((motif * 5)[:int(rng.integers(5, 15))], int(rng.integers(3, 20))))
    cfg = jaxgen.GenerationConfig(max_new_tokens=20, prompt_lookup_num_tokens=LOOKUP)
    solo = [jaxgen.generate_ids(model, params, [p], cfg, max_new_tokens=n)[0]
            for p, n in requests]
    return requests, solo


def _serve(engine, requests):
    """Submits half, waits for the first to end, submits the rest: results in order."""
    first = [engine.submit(p, max_new_tokens=n) for p, n in requests[:4]]
    first[0].result(timeout=WAIT)  # the rest come while these run
    later = [engine.submit(p, max_new_tokens=n) for p, n in requests[4:]]
    return first + later, [h.result(timeout=WAIT) for h in first + later]


@pytest.mark.parametrize("drafting", ["prompt_lookup", "draft_model"])
def test_eight_requests_through_three_slots_equal_solo_calls(tiny, requests_and_solo, drafting):
    model, params = tiny
    requests, solo = requests_and_solo
    if drafting == "prompt_lookup":
        options = dict(prompt_lookup_num_tokens=LOOKUP)
    else:  # the same weights: its drafts are the target's greedy tokens, nearly all accepted
        options = dict(assistant_model=(model, params), num_assistant_tokens=LOOKUP)
    cfg = jaxgen.GenerationConfig(max_new_tokens=20)
    engine = Engine(model, params, cfg, slots=3, max_len=48, chunk_size=4, **options)
    try:
        engine.warm_up(prompt_lengths=[14])
        before = jaxgen.trace_count()
        handles, results = _serve(engine, requests)
        assert jaxgen.trace_count() == before  # admissions and chunks reuse their programs
        counts = engine.speculative_counts()
    finally:
        engine.close(cancel=True, timeout=WAIT)
    assert [r.ids for r in results] == solo
    assert all(r.status == "finished" for r in results)
    assert counts["accepted"] > 0 and counts["drafted"] >= counts["accepted"]
    # rounds that accepted drafts emit several tokens: fewer rounds than tokens after the first
    assert counts["rounds"] < sum(len(r.new_ids) - 1 for r in results)
    if drafting == "draft_model":
        assert counts["accepted"] >= counts["drafted"] // 2
    # each token's log-prob is handed out with it, at its own new-token number
    own = cfg.replace(max_new_tokens=requests[5][1])  # the state's budget is the config's
    plain = jaxgen.generate(params, jaxgen.init_state(model, [requests[5][0]], own), own)
    np.testing.assert_allclose(handles[5].token_logprobs,
                               np.asarray(plain.token_logprobs)[0, :requests[5][1]],
                               rtol=1e-4, atol=1e-5)


def test_cancel_frees_the_slot_and_the_newcomer_starts_afresh(tiny, requests_and_solo):
    model, params = tiny
    requests, solo = requests_and_solo
    long_budget = 200  # rounds accept several tokens: a short budget can end before the cancel
    cfg = jaxgen.GenerationConfig(max_new_tokens=long_budget, prompt_lookup_num_tokens=LOOKUP)
    engine = Engine(model, params, cfg, slots=3, max_len=256, chunk_size=4)
    try:
        long = [engine.submit([5, 6, 7 + i, 5, 6], max_new_tokens=long_budget)
                for i in range(3)]
        next(long[0].tokens(timeout=WAIT))  # they run
        waiting = engine.submit(requests[2][0], max_new_tokens=requests[2][1])
        long[0].cancel()
        cancelled = long[0].result(timeout=WAIT)
        done = waiting.result(timeout=WAIT)
    finally:
        engine.close(cancel=True, timeout=WAIT)
    assert cancelled.status == "cancelled" and 1 <= len(cancelled.new_ids) < long_budget
    assert done.status == "finished" and done.ids == solo[2]


def test_speculative_settings_the_engine_does_not_schedule_are_refused(tiny):
    model, params = tiny
    with pytest.raises(ValueError, match="assistant_tree_nodes"):
        Engine(model, params, jaxgen.GenerationConfig(
            max_new_tokens=3, prompt_lookup_num_tokens=2, assistant_tree_nodes=4), slots=1,
            max_len=16)
    engine = Engine(model, params, jaxgen.GenerationConfig(max_new_tokens=3), slots=1,
                    max_len=16)
    try:
        with pytest.raises(ValueError, match="does not draft"):
            engine.speculative_counts()
    finally:
        engine.close(timeout=WAIT)


@pytest.mark.slow
def test_mtp_drafter_rows_accept_what_their_solo_calls_accept():
    """use_mtp: the drafter reads the target's hidden states and keeps a cache per depth;
    admitted rows start from their own prefill's, so (no fallback: every round drafts K)
    the engine accepts exactly the drafts the solo calls accept."""
    import jax
    from test_mtp import LLAMA, near_target_mtp
    model, params = near_target_mtp(LLAMA, depths=2)
    cfg = jaxgen.GenerationConfig(max_new_tokens=16, use_mtp=True, assistant_fallback=False)
    rng = np.random.default_rng(1)
    requests = [(rng.integers(1, 64, size=int(rng.integers(3, 14))).tolist(),
                 int(rng.integers(3, 16))) for _ in range(5)]
    solo = [jaxgen.generate(params, jaxgen.init_state(model, [p], each), each)
            for p, each in [(p, cfg.replace(max_new_tokens=n)) for p, n in requests]]
    engine = Engine(model, params, cfg, slots=2, max_len=32, chunk_size=3)
    try:
        engine.warm_up(prompt_lengths=[13])
        before = jaxgen.trace_count()
        results = [h.result(timeout=WAIT) for h in
                   [engine.submit(p, max_new_tokens=n) for p, n in requests]]
        assert jaxgen.trace_count() == before
        counts = engine.speculative_counts()
    finally:
        engine.close(cancel=True, timeout=WAIT)
    solo_ids = [np.asarray(o.sequences)[0, :int(o.lengths[0])].tolist() for o in solo]
    assert [r.ids for r in results] == solo_ids
    accepted = sum(int(jax.device_get(o.speculative.accepted)[0]) for o in solo)
    drafted = sum(int(jax.device_get(o.speculative.drafted)[0]) for o in solo)
    assert 0 < counts["accepted"] == accepted and counts["drafted"] == drafted

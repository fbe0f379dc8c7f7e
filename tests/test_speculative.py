"""Speculative decoding on stub models: the acceptance core, prompt lookup against Hugging Face's
generator, greedy equality, batch invariance, losslessness (chi-square against the exact
processed distribution), static ensembles, EOS / budget edges, schedules and bad input."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from exact_sampling import SMALL_V, chi_square
from stubs import BigramStub, random_table

import jaxgen
from jaxgen import GenerationConfig, generate, init_state
from jaxgen.api.generate import outputs_to_lists
from jaxgen.speculative.drafters.prompt_lookup import lookup_drafts
from jaxgen.speculative.verify import accept_greedy, accept_sample, assemble

V = 12
MODEL = BigramStub(vocab_size=V, pad_token_id=0, eos_token_id=(1,))
PARAMS = random_table(V, 0, scale=3.0)
PROMPTS = [[3, 4, 5, 3, 4], [7, 8], [2, 3, 4, 5, 6, 7, 2, 3], [9]]
BASE = GenerationConfig(max_new_tokens=20, eos_token_id=1, pad_token_id=0)


def _ids(params, prompts, cfg, key=None, **kw):
    out = generate(params, init_state(MODEL, prompts, cfg, key), cfg, **kw)
    return outputs_to_lists(out), out


# ------------------------------------------------------------------ the acceptance core
def test_accept_greedy_prefix_and_correction():
    p = jnp.log(jnp.eye(4)[jnp.array([[1, 2, 3, 0]])])  # [1, 4, 4] argmax 1, 2, 3, 0
    drafts = jnp.array([[1, 2, 0]])
    n, fix = accept_greedy(drafts, jnp.array([3]), p)
    assert (int(n[0]), int(fix[0])) == (2, 3)
    n, fix = accept_greedy(jnp.array([[1, 2, 3]]), jnp.array([3]), p)
    assert (int(n[0]), int(fix[0])) == (3, 0)  # all accepted: bonus from position K
    n, fix = accept_greedy(jnp.array([[1, 2, 3]]), jnp.array([1]), p)
    assert (int(n[0]), int(fix[0])) == (1, 2)  # k_row = 1: bonus from position 1
    out = assemble(jnp.array([[1, 2, 0]]), jnp.array([2]), jnp.array([3]), pad_id=9)
    assert out.tolist() == [[1, 2, 3, 9]]


def test_accept_greedy_ensemble_uses_mixture_argmax():
    # p prefers 0 (0.6 vs 0.4), q prefers 1 strongly: w = 0.3 -> v = (0.3*0.6+0.7*0.05, ...)
    p = jnp.log(jnp.array([[[0.6, 0.4], [0.5, 0.5]]]))
    q = jnp.log(jnp.array([[[0.05, 0.95]]]))
    n, fix = accept_greedy(jnp.array([[1]]), jnp.array([1]), p, q, weight=0.3)
    assert int(n[0]) == 1
    n, fix = accept_greedy(jnp.array([[0]]), jnp.array([1]), p, q, weight=0.3)
    assert (int(n[0]), int(fix[0])) == (0, 1)  # correction = argmax(v), not argmax(p)


def test_accept_sample_edges_no_nan():
    keys = jax.random.split(jax.random.key(0), 3)
    logits = jnp.log(jnp.array([0.5, 0.3, 0.2, 0.0]))
    p = jnp.broadcast_to(logits, (3, 3, 4))
    # p == q: everything accepted whatever u is; residual would be 0/0
    n, fix = accept_sample(jnp.array([[0, 1], [2, 2], [1, 0]]), jnp.array([2, 2, 2]), p,
                           p[:, :2], jnp.full((3, 2), 0.999), keys)
    assert n.tolist() == [2, 2, 2] and np.all(np.asarray(fix) < 3)
    # q(d) = 0 for a token p likes: accepted; p(d) = 0: never accepted
    q = jnp.broadcast_to(jnp.log(jnp.array([0.0, 0.0, 0.0, 1.0])), (3, 2, 4))
    n, fix = accept_sample(jnp.array([[0, 0], [3, 3], [3, 0]]), jnp.array([2, 2, 2]), p, q,
                           jnp.full((3, 2), 0.5), keys)
    assert n.tolist() == [2, 0, 0]
    assert np.all(np.asarray(fix) != 3) and not np.any(np.isnan(np.asarray(fix)))
    # degenerate residual with the ensemble: falls back to p
    n, fix = accept_sample(jnp.array([[3, 3]] * 3), jnp.array([2, 2, 2]), p, q,
                           jnp.full((3, 2), 0.999), keys, weight=0.5)
    assert n.tolist() == [0, 0, 0] and np.all(np.asarray(fix) < 3)


# ------------------------------------------------------------------ prompt lookup
def test_prompt_lookup_matches_hugging_face_generator():
    torch = pytest.importorskip("torch")
    from transformers.generation.candidate_generator import (
        PromptLookupCandidateGenerator,
    )

    rng = np.random.default_rng(0)
    eos, width, trials = 1, 32, 60
    for K, N in [(1, 1), (3, 2), (5, 3), (4, 2)]:  # one batched call per static (K, N)
        rows = [rng.integers(0, int(rng.integers(2, 6)), size=int(rng.integers(1, 24))).tolist()
                for _ in range(trials)]
        tokens = jnp.asarray([r + [0] * (width - len(r)) for r in rows], jnp.int32)
        drafts, k = lookup_drafts(tokens, jnp.asarray([len(r) for r in rows]), num_tokens=K,
                                  max_ngram=N, eos_ids=(eos,), k_cap=jnp.full((trials,), K))
        for b, row in enumerate(rows):
            hf = PromptLookupCandidateGenerator(eos_token_id=torch.tensor([eos]),
                                                num_output_tokens=K, max_matching_ngram_size=N,
                                                max_length=1000)
            cand, _ = hf.get_candidates(torch.tensor([row]))
            expected = cand[0, len(row):].tolist()
            got = np.asarray(drafts)[b, :int(k[b])].tolist()
            assert got == expected, (row, K, N, got, expected)


def test_prompt_lookup_batched_rows_are_independent():
    rows = [[5, 6, 7, 8, 5, 6], [1, 2, 3], [4, 4, 4, 4]]
    tokens = jnp.asarray([r + [0] * (8 - len(r)) for r in rows], jnp.int32)
    drafts, k = lookup_drafts(tokens, jnp.array([6, 3, 4]), num_tokens=3, max_ngram=2,
                              eos_ids=(), k_cap=jnp.array([3, 3, 1]))
    assert np.asarray(drafts)[0].tolist() == [7, 8, 5] and k.tolist() == [3, 0, 1]


# ------------------------------------------------------------------ greedy equality
@pytest.mark.parametrize("how", ["lookup", "draft", "self", "heuristic", "ensemble-free"])
def test_greedy_equals_plain_greedy_ragged_batch(how):
    ref, _ = _ids(PARAMS, PROMPTS, BASE)
    kw = {}
    cfg = BASE
    if how == "lookup":
        cfg = BASE.replace(prompt_lookup_num_tokens=4)
    elif how == "draft":
        kw = dict(assistant_model=(MODEL, random_table(V, 1, scale=3.0)))
        cfg = BASE.replace(num_assistant_tokens=3, assistant_confidence_threshold=0.0)
    elif how == "self":
        kw = dict(assistant_model=(MODEL, PARAMS))
    elif how == "heuristic":
        kw = dict(assistant_model=(MODEL, random_table(V, 2, scale=3.0)))
        cfg = BASE.replace(num_assistant_tokens=2, max_assistant_tokens=5,
                           num_assistant_tokens_schedule="heuristic")
    else:
        kw = dict(assistant_model=(MODEL, PARAMS))
        cfg = BASE.replace(num_assistant_tokens=5, repetition_penalty=1.3)
        ref, _ = _ids(PARAMS, PROMPTS, BASE.replace(repetition_penalty=1.3))
    got, out = _ids(PARAMS, PROMPTS, cfg, **kw)
    assert got == ref
    if how in ("lookup", "draft"):
        for b, prompt in enumerate(PROMPTS):  # each row alone (one compile: batch 1)
            alone, _ = _ids(PARAMS, [prompt], cfg, **kw)
            assert alone[0] == ref[b]
    if how == "self":
        spec = out.speculative
        assert np.array_equal(np.asarray(spec.accepted), np.asarray(spec.drafted))


def test_processors_see_the_prefix_at_each_position():
    # no_repeat_ngram_size depends on every earlier token: verification must apply it with the
    # prefix ending at each verify position for the output to equal plain greedy.
    cfg = BASE.replace(no_repeat_ngram_size=2, max_new_tokens=16)
    ref, _ = _ids(PARAMS, PROMPTS, cfg)
    got, _ = _ids(PARAMS, PROMPTS, cfg.replace(num_assistant_tokens=4),
                  assistant_model=(MODEL, PARAMS))
    assert got == ref
    got, _ = _ids(PARAMS, PROMPTS, cfg.replace(prompt_lookup_num_tokens=4))
    assert got == ref


def test_eos_inside_drafts_and_budget_end():
    # A table whose greedy chain reaches EOS (1) quickly: 5 -> 6 -> 1.
    table = np.full((V, V), -5.0, np.float32)
    for a, b in [(5, 6), (6, 1), (1, 2), (2, 5), (3, 5), (7, 5)]:
        table[a, b] = 5.0
    params = {"table": jnp.asarray(table)}
    # every prompt with every per-row budget (dynamic: one compile per drafter)
    cases = [(p, n) for p in ([3, 5, 6, 1, 2], [7], [3, 5], [5, 6, 1, 2, 5, 6, 1])
             for n in (1, 2, 3, 20)]
    prompts, budgets = [p for p, _ in cases], np.array([n for _, n in cases])

    def run(cfg, **kw):
        state = init_state(MODEL, prompts, cfg, max_new_tokens=budgets)
        return outputs_to_lists(generate(params, state, cfg, **kw))

    ref = run(BASE)
    for extra, kw in [(dict(prompt_lookup_num_tokens=6), {}),
                      (dict(num_assistant_tokens=6), dict(assistant_model=(MODEL, params)))]:
        got = run(BASE.replace(**extra), **kw)
        assert got == ref, extra
        for row, prompt, budget in zip(got, prompts, budgets):
            new = row[len(prompt):]
            assert len(new) <= budget
            assert 1 not in new[:-1]  # nothing after EOS


def test_stop_strings_and_custom_criteria_cut_inside_a_round():
    stop_at_6 = lambda ctx, scores: jnp.take_along_axis(  # noqa: E731
        ctx.tokens, (ctx.length - 1)[:, None], axis=1)[:, 0] == 6
    ref, _ = _ids(PARAMS, PROMPTS, BASE, stopping_criteria=[stop_at_6])
    got, out = _ids(PARAMS, PROMPTS, BASE.replace(num_assistant_tokens=6),
                    assistant_model=(MODEL, PARAMS), stopping_criteria=[stop_at_6])
    assert got == ref


# ------------------------------------------------------------------ sampling
def _sample_cfg(**extra):
    fields = dict(do_sample=True, temperature=0.8, top_k=4, max_new_tokens=3, pad_token_id=0)
    return GenerationConfig(**{**fields, **extra})


@pytest.mark.parametrize("drafter", ["draft", "draft-heuristic",
                                     pytest.param("lookup", marks=pytest.mark.slow)])
def test_sampled_rows_do_not_depend_on_the_batch(drafter):
    cfg = _sample_cfg(num_assistant_tokens=3, assistant_confidence_threshold=0.0,
                      max_new_tokens=12)
    keys = jax.random.split(jax.random.key(3), len(PROMPTS))
    kw = dict(assistant_model=(MODEL, random_table(V, 1, scale=3.0)))
    if drafter == "lookup":
        cfg, kw = cfg.replace(prompt_lookup_num_tokens=3), {}
    if drafter == "draft-heuristic":  # per-row draft lengths; the verify width is the batch's
        cfg = cfg.replace(num_assistant_tokens=1, max_assistant_tokens=4,
                          num_assistant_tokens_schedule="heuristic")
    batched, _ = _ids(PARAMS, PROMPTS, cfg, key=keys, **kw)
    for b, prompt in enumerate(PROMPTS):
        alone, _ = _ids(PARAMS, [prompt], cfg, key=keys[b:b + 1], **kw)
        assert alone[0] == batched[b]


def _exact_joint(table: np.ndarray, first: int, steps: int, temperature=0.8, top_k=4):
    """Exact joint distribution of the first `steps` tokens under temperature + top-k."""
    logits = table / temperature
    kth = np.sort(logits, axis=1)[:, -top_k][:, None]
    logits = np.where(logits >= kth, logits, -np.inf)
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    joint = probs[first]
    for _ in range(steps - 1):
        joint = np.einsum("...i,ij->...ij", joint, probs)
    return joint


@pytest.mark.parametrize("draft_kind", ["good", "bad", "zero", "lookup"])
def test_speculative_sampling_is_lossless(draft_kind):
    rng = np.random.default_rng(7)
    target = rng.normal(size=(SMALL_V, SMALL_V)).astype(np.float32) * 1.5
    model = BigramStub(vocab_size=SMALL_V, pad_token_id=0)
    if draft_kind == "good":
        draft = target + rng.normal(size=target.shape).astype(np.float32) * 0.3
    elif draft_kind == "bad":
        draft = rng.normal(size=target.shape).astype(np.float32) * 2.0
    else:  # zero probability on the target's two favourite tokens of every row
        draft = rng.normal(size=target.shape).astype(np.float32)
        top2 = np.argsort(target, axis=1)[:, -2:]
        np.put_along_axis(draft, top2, -np.inf, axis=1)
    rows, prompt = 16000, [2, 3, 2, 3, 2]
    # budget 4: the first round after the prefill token drafts 2 (tokens 2 and 3)
    cfg = _sample_cfg(num_assistant_tokens=2, assistant_confidence_threshold=0.0,
                      max_new_tokens=4)
    kw = dict(assistant_model=(model, {"table": jnp.asarray(draft)}))
    if draft_kind == "lookup":
        cfg, kw = cfg.replace(prompt_lookup_num_tokens=2), {}
    state = init_state(model, [prompt] * rows, cfg, jax.random.key(11))
    out = generate({"table": jnp.asarray(target)}, state, cfg, **kw)
    new = np.asarray(out.sequences)[:, len(prompt):len(prompt) + 3]  # [rows, 3]
    assert (np.asarray(out.lengths) == len(prompt) + 4).all()
    counts = np.zeros((SMALL_V,) * 3)
    np.add.at(counts, (new[:, 0], new[:, 1], new[:, 2]), 1)
    exact = _exact_joint(target, prompt[-1], 3)
    assert chi_square(counts, exact) > 1e-3
    tv = 0.5 * np.abs(counts / rows - exact).sum()
    assert tv < 0.05
    spec = out.speculative
    assert int(np.asarray(spec.drafted).sum()) > 0


def test_static_ensemble_first_token_and_acceptance_rate():
    """u*q(d) <= (1-w) q(d) + w p(d): accept with probability min(1, (1-w) + w p/q), so the
    acceptance rate is sum_x min(q, v) = 1 - TV(q, v) = 1 - w TV(p, q), and the emitted token
    follows v = w p + (1 - w) q (the residual max(v - q, 0) = w max(p - q, 0))."""
    rng = np.random.default_rng(5)
    target = rng.normal(size=(SMALL_V, SMALL_V)).astype(np.float32) * 1.5
    draft = rng.normal(size=(SMALL_V, SMALL_V)).astype(np.float32) * 1.5
    model = BigramStub(vocab_size=SMALL_V, pad_token_id=0)
    w, rows, prompt = 0.4, 16000, [4]
    cfg = _sample_cfg(num_assistant_tokens=1, assistant_confidence_threshold=0.0,
                      assistant_ensemble_weight=w, max_new_tokens=3)
    state = init_state(model, [prompt] * rows, cfg, jax.random.key(2))
    out = generate({"table": jnp.asarray(target)}, state, cfg,
                   assistant_model=(model, {"table": jnp.asarray(draft)}))
    new = np.asarray(out.sequences)[:, 1:3]
    p_first = _exact_joint(target, prompt[-1], 1)
    p_rows = np.stack([_exact_joint(target, t, 1) for t in range(SMALL_V)])
    q_rows = np.stack([_exact_joint(draft, t, 1) for t in range(SMALL_V)])
    v_rows = w * p_rows + (1 - w) * q_rows
    counts = np.zeros((SMALL_V, SMALL_V))
    np.add.at(counts, (new[:, 0], new[:, 1]), 1)
    assert chi_square(counts, p_first[:, None] * v_rows) > 1e-3  # token 2 follows v
    spec = out.speculative
    first_round = np.asarray(spec.position_tried)[:, 0] > 0  # the round after the prefill
    assert first_round.all()
    rate = np.asarray(spec.position_accepted)[:, 0].sum() / rows
    tv = 0.5 * np.abs(p_rows - q_rows).sum(1)  # [V]
    expected = float((p_first * (1 - w * tv)).sum())
    sigma = np.sqrt(expected * (1 - expected) / rows)
    assert abs(rate - expected) < 4 * sigma, (rate, expected)


# ------------------------------------------------------------------ schedules, statistics
def test_heuristic_schedule_grows_and_shrinks_and_is_returned():
    cfg = BASE.replace(num_assistant_tokens=2, max_assistant_tokens=6,
                       num_assistant_tokens_schedule="heuristic", assistant_confidence_threshold=0)
    _, out = _ids(PARAMS, PROMPTS, cfg, assistant_model=(MODEL, PARAMS))
    assert np.asarray(out.speculative.num_assistant_tokens)[[0, 2]].tolist() == [6, 6]
    never = {"table": -PARAMS["table"]}  # its argmax is never the target's: nothing passes
    _, bad = _ids(PARAMS, PROMPTS, cfg, assistant_model=(MODEL, never))
    assert np.asarray(bad.speculative.num_assistant_tokens).tolist() == [1] * 4
    # the next call starts from the returned lengths (no recompile: a dynamic argument)
    _, again = _ids(PARAMS, PROMPTS, cfg, assistant_model=(MODEL, PARAMS),
                    num_assistant_tokens=out.speculative.num_assistant_tokens)
    spec = again.speculative
    assert np.asarray(spec.position_tried)[0, 5] >= 1  # six drafts from the first round
    assert np.asarray(spec.rounds)[0] < np.asarray(out.speculative.rounds)[0]
    transient = cfg.replace(num_assistant_tokens_schedule="heuristic_transient")
    _, tr = _ids(PARAMS, PROMPTS, transient, assistant_model=(MODEL, PARAMS))
    assert np.asarray(tr.speculative.num_assistant_tokens).tolist() == [2] * 4


def test_confidence_threshold_stops_drafting():
    flat = {"table": jnp.zeros((V, V))}  # draft confidence 1/V everywhere
    cfg = BASE.replace(num_assistant_tokens=5, assistant_confidence_threshold=0.5)
    ref, _ = _ids(PARAMS, PROMPTS, BASE)
    got, out = _ids(PARAMS, PROMPTS, cfg, assistant_model=(MODEL, flat))
    assert got == ref
    spec = out.speculative
    assert np.all(np.asarray(spec.drafted) <= np.asarray(spec.rounds))
    assert np.asarray(spec.position_tried)[:, 1:].sum() == 0  # never a second draft


def test_statistics_shapes_and_counts():
    _, out = _ids(PARAMS, PROMPTS, BASE.replace(num_assistant_tokens=4),
                  assistant_model=(MODEL, PARAMS))
    spec = out.speculative
    assert spec.position_tried.shape == (4, 4) and spec.position_accepted.shape == (4, 4)
    assert int(spec.target_forwards) == 1 + int(np.asarray(spec.rounds).max())
    generated = np.asarray(out.lengths) - np.asarray(out.prompt_lengths)
    assert np.array_equal(np.asarray(spec.accepted) + np.asarray(spec.rounds) + 1, generated)
    assert np.asarray(spec.position_acceptance).shape == (4,)


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("fields, match", [
    (dict(assistant_ensemble_weight=0.0), "open interval"),
    (dict(assistant_ensemble_weight=1.5), "open interval"),
    (dict(num_assistant_tokens=0), "num_assistant_tokens"),
    (dict(prompt_lookup_num_tokens=3, num_beams=2), "beam"),
    (dict(prompt_lookup_num_tokens=3, assistant_ensemble_weight=0.5), "prompt lookup"),
    (dict(prompt_lookup_num_tokens=0), "prompt_lookup_num_tokens"),
    (dict(num_assistant_tokens_schedule="fast"), "schedule"),
])
def test_bad_config(fields, match):
    with pytest.raises(ValueError, match=match):
        GenerationConfig(**fields)


def test_bad_assistant_input():
    state = lambda: init_state(MODEL, PROMPTS, BASE)  # noqa: E731
    other = BigramStub(vocab_size=V + 1, pad_token_id=0)
    with pytest.raises(ValueError, match="universal assisted decoding"):
        generate(PARAMS, state(), BASE, assistant_model=(other, random_table(V + 1)))
    with pytest.raises(ValueError, match=r"\(model, params\)"):
        generate(PARAMS, state(), BASE, assistant_model=MODEL)
    with pytest.raises(ValueError, match="num_assistant_tokens"):
        generate(PARAMS, state(), BASE, assistant_model=(MODEL, PARAMS),
                 num_assistant_tokens=np.array([0, 1, 1, 1]))
    with pytest.raises(ValueError, match="beam"):
        generate(PARAMS, state(), BASE.replace(num_beams=2), assistant_model=(MODEL, PARAMS))
    with pytest.raises(ValueError, match="only one way of drafting"):
        generate(PARAMS, state(), BASE.replace(prompt_lookup_num_tokens=2),
                 assistant_model=(MODEL, PARAMS))
    before = jaxgen.trace_count()
    with pytest.raises(ValueError):
        generate(PARAMS, state(), BASE, assistant_model=(other, random_table(V + 1)))
    assert jaxgen.trace_count() == before


# ------------------------------------------------------------------ verify width
def test_draft_buckets():
    from jaxgen.speculative.loop import draft_buckets
    assert draft_buckets(10) == (0, 1, 3, 7, 10)
    assert draft_buckets(4) == (0, 1, 3, 4)
    assert draft_buckets(1) == (0, 1) and draft_buckets(7) == (0, 1, 3, 7)


def test_verify_width_follows_the_longest_draft():
    """No lookup match: every round is a one-position forward. A draft model with a constant
    K = 4 verifies 5 positions a round until the budget caps the drafts."""
    distinct = [[2, 3, 4, 5], [6, 7]]
    cfg = BASE.replace(max_new_tokens=6, prompt_lookup_num_tokens=7, eos_token_id=None)
    table = {"table": jnp.asarray(np.roll(np.eye(V, dtype=np.float32), 1, axis=1) * 5.0)}
    got, out = _ids(table, distinct, cfg)  # token t -> t + 1: a fresh token every step
    assert got[0][4:] == [6, 7, 8, 9, 10, 11] and got[1][2:] == [8, 9, 10, 11, 0, 1]
    spec = out.speculative
    assert np.asarray(spec.drafted).sum() == 0
    assert int(spec.verified_positions) == int(np.asarray(spec.rounds).max())
    cfg = BASE.replace(max_new_tokens=12, eos_token_id=None, pad_token_id=None)
    ref, _ = _ids(PARAMS, PROMPTS[:1], cfg)
    got, out = _ids(PARAMS, PROMPTS[:1], cfg.replace(num_assistant_tokens=4,
                                                     assistant_fallback=False),
                    assistant_model=(MODEL, PARAMS))  # the target as its own draft
    assert got == ref
    spec = out.speculative
    # 12 new tokens: prefill 1, then rounds of 4 drafts + bonus (5 wide) twice, then the
    # budget leaves no room for a draft: a 1-wide round.
    assert int(np.asarray(spec.rounds)[0]) == 3 and int(spec.verified_positions) == 5 + 5 + 1


def test_prompt_lookup_heuristic_schedule_shrinks_failing_rows():
    """A row whose lookups keep failing drafts fewer tokens under "heuristic"; greedy output
    is unchanged and the verify forwards get narrower."""
    cfg = BASE.replace(max_new_tokens=20, eos_token_id=None, prompt_lookup_num_tokens=7,
                       assistant_fallback=False)  # the schedule alone (no plain steps)
    ref, const = _ids(PARAMS, PROMPTS, cfg)
    got, adapt = _ids(PARAMS, PROMPTS, cfg.replace(num_assistant_tokens_schedule="heuristic"))
    assert got == ref
    c, a = const.speculative, adapt.speculative
    c_rate = np.asarray(c.drafted) / np.maximum(np.asarray(c.rounds), 1)
    a_rate = np.asarray(a.drafted) / np.maximum(np.asarray(a.rounds), 1)
    assert np.all(a_rate <= c_rate + 1e-6) and np.any(a_rate < c_rate)
    c_width = int(c.verified_positions) / int(np.asarray(c.rounds).max())
    a_width = int(a.verified_positions) / int(np.asarray(a.rounds).max())
    assert a_width < c_width

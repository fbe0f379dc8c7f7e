"""Self-speculative early exit (`assistant_early_exit=E`): shared cache, shared compute.

Greedy equality with plain greedy (several E, stacked and unstacked layers, batch 1 and a
ragged batch of 4), E = num_layers accepts every draft, exit adapters, lossless sampling
(chi-square against the exactly computed processed distribution), batch invariance, the
chunked driver, the static ensemble, one compile per bucket, and bad input before compile.
"""
from __future__ import annotations

import threading

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from exact_sampling import (
    SMALL_V,
    TEMPERATURE,
    TOP_K,
    assert_follows,
    first_three_counts,
    three_token_joint,
)

import jaxgen
from jaxgen.core.contracts import LayeredModel
from jaxgen.models import tiny_llama, unstack_layers
from jaxgen.models.exit_adapter import init_exit_adapter

MODEL, PARAMS = tiny_llama(seed=4, num_layers=3, vocab_size=64, hidden_size=32,
                           intermediate_size=64, num_heads=4, num_kv_heads=2)
RAGGED = [[5, 9, 11, 5, 9], [7, 3], [22, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52,
                                     53, 54, 55, 56], [60]]


def run(cfg, prompts, params=PARAMS, key=None, **kw):
    return jaxgen.generate(params, jaxgen.init_state(MODEL, prompts, cfg, key), cfg, **kw)


def test_the_llama_family_is_a_layered_model():
    assert isinstance(MODEL, LayeredModel)


@pytest.mark.parametrize("exit_layer", [1, 2, 3])
@pytest.mark.parametrize("layout", ["stacked", pytest.param("unstacked", marks=pytest.mark.slow)])
@pytest.mark.parametrize("prompts", [RAGGED[:1], RAGGED], ids=["batch1", "ragged4"])
def test_greedy_equals_plain_greedy(exit_layer, layout, prompts):
    params = PARAMS if layout == "stacked" else unstack_layers(MODEL, PARAMS)
    plain_cfg = jaxgen.GenerationConfig(max_new_tokens=16)
    plain = run(plain_cfg, prompts, params)
    cfg = plain_cfg.replace(assistant_early_exit=exit_layer, num_assistant_tokens=3)
    out = run(cfg, prompts, params)
    chex.assert_trees_all_equal(out.sequences, plain.sequences)
    chex.assert_trees_all_equal(out.lengths, plain.lengths)
    stats = out.speculative
    assert int(np.sum(stats.drafted)) > 0 and int(np.sum(stats.rounds)) > 0
    # layer forwards: a round costs one verify forward's worth, drafting included; the
    # statistics count the early passes as draft forwards
    assert int(stats.draft_forwards) >= int(np.max(stats.rounds))


def test_exit_at_the_last_layer_accepts_every_draft():
    cfg = jaxgen.GenerationConfig(max_new_tokens=17, assistant_early_exit=3,
                                  num_assistant_tokens=4, assistant_confidence_threshold=0.0)
    out = run(cfg, RAGGED)
    stats = out.speculative
    chex.assert_trees_all_equal(stats.accepted, stats.drafted)
    # 16 tokens after the prefill token: full rounds of 4 drafts + 1 bonus token
    np.testing.assert_array_equal(np.asarray(stats.rounds), [4, 4, 4, 4])
    chex.assert_trees_all_equal(out.sequences, run(cfg.replace(assistant_early_exit=None),
                                                   RAGGED).sequences)


@pytest.mark.slow
def test_an_exit_adapter_changes_the_drafts_not_the_output():
    plain = run(jaxgen.GenerationConfig(max_new_tokens=16), RAGGED)
    cfg = jaxgen.GenerationConfig(max_new_tokens=16, assistant_early_exit=1)
    without = run(cfg, RAGGED)
    adapter = init_exit_adapter(jax.random.key(1), hidden=32, width=8)
    zero = {**PARAMS, "exit_adapters": {"1": adapter}}  # w_out = 0: the plain exit
    MODEL.check_params(zero)
    same = run(cfg, RAGGED, zero)
    chex.assert_trees_all_equal(same.speculative.accepted, without.speculative.accepted)
    trained = {**PARAMS, "exit_adapters": {"1": {**adapter, "w_out": jax.random.normal(
        jax.random.key(2), adapter["w_out"].shape) * 3.0}}}
    other = run(cfg, RAGGED, trained)
    chex.assert_trees_all_equal(other.sequences, plain.sequences)
    assert not np.array_equal(np.asarray(other.speculative.accepted),
                              np.asarray(without.speculative.accepted))


def test_exit_adapters_are_checked():
    adapter = init_exit_adapter(jax.random.key(1), hidden=32, width=8)
    with pytest.raises(ValueError, match="exit_adapters"):
        MODEL.check_params({**PARAMS, "exit_adapters": {"7": adapter}})
    with pytest.raises(ValueError, match="w_out"):
        MODEL.check_params({**PARAMS, "exit_adapters": {"1": {**adapter,
                                                              "w_out": jnp.zeros((8, 31))}}})


@pytest.mark.parametrize("fields, needle", [
    (dict(assistant_early_exit=0), "assistant_early_exit"),
    (dict(assistant_early_exit=4), r"\[1, num_hidden_layers=3\]"),
    (dict(assistant_early_exit=1, num_beams=2), "beam search"),
    (dict(assistant_early_exit=1, prompt_lookup_num_tokens=3), "not both"),
])
def test_bad_early_exit_input_fails_before_compiling(fields, needle):
    before = jaxgen.trace_count()
    with pytest.raises(ValueError, match=needle):
        run(jaxgen.GenerationConfig(max_new_tokens=4, **fields), RAGGED)
    with pytest.raises(ValueError, match="only one way of drafting"):
        run(jaxgen.GenerationConfig(max_new_tokens=4, assistant_early_exit=1), RAGGED,
            assistant_model=(MODEL, PARAMS))
    assert jaxgen.trace_count() == before


@pytest.mark.slow
def test_one_compile_per_bucket_and_the_chunked_driver():
    cfg = jaxgen.GenerationConfig(max_new_tokens=12, assistant_early_exit=2)
    first = run(cfg, [[1, 2, 3]])
    before = jaxgen.trace_count()
    second = run(cfg, [[4, 5, 6, 7]])
    assert jaxgen.trace_count() == before
    chunked = run(cfg, [[4, 5, 6, 7]], stop_event=threading.Event())
    chex.assert_trees_all_equal(chunked.sequences, second.sequences)
    assert int(chunked.speculative.target_forwards) == int(second.speculative.target_forwards)
    assert first.sequences.shape == second.sequences.shape


@pytest.mark.slow
def test_the_ensemble_with_an_exact_draft_is_plain_greedy():
    cfg = jaxgen.GenerationConfig(max_new_tokens=12, assistant_early_exit=3,
                                  assistant_ensemble_weight=0.5)
    chex.assert_trees_all_equal(run(cfg, RAGGED).sequences,
                                run(jaxgen.GenerationConfig(max_new_tokens=12), RAGGED).sequences)


@pytest.mark.slow
def test_sampled_rows_do_not_depend_on_the_batch():
    cfg = jaxgen.GenerationConfig(max_new_tokens=12, do_sample=True, temperature=0.9,
                                  assistant_early_exit=1, num_assistant_tokens=3)
    keys = jax.random.split(jax.random.key(5), len(RAGGED))
    batched = np.asarray(run(cfg, RAGGED, key=keys).sequences)
    for b, prompt in enumerate(RAGGED):
        alone = np.asarray(run(cfg, [prompt], key=keys[b:b + 1]).sequences)
        n = len(prompt) + 12
        np.testing.assert_array_equal(alone[0, :n], batched[b, :n])


# ------------------------------------------------------------------------- losslessness
@pytest.mark.parametrize("exit_layer", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_sampling_is_lossless(exit_layer):
    model, params = tiny_llama(seed=9, num_layers=3, vocab_size=SMALL_V)
    params = {**params, "embed": params["embed"] * 4.0}  # a peaked, context-dependent model
    prompt = [2, 3, 2, 3, 2]
    exact = three_token_joint(model, params, prompt)  # [V, V, V]
    rows = 12000
    cfg = jaxgen.GenerationConfig(do_sample=True, temperature=TEMPERATURE, top_k=TOP_K,
                                  max_new_tokens=4, assistant_early_exit=exit_layer,
                                  num_assistant_tokens=2, assistant_confidence_threshold=0.0)
    out = jaxgen.generate(params, jaxgen.init_state(model, [prompt] * rows, cfg,
                                                    jax.random.key(11)), cfg)
    counts = first_three_counts(out.sequences, len(prompt), SMALL_V)  # [V, V, V]
    assert_follows(counts, exact)
    accepted, drafted = int(np.sum(out.speculative.accepted)), int(np.sum(out.speculative.drafted))
    if exit_layer < 3:  # a draft that differs from the target: some drafts are rejected
        assert 0 < accepted < drafted
    else:  # q = p: every draft passes the acceptance test
        assert accepted == drafted > 0

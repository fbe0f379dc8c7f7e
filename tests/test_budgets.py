"""A state's budgets are fixed by init_state: `generate` refuses a config whose max_new_tokens /
max_length differ from the state's (jaxgen.core.budgets), before anything compiles, and
accepts every flow that passes the same config (per-row budgets, continuation, outputs'
states)."""
from __future__ import annotations

import pytest
from stubs import BigramStub, random_table

import jaxgen
from jaxgen.core.output import outputs_to_lists

VOCAB = 16
MODEL = BigramStub(vocab_size=VOCAB)
PARAMS = random_table(VOCAB, seed=3)
PROMPTS = [[1, 2, 3], [4, 5]]
FIVE = jaxgen.GenerationConfig(max_new_tokens=5)
BY_LENGTH = jaxgen.GenerationConfig(max_length=9)


@pytest.mark.parametrize("built, given, needle", [
    (FIVE, FIVE.replace(max_new_tokens=2),
     "`max_new_tokens` differs: the state was built with max_new_tokens=5, but this config "
     "has max_new_tokens=2"),
    (FIVE, FIVE.replace(max_new_tokens=50), "built with max_new_tokens=5, but this config "
                                            "has max_new_tokens=50"),
    (FIVE, FIVE.replace(max_new_tokens=None, max_length=6),
     "`max_new_tokens` differs: the state was built with max_new_tokens=5, but this config "
     "has max_length=6 \\(max_new_tokens=None\\)"),
    (BY_LENGTH, BY_LENGTH.replace(max_length=6),
     "`max_length` differs: the state was built with max_length=9 \\(max_new_tokens=None\\), "
     "but this config has max_length=6"),
    (BY_LENGTH, BY_LENGTH.replace(max_new_tokens=4),
     "`max_new_tokens` differs: the state was built with max_length=9"),
])
def test_a_config_with_another_budget_is_refused(built, given, needle):
    state = jaxgen.init_state(MODEL, PROMPTS, built)
    before = jaxgen.trace_count()
    with pytest.raises(ValueError, match=needle) as raised:
        jaxgen.generate(PARAMS, state, given)
    assert "pass the same config to init_state and generate" in str(raised.value)
    assert jaxgen.trace_count() == before
    out = jaxgen.generate(PARAMS, state, built)  # the state was not consumed by the refusal
    assert out.lengths.tolist() == [
        len(p) + (5 if built is FIVE else 9 - len(p)) for p in PROMPTS]


def test_the_same_budget_passes_whatever_else_differs():
    """max_length is ignored when max_new_tokens is set (as in HF), so it may differ."""
    state = jaxgen.init_state(MODEL, PROMPTS, FIVE)
    out = jaxgen.generate(PARAMS, state, FIVE.replace(max_length=99, do_sample=True))
    assert out.lengths.tolist() == [8, 7]


def test_per_row_budgets_run_with_the_config_they_were_built_with():
    state = jaxgen.init_state(MODEL, PROMPTS, FIVE, max_new_tokens=[2, 4])
    out = jaxgen.generate(PARAMS, state, FIVE)
    assert (out.lengths - out.prompt_lengths).tolist() == [2, 4]
    state = jaxgen.init_state(MODEL, PROMPTS, FIVE, max_new_tokens=[2, 4])
    with pytest.raises(ValueError, match="built with max_new_tokens=5, but this config has "
                                         "max_new_tokens=4"):
        jaxgen.generate(PARAMS, state, FIVE.replace(max_new_tokens=4))


def test_outputs_and_continued_states_keep_their_budget():
    out = jaxgen.generate(PARAMS, jaxgen.init_state(MODEL, PROMPTS, FIVE), FIVE)
    assert out.state.budget_source == ("max_new_tokens", 5)
    three = FIVE.replace(max_new_tokens=3)
    state = jaxgen.continue_state(out, [[6], []], three)
    assert state.budget_source == ("max_new_tokens", 3)
    longer = jaxgen.generate(PARAMS, state, three)
    assert (longer.lengths - out.lengths).tolist() == [4, 3]  # + the new token, + 3 new ones
    with pytest.raises(ValueError, match="built with max_new_tokens=3, but this config has "
                                         "max_new_tokens=5"):
        jaxgen.generate(PARAMS, jaxgen.continue_state(out, [[6], []], three), FIVE)


def test_budgets_are_not_part_of_the_program():
    """Budgets of one bucket share a compiled program: the source is checked, not keyed."""
    jaxgen.generate(PARAMS, jaxgen.init_state(MODEL, PROMPTS, FIVE), FIVE)
    before = jaxgen.trace_count()
    six = FIVE.replace(max_new_tokens=6)
    rows = outputs_to_lists(jaxgen.generate(PARAMS, jaxgen.init_state(MODEL, PROMPTS, six), six))
    assert [len(r) for r in rows] == [9, 8]
    assert jaxgen.trace_count() == before


def test_a_hand_built_state_is_not_checked():
    state = jaxgen.init_state(MODEL, PROMPTS, FIVE).replace(budget_source=None)
    out = jaxgen.generate(PARAMS, state, FIVE.replace(max_new_tokens=2))
    assert (out.lengths - out.prompt_lengths).tolist() == [5, 5]  # the state's max_new

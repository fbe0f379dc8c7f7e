"""The prompt plus max_new_tokens against the model's positions and a fixed buffer, checked
before anything is allocated or compiled; truncation="left" keeps a prompt's end (issue 36)."""
from __future__ import annotations

import pytest

import jaxgen
from jaxgen.core.context import ContextTooLong, model_positions
from jaxgen.models import TINY_VOCAB, tiny_llama, tiny_tokenizer

POSITIONS = 32


@pytest.fixture(scope="module")
def short():
    """A tiny model with 32 positions."""
    return tiny_llama(max_position_embeddings=POSITIONS)


def _prompt(n: int, offset: int = 0) -> list[int]:
    return [3 + (offset + i) % 25 for i in range(n)]


def test_a_prompt_past_the_positions_is_refused_naming_it_before_compiling(short):
    model, params = short
    before = jaxgen.trace_count()
    with pytest.raises(ContextTooLong, match=r"prompt 1: the prompt \(30 tokens\) plus "
                                             r"max_new_tokens=4 needs 34 positions; the "
                                             r"model has 32") as caught:
        jaxgen.generate_ids(model, params, [_prompt(5), _prompt(30)], max_new_tokens=4)
    assert caught.value.row == 1
    with pytest.raises(ContextTooLong, match="prompt 0"):  # max_length: prompt + budget
        jaxgen.generate_ids(model, params, [_prompt(5)], max_length=POSITIONS + 1)
    assert jaxgen.trace_count() == before


def test_exactly_the_positions_fits(short):
    model, params = short
    rows = jaxgen.generate_ids(model, params, [_prompt(28)], max_new_tokens=4, eos_token_id=None)
    assert len(rows[0]) == POSITIONS


def test_truncation_left_keeps_the_end_of_the_prompt(short):
    model, params = short
    long, budget = _prompt(45), 6
    kept = long[-(POSITIONS - budget):]
    truncated = jaxgen.generate_ids(model, params, [long, _prompt(4)], max_new_tokens=budget,
                                    truncation="left")
    by_hand = jaxgen.generate_ids(model, params, [kept, _prompt(4)], max_new_tokens=budget)
    assert truncated == by_hand
    assert truncated[0][:len(kept)] == kept


def test_truncation_left_in_generate_text_decodes_only_the_new_text():
    tok = tiny_tokenizer()
    model, params = tiny_llama(vocab_size=TINY_VOCAB, max_position_embeddings=24)
    text = "the stop " * 8
    ids = tok.encode(text)
    assert len(ids) > 24
    new = jaxgen.generate_text(model, params, tok, text, max_new_tokens=5, truncation="left",
                               eos_token_id=None)
    rows = jaxgen.generate_ids(model, params, [ids[-(24 - 5):]], max_new_tokens=5,
                               eos_token_id=None)
    assert new == [tok.decode(rows[0][24 - 5:], skip_special_tokens=True)]
    with pytest.raises(ContextTooLong, match="prompt 0"):
        jaxgen.generate_text(model, params, tok, text, max_new_tokens=5)


def test_a_fixed_buffer_is_a_limit_too(short):
    model, _ = tiny_llama()
    cfg = jaxgen.GenerationConfig(max_new_tokens=4)
    with pytest.raises(ContextTooLong, match=r"prompt 0: .* does not fit the buffer"):
        jaxgen.init_state(model, [_prompt(10)], cfg, buffer_len=12)
    state = jaxgen.init_state(model, [_prompt(20)], cfg, buffer_len=16, truncation="left")
    assert int(state.prompt_len[0]) == 12 and state.buffer_len == 16


def test_truncation_takes_left_or_none():
    model, _ = tiny_llama()
    with pytest.raises(ValueError, match=r"`truncation` must be one of \[None, 'left'\]"):
        jaxgen.init_state(model, [[1, 2]], jaxgen.GenerationConfig(), truncation="right")


def test_a_hand_built_state_past_the_positions_is_refused_by_generate(short):
    small, params = short
    big, _ = tiny_llama(max_position_embeddings=4096)
    cfg = jaxgen.GenerationConfig(max_new_tokens=8)
    state = jaxgen.init_state(big, [_prompt(30)], cfg).replace(model=small)
    before = jaxgen.trace_count()
    with pytest.raises(ContextTooLong, match="row 0"):
        jaxgen.generate(params, state, cfg)
    assert jaxgen.trace_count() == before


def test_dynamic_rope_scaling_is_not_limited():
    """Dynamic NTK recomputes the frequencies past max_position_embeddings (transformers
    runs it by design), so such models take longer contexts."""
    model, params = tiny_llama(max_position_embeddings=16, head_dim=8,
                               rope_scaling=(("factor", 2.0), ("rope_type", "dynamic")))
    assert model_positions(model) is None
    rows = jaxgen.generate_ids(model, params, [_prompt(20)], max_new_tokens=4,
                               eos_token_id=None)
    assert len(rows[0]) == 24


def test_models_without_positions_are_not_limited():
    class NoPositions:
        config = None

    assert model_positions(NoPositions()) is None

"""Stopping: stop reasons, and stop strings against transformers' StopStringCriteria on the
real SmolLM2 vocabulary (the check must fire at exactly the same positions)."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from model_fixtures import smollm2_load

from jaxgen import stopping
from jaxgen.stopping.strings import build_stop_tables, stop_string_hit

TEXT = ("The cat sat on the mat.\n\nUser: where is the stop sign?\nAssistant: stopping "
        "is unstoppable; the bus-stop is at 42nd St. — café naïve 日本語 ok.\n\nUser:done")
STOPS = ["\n\n", "User:", "stop", "at on", "mat.\n", "St. —", "日本", "é n", "is at 4"]


@pytest.fixture(scope="module")
def smollm2_tokenizers():
    _, _, tok = smollm2_load()
    import transformers

    return tok, transformers.PreTrainedTokenizerFast(tokenizer_object=tok.backend)


def _hf_hits(hf_tok, stops, ids):
    from transformers.generation.stopping_criteria import StopStringCriteria

    criteria = StopStringCriteria(hf_tok, stops)
    return [bool(criteria(torch.tensor([ids[:n]]), None)[0]) for n in range(1, len(ids) + 1)]


def _our_hits(tables, ids, pad_to=None):
    """Hit flag after each prefix, evaluated for all prefixes at once as a ragged batch."""
    n = len(ids)
    width = pad_to or n
    tokens = np.full((n, width), 7, np.int32)  # garbage after each row's length
    for row in range(n):
        tokens[row, :n] = ids
    lengths = np.arange(1, n + 1, dtype=np.int32)
    return np.asarray(jax.jit(stop_string_hit)(tables, jnp.asarray(tokens),
                                               jnp.asarray(lengths))).tolist()


@pytest.mark.parametrize("stops", [[s] for s in STOPS] + [STOPS])
def test_stop_strings_fire_where_transformers_does(smollm2_tokenizers, stops):
    tok, hf_tok = smollm2_tokenizers
    ids = tok.encode(TEXT)
    tables = build_stop_tables(tok, stops, 49152)
    want = _hf_hits(hf_tok, stops, ids)
    assert any(want), "the text should contain every stop string"
    assert _our_hits(tables, ids, pad_to=len(ids) + 5) == want


def test_stop_string_spanning_tokens_and_partial_tokens(smollm2_tokenizers):
    tok, hf_tok = smollm2_tokenizers
    ids = tok.encode("the bus-stop is unstoppable")
    pieces = [tok.decode([i]) for i in ids]
    for stop in ("s-st", "unsto", "stoppa", "p is u"):
        text_hits = _hf_hits(hf_tok, [stop], ids)
        assert sum(text_hits) >= 1, (stop, pieces)
        assert _our_hits(build_stop_tables(tok, [stop], 49152), ids) == text_hits


def test_random_token_sequences_match(smollm2_tokenizers):
    """Random tokens drawn from those that overlap the stop strings."""
    tok, hf_tok = smollm2_tokenizers
    stops = ["ab", "a b", "abc\n", "  x"]
    pool = sorted({i for s in ("ab abc abc\n xx  x a b ba c\n", "b a  xa bab") for i in
                   tok.encode(s)} | set(range(200, 230)))
    rng = np.random.default_rng(0)
    tables = build_stop_tables(tok, stops, 49152)
    for _ in range(10):
        ids = [int(i) for i in rng.choice(pool, size=30)]
        assert _our_hits(tables, ids) == _hf_hits(hf_tok, stops, ids)


def test_long_stop_string_spanning_many_tokens(smollm2_tokenizers):
    """A stop string of dozens of tokens fires where transformers' does, and only at its end."""
    tok, hf_tok = smollm2_tokenizers
    long_stop = TEXT[24:150]  # starts mid-token, ends mid-token, spans about 30 tokens
    ids = tok.encode(TEXT)
    want = _hf_hits(hf_tok, [long_stop], ids)
    assert sum(want) == 1
    assert _our_hits(build_stop_tables(tok, [long_stop, "stop"], 49152), ids) == [
        a or b for a, b in zip(want, _hf_hits(hf_tok, ["stop"], ids))]


def test_check_program_size_does_not_grow_with_the_strings(smollm2_tokenizers):
    """The walk back over the window is one loop in the program: a 200-character stop string
    traces to as many operations as a 2-character one (it used to unroll one block a
    character, minutes of compile and GBs for long strings)."""
    tok, _ = smollm2_tokenizers
    tokens, lengths = jnp.zeros((2, 16), jnp.int32), jnp.array([3, 16], jnp.int32)  # [B, T]; [B]

    def operations(stop):
        tables = build_stop_tables(tok, [stop], 49152)
        return len(jax.make_jaxpr(stop_string_hit)(tables, tokens, lengths).eqns)

    assert operations("ab") == operations("ab" * 100)


@pytest.mark.parametrize("stops, shown", [(["x" * 257], "the longest 257 characters"),
                                          ([f"s{i}" for i in range(65)], "got 65 string(s)")])
def test_stop_strings_are_bounded(smollm2_tokenizers, stops, shown):
    from jaxgen import GenerationConfig, StopStringCriteria

    pattern = f"stop_strings.*at most 64 strings.*256.*{re.escape(shown)}"
    with pytest.raises(ValueError, match=pattern):
        GenerationConfig(max_new_tokens=4, stop_strings=stops)
    with pytest.raises(ValueError, match=pattern):  # HF's criteria object: the same bounds
        StopStringCriteria(smollm2_tokenizers[0], stops)
    GenerationConfig(max_new_tokens=4, stop_strings=["x" * 256] + [f"s{i}" for i in range(63)])


def test_stop_strings_need_a_tokenizer():
    with pytest.raises(ValueError, match="tokenizer"):
        build_stop_tables(None, ["x"])


def test_stop_reason_priority():
    done = jnp.array([False, False, False, False, False, True])
    reason = jnp.zeros(6, jnp.int32).at[5].set(stopping.CUSTOM)
    eos = jnp.array([True, False, False, False, False, True])
    full = jnp.array([True, True, False, True, False, True])
    string = jnp.array([True, True, True, False, False, False])
    custom = jnp.array([True, True, True, True, False, False])
    from jaxgen.core.step import StopFlags, mark_done
    flags = StopFlags(eos=eos, full=full, string=string, custom=custom)
    new_done, new_reason = mark_done(done, reason, flags, ~done)
    assert new_done.tolist() == [True, True, True, True, False, True]
    assert new_reason.tolist() == [stopping.EOS, stopping.STOP_STRING, stopping.STOP_STRING,
                                   stopping.CUSTOM, stopping.NOT_STOPPED, stopping.CUSTOM]
    assert stopping.STOP_REASONS[stopping.STOP_STRING] == "stop_string"
    assert stopping.STOP_REASONS[stopping.CUSTOM] == "custom"

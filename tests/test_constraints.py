"""Constrained generation: the token automaton in every mode, the host function path, HF
parity, compile counts and bad input (tiny model + tiny byte-level tokenizer)."""
from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest
from constraint_fixtures import HostAutomaton, new_ids

import jaxgen
from jaxgen.constraints.automaton import (
    advance,
    allowed_tokens,
    from_arrays,
    host_automaton,
    pack_mask,
)
from jaxgen.constraints.compile import compile_constraint
from jaxgen.core.output import outputs_to_lists
from jaxgen.models import TINY_VOCAB, tiny_llama, tiny_tokenizer

EOS = 256  # tiny_tokenizer's "</s>"
DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
WORDS = r"(the|stop|ab)( (the|stop|ab)){0,3}"
SCHEMA = {"type": "object",
          "properties": {"id": {"enum": [0, 10, 200]},
                         "ok": {"type": "boolean"},
                         "tag": {"type": "string", "maxLength": 4},
                         "pos": {"type": "object",
                                 "properties": {"x": {"enum": [1, 2, 3]},
                                                "dir": {"enum": ["up", "down"]}},
                                 "required": ["x", "dir"]},
                         "list": {"type": "array", "items": {"enum": ["a", "b"]},
                                  "maxItems": 2}},
          "required": ["id", "ok", "pos"]}
PROMPTS = [[72, 101, 108, 108, 111], [49, 50], [116, 104, 101, 32, 115, 116, 111, 112, 32]]


@pytest.fixture(scope="module")
def tiny():
    tok = tiny_tokenizer()
    model, params = tiny_llama(seed=3, vocab_size=TINY_VOCAB, hidden_size=32, num_layers=2)
    return model, params, tok


def texts(tok, rows, prompts, copies=1):
    """(decoded new text before EOS, ended by EOS) per row."""
    out = []
    for i, row in enumerate(rows):
        ids, ended = new_ids(row, len(prompts[i // copies]), {EOS})
        out.append((tok.decode(ids), ended))
    return out


# ------------------------------------------------------------------- the automaton
def test_advance_and_mask_agree_with_a_dict_automaton():
    rng = np.random.default_rng(0)
    states, vocab = 9, 70
    table = {s: {int(t): int(rng.integers(states)) for t in rng.choice(vocab, 12, False)}
             for s in range(states)}
    edges = [(s, t, n) for s, row in table.items() for t, n in row.items()]
    src, tok, dst = (np.array(c) for c in zip(*edges))
    aut = from_arrays(src, tok, dst, initial=0, finals=[3], num_states=states,
                      vocab_size=vocab)
    query_s = jnp.asarray(rng.integers(states, size=64), jnp.int32)  # [64]
    query_t = jnp.asarray(rng.integers(vocab, size=64), jnp.int32)  # [64]
    got = np.asarray(advance(aut, query_s, query_t))
    want = [table[int(s)].get(int(t), int(s)) for s, t in zip(query_s, query_t)]
    assert got.tolist() == want
    mask = np.asarray(allowed_tokens(aut, jnp.arange(states), eos_ids=(69,)))  # [S, V]
    for s in range(states):
        expect = set(table[s]) - {69} | ({69} if s == 3 else set())
        assert set(np.flatnonzero(mask[s]).tolist()) == expect


def test_pack_mask_round_trips():
    mask = np.random.default_rng(1).random((3, 100)) < 0.3
    aut = host_automaton(mask)
    got = np.asarray(allowed_tokens(aut, jnp.arange(3)))
    assert (got == mask).all() and pack_mask(mask).dtype == np.uint32


def test_edges_out_of_final_states_are_kept(tiny):
    """outlines-core 0.2.14's Index drops edges from a final state to a non-final one
    ("(ab)+" would end after "ab"); the sentinel compile keeps them."""
    _, _, tok = tiny
    host = HostAutomaton(compile_constraint(tok, TINY_VOCAB, regex="(ab)+").automaton)
    a, b = tok.encode("a") + tok.encode("b")
    after = host.walk([a, b])
    assert after in host.final and host.allowed(after, [EOS]) == [a, EOS]
    assert host.walk([a, b, a, b]) in host.final and host.walk([a, b, a]) not in host.final


# ------------------------------------------------------------------- every mode
MODES = {
    "greedy": dict(),
    "sample": dict(do_sample=True, temperature=1.5),
    "beam": dict(num_beams=3),
    "lookup_sample": dict(prompt_lookup_num_tokens=3, do_sample=True, temperature=1.5),
    "lookup_greedy": dict(prompt_lookup_num_tokens=3),
    "beam_sample": dict(num_beams=2, do_sample=True),
    "guided_sample": dict(guidance_scale=2.0, do_sample=True, temperature=1.5),
}
SLOW_MODES = ("lookup_greedy", "beam_sample", "guided_sample")


@pytest.mark.parametrize("mode", [m if m not in SLOW_MODES else
                                  pytest.param(m, marks=pytest.mark.slow) for m in MODES])
def test_json_schema_rows_validate_in_every_mode(tiny, mode):
    """Every row is JSON valid against the schema; the schema ends at "}", a final state
    without outgoing tokens, where EOS is forced."""
    model, params, tok = tiny
    rows = jaxgen.generate_ids(model, params, PROMPTS, tokenizer=tok, json_schema=SCHEMA,
                               max_new_tokens=96, eos_token_id=EOS, key=jax.random.key(2),
                               **MODES[mode])
    for text, ended in texts(tok, rows, PROMPTS):
        assert ended, text
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.slow
@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_row_matches_the_date_regex_in_every_mode(tiny, mode):
    model, params, tok = tiny
    rows = jaxgen.generate_ids(model, params, PROMPTS, tokenizer=tok, regex=DATE,
                               max_new_tokens=16, eos_token_id=EOS, key=jax.random.key(5),
                               **MODES[mode])
    for text, ended in texts(tok, rows, PROMPTS):
        assert ended, "a date has a fixed length: EOS is forced at its final state"
        assert re.fullmatch(DATE, text), text


@pytest.mark.slow
def test_draft_model_assistant_and_choices(tiny):
    model, params, tok = tiny
    assistant = tiny_llama(seed=9, vocab_size=TINY_VOCAB, hidden_size=32, num_layers=1)
    choices = ["the stop", "ab", "stop the ab"]
    for sample in (False, True):
        rows = jaxgen.generate_ids(model, params, PROMPTS, tokenizer=tok, choices=choices,
                                   assistant_model=assistant, num_assistant_tokens=3,
                                   max_new_tokens=16,
                                   eos_token_id=EOS, do_sample=sample, key=jax.random.key(1))
        for text, ended in texts(tok, rows, PROMPTS):
            assert ended and text in choices, text


def test_eos_only_at_final_states_while_sampling(tiny):
    """WORDS may end after any word: sampled rows end with EOS only where the text is a
    whole match, and they end after different numbers of words (EOS is allowed at every
    final state, not forced at the first one)."""
    model, params, tok = tiny
    host = HostAutomaton(compile_constraint(tok, TINY_VOCAB, regex=WORDS).automaton)
    endings = set()
    for seed in range(6):
        rows = jaxgen.generate_ids(model, params, PROMPTS, tokenizer=tok, regex=WORDS,
                                   max_new_tokens=20, eos_token_id=EOS, do_sample=True,
                                   temperature=100.0, key=jax.random.key(seed))
        for b, row in enumerate(rows):
            ids, ended = new_ids(row, len(PROMPTS[b]), {EOS})
            assert ended and re.fullmatch(WORDS, tok.decode(ids))
            assert host.walk(ids) in host.final
            endings.add(len(tok.decode(ids).split()))
    assert len(endings) > 1


# ------------------------------------------------------------------- host path and parity
@pytest.mark.parametrize("sample", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_prefix_fn_host_path_equals_compiled_automaton(tiny, sample):
    """The same constraint as HF's host function and as the compiled automaton: identical
    tokens, greedy and sampled (same keys, same masked logits)."""
    model, params, tok = tiny
    built = compile_constraint(tok, TINY_VOCAB, regex=WORDS)
    fn = HostAutomaton(built.automaton).prefix_fn([len(p) for p in PROMPTS], [EOS])
    extras = [dict(do_sample=True, temperature=1.5, key=jax.random.key(4))] if sample else [{}]
    for extra in extras:
        common = dict(max_new_tokens=20, eos_token_id=EOS, **extra)
        compiled = jaxgen.generate_ids(model, params, PROMPTS, tokenizer=tok, regex=WORDS,
                                       **common)
        hosted = jaxgen.generate_ids(model, params, PROMPTS, prefix_allowed_tokens_fn=fn,
                                     **common)
        assert compiled == hosted


def test_prefix_fn_matches_transformers_greedy(tiny):
    torch = pytest.importorskip("torch")
    from model_fixtures import hf_from_jaxgen

    model, params, tok = tiny
    hf = hf_from_jaxgen(model, params)
    built = compile_constraint(tok, TINY_VOCAB, regex=WORDS)
    prompt = PROMPTS[0]
    fn = HostAutomaton(built.automaton).prefix_fn([len(prompt)], [EOS])
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                          prefix_allowed_tokens_fn=fn, eos_token_id=EOS, pad_token_id=0,
                          top_k=None, top_p=None, temperature=None)
    expected = out[0].tolist()
    hosted = jaxgen.generate_ids(model, params, [prompt], prefix_allowed_tokens_fn=fn,
                                 max_new_tokens=20, eos_token_id=EOS, pad_token_id=0)[0]
    assert hosted == expected  # and the compiled form equals the host path (test above)
    assert EOS in expected  # the parity covers the EOS decision too


# ------------------------------------------------------------------- compile counts
def test_new_pattern_of_the_same_bucket_does_not_recompile(tiny):
    model, params, tok = tiny
    common = dict(tokenizer=tok, max_new_tokens=20, eos_token_id=EOS)
    jaxgen.generate_ids(model, params, PROMPTS, regex="(ab|the)+", **common)
    before = jaxgen.trace_count()
    rows = jaxgen.generate_ids(model, params, PROMPTS, regex="[0-9]{3}(st|op)", **common)
    jaxgen.generate_ids(model, params, PROMPTS, choices=["stop", "the"], **common)
    assert jaxgen.trace_count() == before
    assert all(re.fullmatch("[0-9]{3}(st|op)", t) for t, _ in texts(tok, rows, PROMPTS))


def test_host_path_compiles_once_for_every_step(tiny):
    model, params, tok = tiny
    fn = lambda batch_id, ids: [ord("a") - 33 + i for i in range(3)] + [EOS]  # noqa: E731
    jaxgen.generate_ids(model, params, PROMPTS, prefix_allowed_tokens_fn=fn,
                        max_new_tokens=20, eos_token_id=EOS)
    before = jaxgen.trace_count()
    jaxgen.generate_ids(model, params, PROMPTS, prefix_allowed_tokens_fn=fn,
                        max_new_tokens=20, eos_token_id=EOS)
    assert jaxgen.trace_count() == before


def test_prebuilt_automaton_through_init_state(tiny):
    """Research code: an automaton built by hand, passed to init_state / generate."""
    model, params, tok = tiny
    # tokens 10 -> 11 -> (12 | EOS), then 12 -> EOS
    aut = from_arrays([0, 1, 2], [10, 11, 12], [1, 2, 3], initial=0, finals=[2, 3],
                      num_states=4, vocab_size=TINY_VOCAB)
    cfg = jaxgen.GenerationConfig(max_new_tokens=20, eos_token_id=EOS)
    state = jaxgen.init_state(model, PROMPTS, cfg, constraint=aut)
    out = jaxgen.generate(params, state, cfg)
    for b, row in enumerate(outputs_to_lists(out)):
        assert row[len(PROMPTS[b]):] in ([10, 11, EOS], [10, 11, 12, EOS])


# ------------------------------------------------------------------- bad input
BAD = [
    (dict(regex="(?=a)b"), "cannot be compiled to a token automaton"),
    (dict(regex=r"(a)\1"), "cannot be compiled"),
    (dict(json_schema={"type": "integer", "minimum": 3}), "keyword 'minimum' is not supported"),
    (dict(json_schema={"type": "string", "format": "ipv4"}), "format 'ipv4' is not supported"),
    (dict(json_schema={"type": "object", "properties": {"a": {"not": {}}}}),
     "#/properties/a: keyword 'not'"),
    (dict(regex="[^\\x00-\\x{10FFFF}]"), "no token sequence"),
    (dict(regex="ab", json_schema={"type": "integer"}), "pass one constraint"),
    (dict(regex="ab", prefix_allowed_tokens_fn=lambda b, ids: [1]), "pass one constraint"),
    (dict(choices="ab"), "`choices` must be a non-empty list"),
    (dict(json_schema="{not json"), "`json_schema` is not valid JSON"),
]


@pytest.mark.parametrize("kwargs,message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_constraints_fail_before_compiling(tiny, kwargs, message):
    model, params, tok = tiny
    before = jaxgen.trace_count()
    with pytest.raises(ValueError, match=re.escape(message)):
        jaxgen.generate_ids(model, params, PROMPTS, tokenizer=tok, max_new_tokens=4,
                            eos_token_id=EOS, **kwargs)
    assert jaxgen.trace_count() == before


def test_constraints_need_a_tokenizer_and_a_supported_mode(tiny):
    model, params, tok = tiny
    before = jaxgen.trace_count()
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        jaxgen.generate_ids(model, params, PROMPTS, regex="ab", max_new_tokens=4)
    fn = lambda batch_id, ids: [EOS]  # noqa: E731
    with pytest.raises(ValueError, match="supports greedy and sampling only"):
        jaxgen.generate_ids(model, params, PROMPTS, prefix_allowed_tokens_fn=fn, num_beams=2,
                            max_new_tokens=4, eos_token_id=EOS)
    with pytest.raises(ValueError, match="must be a callable"):
        jaxgen.generate_ids(model, params, PROMPTS, prefix_allowed_tokens_fn=[1, 2],
                            max_new_tokens=4)
    with pytest.raises(ValueError, match="needs an EOS token"):
        jaxgen.generate_ids(model, params, PROMPTS, tokenizer=tok, regex="ab",
                            max_new_tokens=4, eos_token_id=None)
    with pytest.raises(ValueError, match="built for a vocabulary of 7"):
        jaxgen.init_state(model, PROMPTS, constraint=host_automaton(np.ones((2, 7), bool)))
    assert jaxgen.trace_count() == before
    with pytest.raises(ValueError, match="returned an empty list for batch ID 0"):
        jaxgen.generate_ids(model, params, PROMPTS, max_new_tokens=4, eos_token_id=EOS,
                            prefix_allowed_tokens_fn=lambda batch_id, ids: [])

"""The public stopping-criteria objects (jaxgen.stopping.criteria): Hugging Face's
test_stopping_criteria cases ported, parity with transformers' criteria on the same inputs,
jit-ability, and their use as generate(stopping_criteria=...)."""
from __future__ import annotations

import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers.generation import stopping_criteria as hf

import jaxgen
from jaxgen import stopping
from jaxgen.logits.chain import ProcessorContext
from jaxgen.stopping.criteria import (
    ConfidenceCriteria,
    EosTokenCriteria,
    MaxLengthCriteria,
    MaxTimeCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
    validate_stopping_criteria,
)
from tests.stubs import BigramStub, random_table

B, V = 3, 250


def tensors(length: int, seed: int = 0, width: int = 12):
    """HF's _get_tensors: B rows of `length` random ids (no padding) and uniform scores."""
    rng = np.random.default_rng(seed)
    tokens = np.zeros((B, width), np.int32)
    tokens[:, :length] = rng.integers(0, V, size=(B, length))
    return tokens, np.full((B, V), 1.0 / V, np.float32)


def ctx_of(tokens, length) -> ProcessorContext:
    length = np.broadcast_to(np.asarray(length, np.int32), (tokens.shape[0],))
    return ProcessorContext(tokens=jnp.asarray(tokens), length=jnp.asarray(length),
                            prompt_len=jnp.ones_like(jnp.asarray(length)))


# ---------------------------------------------------------------- HF's cases, ported
def test_list_criteria():
    criteria = StoppingCriteriaList([MaxLengthCriteria(max_length=10),
                                     MaxTimeCriteria(max_time=60.0)])  # HF: 0.1 s
    for length, done in ((5, False), (9, False), (10, True)):
        tokens, scores = tensors(length)
        assert criteria(ctx_of(tokens, length), jnp.asarray(scores)).tolist() == [done] * B


def test_max_length_criteria():
    criteria = MaxLengthCriteria(max_length=10)
    for length, done in ((5, False), (9, False), (10, True)):
        tokens, scores = tensors(length)
        assert criteria(ctx_of(tokens, length), scores).tolist() == [done] * B


def test_max_time_criteria():
    tokens, scores = tensors(5)
    assert MaxTimeCriteria(max_time=60.0)(ctx_of(tokens, 5), scores).tolist() == [False] * B
    late = MaxTimeCriteria(max_time=0.1, initial_timestamp=time.time() - 0.2)
    assert late(ctx_of(tokens, 5), scores).tolist() == [True] * B


def test_eos_token_criteria():
    criteria = EosTokenCriteria(eos_token_id=0)
    tokens, scores = tensors(5)
    tokens[:, 4] = 0
    assert criteria(ctx_of(tokens, 5), scores).tolist() == [True] * B
    tokens[:2, 4], tokens[2, 4] = 0, 1
    assert criteria(ctx_of(tokens, 5), scores).tolist() == [True, True, False]
    tokens[:, 4] = 1
    assert criteria(ctx_of(tokens, 5), scores).tolist() == [False] * B


def test_validate_stopping_criteria():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validate_stopping_criteria(StoppingCriteriaList([MaxLengthCriteria(10)]), 10)
    with pytest.warns(UserWarning):
        kept = validate_stopping_criteria(StoppingCriteriaList([MaxLengthCriteria(10)]), 11)
    assert kept.max_length == 10
    added = validate_stopping_criteria(StoppingCriteriaList(), 11)
    assert len(added) == 1 and added.max_length == 11
    with pytest.raises(ValueError, match="`max_length` must be an int >= 1"):
        validate_stopping_criteria(StoppingCriteriaList(), 0)


# ------------------------------------------------------------ parity with transformers
@pytest.mark.parametrize("length", [1, 4, 7])
def test_length_eos_and_confidence_match_transformers(length):
    rng = np.random.default_rng(length)
    tokens, _ = tensors(length, seed=length)
    tokens[1, length - 1] = 7  # one row ends in EOS 7
    scores = rng.normal(size=(B, V)).astype(np.float32) * 3
    scores[0, tokens[0, length - 1]] = 9.0  # a confident row
    ctx, ids = ctx_of(tokens, length), torch.tensor(tokens[:, :length], dtype=torch.long)
    pairs = [(MaxLengthCriteria(4), hf.MaxLengthCriteria(4)),
             (EosTokenCriteria([7, 9]), hf.EosTokenCriteria([7, 9])),
             (EosTokenCriteria(7, new_token_length=2), None)]
    for ours, theirs in pairs[:2]:
        assert ours(ctx, scores).tolist() == theirs(ids, (torch.tensor(scores),)).tolist()
    two = torch.isin(ids[:, -2:], torch.tensor([7])).any(-1).tolist()
    assert pairs[2][0](ctx, scores).tolist() == two
    for b in range(B):  # HF's ConfidenceCriteria reads row 0 only: run it on each row alone
        theirs = hf.ConfidenceCriteria(0.4)(ids[b:b + 1], (torch.tensor(scores[b:b + 1]),))
        assert ConfidenceCriteria(0.4)(ctx, jnp.asarray(scores))[b] == theirs


@pytest.fixture(scope="module")
def stop_tokenizer():
    """A byte-level BPE whose vocabulary holds HF's example pieces."""
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for piece in ("st", "op", "stop", "opera", "sto", "pper", "las", "topper", "to", "pped",
                  "at", "tion"):
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.BPE(vocab, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok, vocab


# HF's StopStringCriteria docstring: sequences that end the string "stop", and ones that do not.
MATCHING = [["st", "op"], ["stop"], ["st", "opera"], ["sto", "pper"], ["las", "topper"],
            ["s", "to", "pped"]]
NOT_MATCHING = [["stop", "at"], ["st", "op", "at"], ["st", "opera", "tion"]]


def test_stop_string_criteria_matches_transformers(stop_tokenizer):
    from transformers import PreTrainedTokenizerFast
    tok, vocab = stop_tokenizer
    ours = StopStringCriteria(tok, ["stop"])
    theirs = hf.StopStringCriteria(PreTrainedTokenizerFast(tokenizer_object=tok), ["stop"])
    sequences = MATCHING + NOT_MATCHING
    width = max(len(s) for s in sequences) + 2
    tokens = np.zeros((len(sequences), width), np.int32)
    length = np.array([len(s) for s in sequences], np.int32)
    for b, seq in enumerate(sequences):
        tokens[b, :len(seq)] = [vocab[p] for p in seq]
    flags = jax.jit(ours)(ctx_of(tokens, length), None).tolist()
    assert flags == [True] * len(MATCHING) + [False] * len(NOT_MATCHING)
    for b, seq in enumerate(sequences):  # HF on each (unpadded) row alone
        ids = torch.tensor([[vocab[p] for p in seq]])
        assert bool(theirs(ids, None)[0]) == flags[b], seq


def test_criteria_are_jittable_per_row_flags():
    tokens = np.array([[1, 2, 0, 0], [1, 2, 3, 9], [5, 0, 0, 0]], np.int32)
    ctx = ctx_of(tokens, [2, 4, 1])
    criteria = StoppingCriteriaList([MaxLengthCriteria(4), EosTokenCriteria(5),
                                     ConfidenceCriteria(0.9)])
    scores = jnp.zeros((3, 10))  # every probability 0.1 < 0.9: all stop by confidence
    assert jax.jit(lambda c, s: criteria(c, s))(ctx, scores).tolist() == [True, True, True]
    assert jax.jit(MaxLengthCriteria(4))(ctx, scores).tolist() == [False, True, False]
    assert jax.jit(EosTokenCriteria(5))(ctx, scores).tolist() == [False, False, True]
    with pytest.raises(ValueError, match="host clock"):
        jax.jit(MaxTimeCriteria(1.0))(ctx, scores)


@pytest.mark.parametrize("make, needle", [
    (lambda: MaxLengthCriteria(0), "`max_length` must be an int >= 1"),
    (lambda: EosTokenCriteria(-1), "`eos_token_id` must be a non-negative token id"),
    (lambda: EosTokenCriteria([]), "`eos_token_id` must be a non-negative token id"),
    (lambda: EosTokenCriteria(2, new_token_length=0), "`new_token_length`"),
    (lambda: ConfidenceCriteria(1.5), "`assistant_confidence_threshold` must be a float"),
    (lambda: MaxTimeCriteria(0.0), "`max_time` must be a number of seconds > 0"),
])
def test_bad_arguments_are_refused(make, needle):
    with pytest.raises(ValueError, match=needle):
        make()


# ------------------------------------------------------------------ inside generate
def test_generate_takes_a_criteria_list_and_refuses_max_time():
    model, params = BigramStub(vocab_size=16), random_table(16, seed=3)
    cfg = jaxgen.GenerationConfig(max_new_tokens=8)
    criteria = StoppingCriteriaList([MaxLengthCriteria(5)])
    state = jaxgen.init_state(model, [[1, 2], [3, 4, 5]], cfg)
    out = jaxgen.generate(params, state, cfg, stopping_criteria=criteria)
    assert np.asarray(out.lengths).tolist() == [5, 5]
    assert np.asarray(out.stop_reason).tolist() == [stopping.CUSTOM] * 2
    state = jaxgen.init_state(model, [[1, 2]], cfg)
    with pytest.raises(ValueError, match="MaxTimeCriteria .* GenerationConfig\\(max_time="):
        jaxgen.generate(params, state, cfg, stopping_criteria=[MaxTimeCriteria(5.0)])

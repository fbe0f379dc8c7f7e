"""The whole processor chain built from random GenerationConfigs against the chain
transformers builds (`model._get_logits_processor`) from the same settings, row by row."""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxgen.config.generation import GenerationConfig
from jaxgen.logits.chain import ProcessorContext, process_logits

V, T, B = 64, 20, 3


@pytest.fixture(scope="module")
def hf_model():
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config).eval()


def hf_chain(model, fields: dict, prompt_len: int, max_new: int):
    """What `generate()` builds for one row: lengths resolved as in _prepare_generated_length."""
    defaults = transformers.GenerationConfig._get_default_generation_params()
    gen = transformers.GenerationConfig(**{**defaults, **fields})  # what generate() fills in
    gen.max_length = prompt_len + max_new
    if gen.min_new_tokens is not None:
        gen.min_length = gen.min_new_tokens + prompt_len
    eos = fields.get("eos_token_id")
    gen._eos_token_tensor = None if eos is None else torch.tensor(eos).reshape(-1)
    return model._get_logits_processor(generation_config=gen, input_ids_seq_length=prompt_len,
                                       encoder_input_ids=None, prefix_allowed_tokens_fn=None,
                                       logits_processor=transformers.LogitsProcessorList(),
                                       device="cpu", model_kwargs={})


ids = st.integers(0, 9)  # a small alphabet: n-grams, bad words and biases actually match
seqs = st.lists(ids, min_size=1, max_size=3)


@st.composite
def configs(draw):
    eos = draw(st.sampled_from([[2], [2, 5]]))
    f = {"eos_token_id": eos, "do_sample": draw(st.booleans())}
    maybe = lambda strategy: draw(st.one_of(st.none(), strategy))  # noqa: E731
    values = {
        "temperature": maybe(st.floats(0.3, 2.0)),
        "top_k": maybe(st.integers(0, V + 5)),
        "top_p": maybe(st.floats(0.05, 1.0)),
        "min_p": maybe(st.floats(0.0, 0.6)),
        "top_h": maybe(st.floats(0.05, 1.0)),
        "typical_p": maybe(st.floats(0.1, 0.99)),
        "epsilon_cutoff": maybe(st.floats(1e-4, 0.05)),
        "eta_cutoff": maybe(st.floats(1e-4, 0.05)),
        "repetition_penalty": maybe(st.floats(0.5, 2.0)),
        "no_repeat_ngram_size": maybe(st.integers(1, 3)),
        "bad_words_ids": maybe(st.lists(seqs, min_size=1, max_size=4)),
        "min_length": maybe(st.integers(0, T)),
        "min_new_tokens": maybe(st.integers(0, 4)),
        "forced_bos_token_id": maybe(ids),
        "forced_eos_token_id": maybe(st.sampled_from([2, [2, 7]])),
        "remove_invalid_values": maybe(st.booleans()),
        "exponential_decay_length_penalty": maybe(st.tuples(st.integers(0, 3),
                                                            st.floats(0.8, 1.5))),
        "suppress_tokens": maybe(st.lists(st.integers(10, 20), min_size=1, max_size=3)),
        "begin_suppress_tokens": maybe(st.lists(st.integers(10, 20), min_size=1, max_size=3)),
        "sequence_bias": maybe(st.lists(st.tuples(seqs, st.floats(-3, 3)), min_size=1,
                                        max_size=4)),
        "renormalize_logits": maybe(st.booleans()),
    }
    # Keep a value the chain cannot erase: the suppressed ids avoid the forced / EOS ids.
    for key, value in values.items():
        if value is None or draw(st.integers(0, 2)) == 0:  # about a third of fields unset
            continue
        if key == "sequence_bias":
            value = [[list(s), float(b)] for s, b in value]
        f[key] = value
    return f


def random_rows(seed: int):
    rng = np.random.default_rng(seed)
    scores = (rng.normal(size=(B, V)) * 3).astype(np.float32)
    scores[rng.random((B, V)) < 0.05] = -np.inf
    tokens = rng.integers(0, V, size=(B, T)).astype(np.int32)
    length = rng.integers(1, T - 4, size=(B,)).astype(np.int32)
    prompt_len = np.array([rng.integers(1, n + 1) for n in length], np.int32)
    max_new = np.array([length[b] - prompt_len[b] + rng.integers(1, 4) for b in range(B)],
                       np.int32)
    for b in range(B):
        tokens[b, :length[b]] = rng.integers(0, 10, size=length[b])
    return scores, tokens, length, prompt_len, max_new


@settings(max_examples=20, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(fields=configs(), seed=st.integers(0, 2**16), exact=st.booleans())
def test_chain_matches_transformers(hf_model, fields, seed, exact):
    scores, tokens, length, prompt_len, max_new = random_rows(seed)
    cfg = GenerationConfig(**fields, filter_impl="sort" if exact else "search")
    ctx = ProcessorContext(tokens=jnp.asarray(tokens), length=jnp.asarray(length),
                           prompt_len=jnp.asarray(prompt_len), max_new=jnp.asarray(max_new))
    ours = np.asarray(jax.jit(lambda c, s, x: process_logits(c, s, x))(cfg, scores, ctx))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for b in range(B):
            chain = hf_chain(hf_model, fields, int(prompt_len[b]), int(max_new[b]))
            ids = torch.tensor(tokens[b, :length[b]][None], dtype=torch.long)
            want = chain(ids, torch.tensor(scores[b][None]).clone())[0].numpy()
            if np.isnan(want).all():  # every token masked before a softmax: both undefined
                continue
            np.testing.assert_allclose(ours[b], want, rtol=1e-5, atol=1e-5,
                                       err_msg=f"row {b}, fields {fields}")


def test_chain_order_is_hf_order(hf_model):
    """The processor types HF builds for an everything-on config, in order."""
    fields = dict(do_sample=True, eos_token_id=[2], temperature=0.7, top_k=10, top_p=0.9,
                  min_p=0.1, top_h=0.5, typical_p=0.9, epsilon_cutoff=0.01, eta_cutoff=0.01,
                  repetition_penalty=1.2, no_repeat_ngram_size=2, bad_words_ids=[[3]],
                  min_length=3, min_new_tokens=1, forced_bos_token_id=1, forced_eos_token_id=2,
                  remove_invalid_values=True, exponential_decay_length_penalty=(1, 1.1),
                  suppress_tokens=[4], begin_suppress_tokens=[5], sequence_bias=[[[6], 1.0]],
                  renormalize_logits=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        names = [type(p).__name__ for p in hf_chain(hf_model, fields, 3, 5)]
    assert names == [
        "SequenceBiasLogitsProcessor", "RepetitionPenaltyLogitsProcessor",
        "NoRepeatNGramLogitsProcessor", "NoBadWordsLogitsProcessor", "MinLengthLogitsProcessor",
        "MinNewTokensLengthLogitsProcessor", "ForcedBOSTokenLogitsProcessor",
        "ForcedEOSTokenLogitsProcessor", "InfNanRemoveLogitsProcessor",
        "ExponentialDecayLengthPenalty", "SuppressTokensLogitsProcessor",
        "SuppressTokensAtBeginLogitsProcessor", "TemperatureLogitsWarper", "TopHLogitsWarper",
        "TopKLogitsWarper",
        "TopPLogitsWarper", "MinPLogitsWarper", "TypicalLogitsWarper", "EpsilonLogitsWarper",
        "EtaLogitsWarper", "LogitNormalization"]

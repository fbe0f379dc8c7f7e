"""Long forwards over a dense block read it query block by query block, skipping the key
chunks no query of a block can see (jaxgen.cache.attention._attend_query_blocks): the same
attention as one softmax over every key, for any positions, windows and batch offsets."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxgen
from jaxgen.cache import attention
from jaxgen.cache.dense import attend_dense
from jaxgen.core.step import prefill_tokens
from jaxgen.models import tiny_llama


def _attend(q, k, v, positions, window, blocked: bool, monkeypatch) -> jax.Array:
    with monkeypatch.context() as patch:
        patch.setattr(attention, "CAUSAL_MIN_QUERIES", 1 if blocked else 10**9)
        patch.setattr(attention, "QUERY_BLOCK", 8)
        patch.setattr(attention, "CAUSAL_KEY_CHUNK", 16)
        return jax.jit(lambda *a: attend_dense(*a, scale=0.3, window=window))(
            q, k, v, positions)  # [B, S, H, Dh]


@pytest.mark.parametrize("seq, keys, offsets, window", [
    (40, 41, (0,), None),          # a prefill: 5 query blocks, the last key chunk overlapping
    (37, 90, (0, 23), None),       # rows at different offsets, a padded last query block
    (50, 70, (3, 20), 9),          # sliding window: chunks below the window skipped too
    (20, 12, (0,), None),          # fewer keys than a chunk; positions past the keys
    (9, 200, (150,), None),        # a late piece of a chunked prefill
])
def test_query_blocks_equal_one_softmax(seq, keys, offsets, window, monkeypatch):
    rng = np.random.default_rng(seq + keys)
    batch = len(offsets)
    q = jnp.asarray(rng.standard_normal((batch, seq, 6, 8)), jnp.float32)  # [B, S, H, Dh]
    k = jnp.asarray(rng.standard_normal((batch, 2, keys, 8)), jnp.float32)  # [B, Hkv, T, Dh]
    v = jnp.asarray(rng.standard_normal((batch, 2, keys, 8)), jnp.float32)  # [B, Hkv, T, Dh]
    positions = jnp.asarray([o + np.arange(seq) for o in offsets], jnp.int32)  # [B, S]
    whole = _attend(q, k, v, positions, window, False, monkeypatch)
    blocked = _attend(q, k, v, positions, window, True, monkeypatch)
    seen = positions < keys  # [B, S]: queries past the last key see the whole cache
    np.testing.assert_allclose(np.asarray(blocked)[np.asarray(seen)],
                               np.asarray(whole)[np.asarray(seen)], rtol=2e-5, atol=2e-6)


def test_query_blocks_never_read_chunks_past_the_last_query(monkeypatch):
    """Keys from the chunk after the last query position on hold NaN: one softmax over every
    key multiplies them by weight 0 (NaN), the blocked read never loads them."""
    q = jnp.ones((1, 32, 2, 4))  # [B, S, H, Dh]
    k = jnp.ones((1, 1, 96, 4)).at[:, :, 48:].set(jnp.nan)  # [B, Hkv, T, Dh]
    v = jnp.ones((1, 1, 96, 4)).at[:, :, 48:].set(jnp.nan)  # [B, Hkv, T, Dh]
    positions = jnp.arange(32, dtype=jnp.int32)[None]  # [1, S]: the last query at 31
    assert bool(jnp.isnan(_attend(q, k, v, positions, None, False, monkeypatch)).any())
    blocked = _attend(q, k, v, positions, None, True, monkeypatch)
    np.testing.assert_allclose(np.asarray(blocked), 1.0, rtol=1e-6)


def _prefill(model, params, prompt, chunk, blocked: bool, monkeypatch):
    """(logits [1, V] of the last prompt token, the filled cache) of a prefill run with the
    blocked read switched on from 32 queries, or off."""
    with monkeypatch.context() as patch:
        patch.setattr(attention, "CAUSAL_MIN_QUERIES", 32 if blocked else 10**9)
        patch.setattr(attention, "QUERY_BLOCK", 16)
        patch.setattr(attention, "CAUSAL_KEY_CHUNK", 32)
        tokens = jnp.asarray([prompt + [0] * 10], jnp.int32)  # [1, P]: right-padded
        cache = model.init_cache(1, tokens.shape[1] + 8)
        return jax.jit(lambda p, t, c: prefill_tokens(
            model, p, t, jnp.asarray([len(prompt)]), c, chunk))(params, tokens, cache)


@pytest.mark.parametrize("chunk", [None, 40])
def test_long_prefill_blocked_equals_whole(chunk, monkeypatch):
    """A tiny model's 70-token prefill, whole or in pieces of 40 (prefill_chunk_size): the
    same last-token logits and cached keys/values with the blocked read as with one softmax."""
    model, params = tiny_llama()
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, model.vocab_size, 70)]
    whole_cache, whole_logits = _prefill(model, params, prompt, chunk, False, monkeypatch)
    cache, logits = _prefill(model, params, prompt, chunk, True, monkeypatch)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(whole_logits), rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(np.asarray(cache.k), np.asarray(whole_cache.k), atol=1e-5)
    np.testing.assert_allclose(np.asarray(cache.v), np.asarray(whole_cache.v), atol=1e-5)


@pytest.mark.slow
def test_long_prompt_generates_the_same_tokens_blocked_and_whole(monkeypatch):
    """A tiny model's greedy run over a 70-token prompt, whole and chunked prefill, with the
    blocked read switched on from 32 queries: the tokens of one softmax over every key."""
    model, params = tiny_llama()
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, model.vocab_size, 70)]

    def tokens(min_queries: int, chunk: int | None) -> np.ndarray:
        with monkeypatch.context() as patch:
            patch.setattr(attention, "CAUSAL_MIN_QUERIES", min_queries)
            patch.setattr(attention, "QUERY_BLOCK", 16)
            patch.setattr(attention, "CAUSAL_KEY_CHUNK", 32)
            jax.clear_caches()
            cfg = jaxgen.GenerationConfig(max_new_tokens=6, pad_token_id=0,
                                          prefill_chunk_size=chunk)
            return np.asarray(jaxgen.generate(params, jaxgen.init_state(model, [prompt], cfg),
                                              cfg).sequences)

    whole = tokens(10**9, None)
    np.testing.assert_array_equal(tokens(32, None), whole)
    np.testing.assert_array_equal(tokens(32, 40), whole)  # pieces of 40 run the blocked read
    jax.clear_caches()


@pytest.mark.parametrize("arch, overrides", [
    ("mistral", dict(num_key_value_heads=2, sliding_window=100)),
    pytest.param("llama", dict(num_key_value_heads=2), marks=pytest.mark.slow)])
def test_long_prompts_match_transformers(arch, overrides, tmp_path):
    """Ragged 600- and 530-token prompts (blocked prefill reads, a sliding window's lower
    edge for Mistral) generate transformers' greedy tokens, fp32."""
    from model_fixtures import hf_generate_rows, make_hf_model, save_hf_model

    from jaxgen.models import load

    hf = make_hf_model(arch, seed=3, max_position_embeddings=1024, **overrides)
    model, params, _ = load(save_hf_model(hf, str(tmp_path)))
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(3, 96, n)] for n in (600, 530)]
    expected = hf_generate_rows(hf, prompts, 0, max_new_tokens=8, do_sample=False,
                                eos_token_id=2, top_k=None, top_p=None, temperature=None)
    got = jaxgen.generate_ids(model, params, prompts, max_new_tokens=8, eos_token_id=2,
                              pad_token_id=0)
    assert got == expected


@pytest.mark.slow
def test_long_prompt_matches_transformers_on_smollm2():
    """A 700-token English prompt on the embedded SmolLM2: transformers' greedy tokens."""
    from model_fixtures import hf_generate_rows, smollm2_pair

    model, params, tokenizer, hf = smollm2_pair()
    text = ("The river town kept a ledger of every boat that passed its bridge, with the "
            "cargo, the crew and the weather of the day. ")
    prompt = (tokenizer.encode(text) * 40)[:700]
    expected = hf_generate_rows(hf, [prompt], 0, max_new_tokens=12, do_sample=False,
                                eos_token_id=None, top_k=None, top_p=None, temperature=None)
    assert jaxgen.generate_ids(model, params, [prompt], max_new_tokens=12,
                               pad_token_id=0) == expected

"""jaxgen.cache.layer_forms: a cache held as one buffer per layer reads and writes what the
stacked cache does for every kind, a compiled generate with per-layer weights (the CPU backend,
layout="split") carries it per layer (no per-step slice copies) and hands the caller back the
stacked layout, and the tokens match the portable program's."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxgen
from jaxgen.cache import make_cache
from jaxgen.cache.layer_forms import (
    holds_layer_tuples,
    to_layer_tuples,
    to_stacked_layers,
)
from jaxgen.models import tiny_llama

KINDS = [("static", None), ("dynamic", None), ("quantized", {"nbits": 8, "residual_length": 2}),
         ("quantized", {"nbits": 4, "q_group_size": 4}), ("sliding_window", {"sliding_window": 4}),
         ("offloaded", None)]


@pytest.mark.parametrize("kind,config", [  # the default run: the ring-holding kinds
    kind if kind[0] in ("sliding_window",) or "residual_length" in (kind[1] or {})
    else pytest.param(*kind, marks=pytest.mark.slow) for kind in KINDS])
def test_a_split_cache_writes_and_reads_what_the_stacked_one_does(kind, config):
    shape = dict(num_layers=2, batch=2, max_len=8, num_kv_heads=2, head_dim=8)
    stacked = make_cache(kind, **shape, cache_config=config)
    split = to_layer_tuples(stacked)
    keys = jax.random.normal(jax.random.key(0), (4, 2, 3, 2, 8))  # [chunk, B, S, Hkv, Dh]
    q = jax.random.normal(jax.random.key(1), (2, 3, 4, 8))  # [B, S, H, Dh]
    for chunk in range(2):
        positions = jnp.arange(3 * chunk, 3 * chunk + 3)[None].repeat(2, 0)  # [B, S]
        for layer in (1, 0):
            k, v = keys[2 * chunk], keys[2 * chunk + 1]
            want, stacked = stacked.update_attend(layer, q, k, v, positions, scale=0.3)
            got, split = split.update_attend(layer, q, k, v, positions, scale=0.3)
            np.testing.assert_allclose(got, want, atol=1e-6)
        stacked = stacked.with_length(positions[:, -1] + 1)
        split = split.with_length(positions[:, -1] + 1)
    assert split.max_len == stacked.max_len and split.batch == stacked.batch
    assert split.nbytes() == stacked.nbytes()
    if kind != "offloaded" or getattr(stacked, "memory_kind", None) is None:
        assert holds_layer_tuples(split) and not holds_layer_tuples(stacked)
    back = to_stacked_layers(split)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(stacked)
    for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(stacked)):
        np.testing.assert_array_equal(a, b)
    if hasattr(stacked, "resize"):  # the growing driver resizes a split cache between chunks
        grown = to_stacked_layers(split.resize(12))
        for a, b in zip(jax.tree_util.tree_leaves(grown),
                        jax.tree_util.tree_leaves(stacked.resize(12))):
            np.testing.assert_array_equal(a, b)


def test_a_split_cache_needs_a_static_layer():
    cache = to_layer_tuples(make_cache("static", num_layers=2, batch=1, max_len=4,
                                       num_kv_heads=1, head_dim=2))
    new = jnp.ones((1, 1, 1, 2))  # [B, S, Hkv, Dh]
    with pytest.raises(TypeError, match="static layer index"):
        jax.jit(lambda c, layer: c.update(layer, new, new, jnp.zeros((1, 1), jnp.int32)))(
            cache, 0)


def test_stacked_weights_over_a_split_cache_run_unrolled():
    model, params = tiny_llama(num_layers=3)
    tokens, positions = jnp.array([[3, 1, 4, 1]]), jnp.arange(4)[None]  # [1, 4]
    want = model(params, tokens, positions, model.init_cache(1, 6))
    got = model(params, tokens, positions, to_layer_tuples(model.init_cache(1, 6)))
    np.testing.assert_allclose(got.logits, want.logits, atol=1e-5)
    np.testing.assert_allclose(to_stacked_layers(got.cache).k, want.cache.k, atol=1e-6)


def _generate(monkeypatch, layout, cfg, prompts):
    """generate(..., layout=layout) (no jit cache cleared: the layout is a static argument):
    (output, the kinds the CPU backend converted to per-layer buffers)."""
    from jaxgen.backends.cpu import prepare

    model, params = tiny_llama(num_layers=3, intermediate_size=40)
    calls = []
    real = to_layer_tuples
    monkeypatch.setattr(prepare, "to_layer_tuples",
                        lambda c: calls.append(type(c).__name__) or real(c))
    state = jaxgen.init_state(model, prompts, cfg, key=jax.random.key(3))
    out = jaxgen.generate(params, state, cfg, layout=layout)
    return out, calls


@pytest.mark.parametrize("settings", [
    dict(max_new_tokens=5),
    pytest.param(dict(max_new_tokens=5, do_sample=True, top_k=5), marks=pytest.mark.slow),
    pytest.param(dict(max_new_tokens=6, cache_implementation="quantized",
                      cache_config={"nbits": 8}), marks=pytest.mark.slow),
    dict(max_new_tokens=6, prompt_lookup_num_tokens=2),
    pytest.param(dict(max_new_tokens=9, cache_implementation="dynamic"),
                 marks=pytest.mark.slow),
])
def test_generate_carries_the_cache_split_and_returns_it_stacked(monkeypatch, settings):
    cfg = jaxgen.GenerationConfig(**settings)
    prompts = [[3, 1, 4, 1, 3, 1], [1, 5]]
    split, calls = _generate(monkeypatch, "split", cfg, prompts)
    stacked, stacked_calls = _generate(monkeypatch, "portable", cfg, prompts)
    assert calls and not stacked_calls  # split only with per-layer weights
    np.testing.assert_array_equal(split.sequences, stacked.sequences)
    assert not holds_layer_tuples(split.state.cache)  # the caller's layout
    assert jax.tree_util.tree_structure(split.state.cache) == jax.tree_util.tree_structure(
        stacked.state.cache)


def test_streaming_chunks_carry_the_split_cache_without_retracing(monkeypatch):
    import threading

    jax.clear_caches()  # nothing compiled by earlier tests: the count below is this call's
    model, params = tiny_llama(num_layers=3, intermediate_size=40)
    cfg = jaxgen.GenerationConfig(max_new_tokens=12)
    prompts = [[3, 1, 4], [1, 5, 9]]
    whole = jaxgen.generate(params, jaxgen.init_state(model, prompts, cfg), cfg, layout="split")
    before = jaxgen.trace_count()
    chunked = jaxgen.generate(params, jaxgen.init_state(model, prompts, cfg), cfg, chunk_size=3,
                              stop_event=threading.Event(), layout="split")
    assert jaxgen.trace_count() - before == 2  # start + one advance program for every chunk
    np.testing.assert_array_equal(chunked.sequences, whole.sequences)
    assert not holds_layer_tuples(chunked.state.cache)

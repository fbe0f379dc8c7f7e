"""The cache family: rollback by length for every kind (property test), the kinds end to end,
offload, the KVCache API, and clear errors for bad cache settings."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxgen
from jaxgen.cache import CACHE_KINDS, KVCache, check_rollback, make_cache
from jaxgen.config.generation import GenerationConfig
from jaxgen.models import Llama, LlamaConfig

TINY = dict(vocab_size=48, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=8)
MODEL = Llama(LlamaConfig(**TINY))
WINDOW_MODEL = Llama(LlamaConfig(**TINY, sliding_window=6))
BUCKET, MAX_LEN = 16, 48
# kind name -> (model, cache_implementation, cache_config)
KINDS = {
    "static": (MODEL, "static", None),
    "dynamic": (MODEL, "dynamic", None),
    "quantized": (MODEL, "quantized", None),
    "quantized_residual": (MODEL, "quantized", {"residual_length": 3, "rollback_slack": 16}),
    "quantized_4bit": (MODEL, "quantized", {"nbits": 4, "q_group_size": 4}),
    "quantized_unrotated": (MODEL, "quantized", {"rotate": False}),
    "sliding_window": (WINDOW_MODEL, "sliding_window", {"rollback_slack": 16}),
    "static_windowed": (WINDOW_MODEL, "static", None),
    "offloaded": (MODEL, "offloaded", {"offload_on_cpu": True}),
}


def _params(model):
    return model.init_params(jax.random.key(0))


PARAMS = {id(MODEL): None, id(WINDOW_MODEL): None}


def params_for(model):
    if PARAMS[id(model)] is None:
        PARAMS[id(model)] = _params(model)
    return PARAMS[id(model)]


_FORWARD = {}


def forward_for(model):
    if id(model) not in _FORWARD:
        _FORWARD[id(model)] = jax.jit(lambda p, t, pos, c: model(p, t, pos, c))
    return _FORWARD[id(model)]


def prefill(model, kind, cache_config, prompt):
    """Right-padded prefill of one prompt, as jaxgen.loops.decode does (then length = prompt)."""
    cache = model.init_cache(1, MAX_LEN, kind=kind, cache_config=cache_config)
    tokens = np.zeros((1, BUCKET), np.int32)
    tokens[0, :len(prompt)] = prompt
    out = forward_for(model)(params_for(model), jnp.asarray(tokens),
                             jnp.arange(BUCKET, dtype=jnp.int32)[None], cache)
    return out.cache.with_length(jnp.array([len(prompt)])), np.asarray(out.logits[0, len(prompt) - 1])


def step(model, cache, token, position):
    out = forward_for(model)(params_for(model), jnp.asarray([[token]], jnp.int32),
                             jnp.asarray([[position]], jnp.int32), cache)
    return out.cache, np.asarray(out.logits[0, 0])


def greedy_steps(model, cache, logits, position, n):
    tokens, all_logits = [], []
    for i in range(n):
        token = int(np.argmax(logits))
        cache, logits = step(model, cache, token, position + i)
        tokens.append(token)
        all_logits.append(logits)
    return cache, logits, tokens, all_logits


@pytest.mark.parametrize("name", sorted(KINDS))
@settings(max_examples=6, deadline=None, derandomize=True)
@given(prompt_len=st.integers(1, BUCKET), n=st.integers(1, 20), k=st.integers(1, 8),
       seed=st.integers(0, 2 ** 16))
def test_rollback_then_regenerate_equals_a_fresh_run(name, prompt_len, n, k, seed):
    """Generate n - k greedy tokens, feed k rejected drafts, roll back k, regenerate k:
    the tokens and logits equal a fresh greedy run of n tokens."""
    model, kind, cache_config = KINDS[name]
    k = min(k, n)
    rng = np.random.default_rng(seed)
    prompt = rng.integers(1, 48, size=prompt_len).tolist()
    cache, logits = prefill(model, kind, cache_config, prompt)
    _, _, fresh_tokens, fresh_logits = greedy_steps(model, cache, logits, prompt_len, n)

    cache, logits = prefill(model, kind, cache_config, prompt)
    cache, logits, tokens, _ = greedy_steps(model, cache, logits, prompt_len, n - k)
    saved = logits
    for i, draft in enumerate(rng.integers(0, 48, size=k).tolist()):  # rejected drafts
        cache, _ = step(model, cache, draft, prompt_len + n - k + i)
    assert int(cache.length[0]) == prompt_len + n
    check_rollback(cache, k)
    cache = cache.rollback(k)
    assert int(cache.length[0]) == prompt_len + n - k
    _, _, again, again_logits = greedy_steps(model, cache, saved, prompt_len + n - k, k)
    assert tokens + again == fresh_tokens
    np.testing.assert_array_equal(np.stack(again_logits), np.stack(fresh_logits[n - k:]))
    assert not bool(np.any(getattr(cache, "lost", False)))


@pytest.mark.parametrize("name", sorted(KINDS))
def test_every_kind_generates_end_to_end(name):
    model, kind, cache_config = KINDS[name]
    params = params_for(model)
    prompts = [[3, 4, 5, 6, 7], [9, 10]]
    cfg = GenerationConfig(max_new_tokens=30, cache_implementation=kind,
                           cache_config=cache_config)
    out = jaxgen.generate(params, jaxgen.init_state(model, prompts, cfg), cfg)
    ref_cfg = GenerationConfig(max_new_tokens=30)
    ref = jaxgen.generate(params, jaxgen.init_state(model, prompts, ref_cfg), ref_cfg)
    assert out.state.cache.kind == kind
    if kind in ("static", "dynamic", "offloaded", "sliding_window"):  # exact kinds
        np.testing.assert_array_equal(out.sequences, ref.sequences)
    else:
        assert np.mean(np.asarray(out.sequences) == np.asarray(ref.sequences)) > 0.5


def test_offload_keeps_the_cache_in_host_memory_and_is_a_noop_on_cpu():
    cache = MODEL.init_cache(2, 16, kind="offloaded", cache_config={"offload_on_cpu": True})
    assert cache.memory_kind == "pinned_host"
    assert cache.k.sharding.memory_kind == "pinned_host"
    cfg = GenerationConfig(max_new_tokens=8, cache_implementation="offloaded",
                           cache_config={"offload_on_cpu": True})
    out = jaxgen.generate(params_for(MODEL), jaxgen.init_state(MODEL, [[1, 2, 3]], cfg), cfg)
    assert out.state.cache.k.sharding.memory_kind == "pinned_host"
    default = MODEL.init_cache(2, 16, kind="offloaded")
    if jax.devices()[0].platform == "cpu":
        assert default.memory_kind is None  # CPU: a no-op, the static cache


def test_kvcache_api_unchanged():
    cache = KVCache.init(num_layers=2, batch=2, max_len=8, num_kv_heads=1, head_dim=4)
    assert cache.k.shape == (2, 2, 1, 8, 4) and cache.max_len == 8 and cache.batch == 2
    k = jnp.ones((2, 3, 1, 4))
    cache = cache.update(1, k, 2 * k, jnp.broadcast_to(jnp.arange(3), (2, 3)))
    assert float(cache.v[1, 0, 0, 2, 0]) == 2.0 and float(cache.k[0].sum()) == 0.0
    out = cache.attend(1, jnp.ones((2, 1, 2, 4)), jnp.array([[2], [2]]), scale=0.5)
    np.testing.assert_allclose(out, 2.0)
    cache = cache.with_length(jnp.array([3, 3]))
    assert cache.rollback(jnp.array([1, 2])).length.tolist() == [2, 1]
    assert cache.nbytes() == 2 * 2 * 2 * 8 * 4 * 4 + 2 * 4
    with pytest.raises(ValueError, match="cannot roll back"):
        cache.rollback(4)
    assert set(CACHE_KINDS) == {"static", "dynamic", "quantized", "sliding_window", "offloaded"}


@pytest.mark.parametrize("fields,match", [
    (dict(cache_implementation="paged"), "unknown cache_implementation"),
    (dict(cache_implementation="quantized", cache_config={"nbits": 2}), "nbits"),
    (dict(cache_implementation="quantized", cache_config={"nbits": 16}), "nbits"),
    (dict(cache_implementation="quantized", cache_config={"axis_key": 1}), "allowed keys"),
    (dict(cache_implementation="quantized", cache_config={"backend": "quanto"}), "backend"),
    (dict(cache_implementation="quantized", cache_config={"residual_length": -1}), ">= 0"),
    (dict(cache_implementation="quantized", cache_config={"rotate": 1}), "rotate"),
    (dict(cache_config={"nbits": 8}), "needs `cache_implementation`"),
    (dict(cache_implementation="dynamic", num_beams=2), "beam"),
    (dict(cache_implementation="dynamic", cache_config={"chunk_size": 0}), "chunk_size"),
    (dict(cache_implementation="sliding_window", cache_config={"sliding_window": 0}), ">= 1"),
    (dict(cache_implementation="offloaded", cache_config={"memory_kind": "hbm"}), "memory_kind"),
])
def test_bad_cache_settings_raise_clear_errors(fields, match):
    with pytest.raises(ValueError, match=match):
        GenerationConfig(**fields)


def test_bad_cache_shapes_raise_clear_errors():
    with pytest.raises(ValueError, match="divide head_dim"):
        MODEL.init_cache(1, 8, kind="quantized", cache_config={"q_group_size": 3})
    with pytest.raises(ValueError, match="unknown cache kind"):
        MODEL.init_cache(1, 8, kind="paged")
    with pytest.raises(ValueError, match="needs a window"):
        make_cache("sliding_window", num_layers=1, batch=1, max_len=8, num_kv_heads=1,
                   head_dim=4)

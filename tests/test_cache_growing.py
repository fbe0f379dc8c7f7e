"""The growing cache (cache_implementation="dynamic"): identical outputs, bytes follow length."""
from __future__ import annotations

import jax
import numpy as np
import pytest

import jaxgen
from jaxgen.api.generate import canonical_config
from jaxgen.config.generation import GenerationConfig
from jaxgen.drivers.growing import run_growing
from jaxgen.models import Llama, LlamaConfig

MODEL = Llama(LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=48, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=8))
PROMPTS = [[3, 4, 5, 6, 7, 8, 9], [11, 12]]
GROW = {"initial_length": 32, "chunk_size": 16}


@pytest.mark.slow
def test_growing_outputs_identical_to_static():
    params = MODEL.init_params(jax.random.key(0))
    static = GenerationConfig(max_new_tokens=120, do_sample=True, temperature=0.8)
    dynamic = static.replace(cache_implementation="dynamic", cache_config=GROW)
    ref = jaxgen.generate(params, jaxgen.init_state(MODEL, PROMPTS, static, jax.random.key(3)),
                          static)
    out = jaxgen.generate(params, jaxgen.init_state(MODEL, PROMPTS, dynamic, jax.random.key(3)),
                          dynamic)
    np.testing.assert_array_equal(out.sequences, ref.sequences)
    np.testing.assert_array_equal(out.lengths, ref.lengths)
    np.testing.assert_allclose(out.token_logprobs, ref.token_logprobs, rtol=1e-5, atol=1e-5)
    # grew 32 -> 64 -> 128: the longest row (7 + 120 tokens) never writes past position 125,
    # so the cache stops short of the 136-token buffer (16 + 120)
    assert out.state.cache.max_len == 128 < out.sequences.shape[1] == 136


def test_peak_cache_bytes_track_the_real_length():
    params = MODEL.init_params(jax.random.key(0))
    budget = 400  # the static cache is sized for the whole budget up front
    cfg = GenerationConfig(max_new_tokens=budget, cache_implementation="dynamic",
                           cache_config=GROW)
    # Rows stop after 60 tokens, but the buffer is sized for the whole budget.
    state = jaxgen.init_state(MODEL, PROMPTS, cfg, max_new_tokens=[60, 60],
                              buffer_len=16 + budget)
    static_bytes = MODEL.init_cache(2, state.buffer_len).nbytes()
    assert state.cache.max_len == 32
    final, _, log = run_growing(params, state, canonical_config(cfg))
    assert int(np.max(final.length)) == 7 + 60
    capacities = [info.capacity for info in log]
    assert capacities == sorted(capacities) and capacities[-1] == 128
    for info in log[1:]:
        needed = info.max_length + GROW["chunk_size"] - 1
        assert needed <= info.capacity <= max(2 * needed, 32)
    per_position = static_bytes / state.buffer_len
    peak = max(info.cache_bytes for info in log)
    assert peak <= 2 * (67 + GROW["chunk_size"]) * per_position + 64
    assert peak < static_bytes / 3

"""Sliding-window attention: the ring-buffer cache and the masked dense cache vs transformers'
MistralForCausalLM (random weights, sliding_window=8, generations longer than the window)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from model_fixtures import (
    assert_logits_close,
    hf_greedy_logits,
    make_hf_model,
    save_hf_model,
)

import jaxgen
from jaxgen.api.generate import outputs_to_lists
from jaxgen.cache import SlidingWindowCache, check_rollback, raise_if_lost
from jaxgen.config.generation import GenerationConfig
from jaxgen.models.hf_checkpoint import load_hf_checkpoint

WINDOW = 8
PROMPT = [5, 17, 33, 2, 60, 61, 8, 90, 44, 3, 12]  # longer than the window


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    hf = make_hf_model("mistral", num_key_value_heads=2, sliding_window=WINDOW)
    folder = str(tmp_path_factory.mktemp("mistral_window"))
    save_hf_model(hf, folder)
    model, params = load_hf_checkpoint(folder)
    assert model.config.sliding_window == WINDOW
    return hf, model, params


def jax_logits(model, params, prompt, steps, kind, cache_config=None, tokens_from=None):
    """Prefill + cached greedy steps with a cache of `kind` (one jit per call shape)."""
    forward = jax.jit(lambda p, t, pos, c: model(p, t, pos, c))
    cache = model.init_cache(1, len(prompt) + steps + 1, kind=kind, cache_config=cache_config)
    out = forward(params, jnp.asarray([prompt], jnp.int32),
                  jnp.arange(len(prompt), dtype=jnp.int32)[None], cache)
    logits, cache = [np.asarray(out.logits[0])], out.cache
    for step in range(steps):
        ref = tokens_from[step] if tokens_from is not None else logits[-1]
        token = int(np.argmax(ref[-1] if ref.ndim == 2 else ref))
        out = forward(params, jnp.asarray([[token]], jnp.int32),
                      jnp.asarray([[len(prompt) + step]], jnp.int32), cache)
        logits.append(np.asarray(out.logits[0, -1]))
        cache = out.cache
    return logits, cache


@pytest.mark.parametrize("kind", ["static", "sliding_window"])
def test_logits_match_hf_mistral_past_the_window(mistral, kind):
    hf, model, params = mistral
    steps = 3 * WINDOW
    expected = hf_greedy_logits(hf, PROMPT, steps=steps)
    actual, cache = jax_logits(model, params, PROMPT, steps, kind,
                               {"rollback_slack": 2} if kind == "sliding_window" else None,
                               tokens_from=expected)
    if kind == "sliding_window":
        assert cache.max_len == WINDOW + 2  # O(window) memory, not O(length)
        assert not bool(cache.lost.any())
    for a, b in zip(actual, expected):
        assert_logits_close(a, b)


@pytest.mark.parametrize("kind", ["static", "sliding_window"])
def test_greedy_generate_matches_hf_mistral(mistral, kind):
    hf, model, params = mistral
    prompts = [PROMPT, [9, 4, 77, 31]]
    new = 3 * WINDOW
    cfg = GenerationConfig(max_new_tokens=new, cache_implementation=kind, eos_token_id=None,
                           pad_token_id=0)
    out = jaxgen.generate(params, jaxgen.init_state(model, prompts, cfg), cfg)
    got = outputs_to_lists(out)
    for row, prompt in zip(got, prompts):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        assert row == ref[0].tolist()
    if kind == "sliding_window":
        assert out.state.cache.max_len < out.sequences.shape[1]
        raise_if_lost(out.state.cache)


def test_ring_rollback_within_slack_and_clear_errors_past_it():
    cache = SlidingWindowCache.init(num_layers=1, batch=1, max_len=64, num_kv_heads=1,
                                    head_dim=2, window=4, rollback_slack=2)  # 6 slots
    k = jnp.ones((1, 20, 1, 2))
    cache = cache.update(0, k, k, jnp.arange(20)[None]).with_length(jnp.array([20]))
    assert int(cache.max_rollback()[0]) == 3  # slack + 1
    check_rollback(cache, 3)
    ok = cache.rollback(3)
    assert int(ok.length[0]) == 17 and not bool(ok.lost[0])
    with pytest.raises(ValueError, match="rollback_slack"):
        cache.rollback(4)
    # Under jit nothing can raise: the row is flagged, and the host check raises afterwards.
    flagged = jax.jit(lambda c: c.with_length(c.length - 5))(cache)
    assert bool(flagged.lost[0])
    with pytest.raises(ValueError, match="rolled back past"):
        raise_if_lost(flagged)


def test_sliding_window_kind_needs_a_window():
    model = jaxgen.models.Llama(jaxgen.models.LlamaConfig(
        vocab_size=16, hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2,
        num_kv_heads=1, head_dim=4))
    with pytest.raises(ValueError, match="needs a window"):
        model.init_cache(1, 8, kind="sliding_window")
    cache = model.init_cache(1, 32, kind="sliding_window", cache_config={"sliding_window": 4})
    assert cache.max_len == 4

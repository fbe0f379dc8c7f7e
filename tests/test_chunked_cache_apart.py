"""The chunked driver holds the cache one buffer per layer between its programs where the CPU
backend runs it so (per-layer weights): every chunk's program gets and returns the per-layer
form (no split and stack copies of the whole cache a chunk), the caller gets the stacked cache
back, and the tokens are the single call's."""
from __future__ import annotations

import jax
import numpy as np
import pytest

import jaxgen
from jaxgen.cache.layer_forms import holds_layer_tuples
from jaxgen.drivers.streamers import BaseStreamer
from jaxgen.models import tiny_llama
from jaxgen.runtime import compiled

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU backend's layout")


class Collect(BaseStreamer):
    def __init__(self):
        super().__init__()
        self.tokens = []

    def put(self, value):
        self.tokens.extend(np.asarray(value).reshape(-1).tolist())

    def end(self):
        pass


def _spy(monkeypatch):
    """Records, for each start / advance call, whether its state came in per layer."""
    seen = []
    for name in ("start", "advance"):
        original = getattr(compiled, name)

        def spy(params, state, *args, _original=original, _name=name, **kwargs):
            seen.append((_name, holds_layer_tuples(state.cache)))
            return _original(params, state, *args, **kwargs)

        monkeypatch.setattr(compiled, name, spy)
    return seen


@pytest.mark.parametrize("kind, do_sample", [("static", False), ("static", True),
                                              ("quantized", False)])
def test_chunks_hold_the_cache_per_layer_and_give_back_the_stacked_one(monkeypatch, kind,
                                                                       do_sample):
    model, params = tiny_llama(num_layers=3)
    cfg = jaxgen.GenerationConfig(max_new_tokens=9, do_sample=do_sample, top_k=0,
                                  cache_implementation=kind)
    prompts = [[3, 4, 5], [6, 7, 8]]

    def state():
        return jaxgen.init_state(model, prompts, cfg, key=jax.random.key(1))

    want = jaxgen.generate(params, state(), cfg, layout="split")
    seen = _spy(monkeypatch)
    streamers = [Collect(), Collect()]
    got = jaxgen.generate(params, state(), cfg, layout="split", streamer=streamers, chunk_size=3)
    assert [name for name, _ in seen] == ["start", "advance", "advance", "advance"]
    assert all(apart for _, apart in seen)  # every program: the per-layer form
    np.testing.assert_array_equal(got.sequences, want.sequences)
    assert type(got.state.cache) is type(want.state.cache)
    assert not holds_layer_tuples(got.state.cache)  # the caller's stacked layout
    for a, b in zip(jax.tree_util.tree_leaves(got.state.cache),
                    jax.tree_util.tree_leaves(want.state.cache)):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(a, b, atol=1e-6)
    assert streamers[0].tokens == np.asarray(want.sequences[0, :3 + 9]).tolist()


def test_the_portable_layout_keeps_the_stacked_cache(monkeypatch):
    model, params = tiny_llama(num_layers=2)
    cfg = jaxgen.GenerationConfig(max_new_tokens=5)
    seen = _spy(monkeypatch)
    jaxgen.generate(params, jaxgen.init_state(model, [[3, 4]], cfg), cfg, layout="portable",
                    streamer=Collect(), chunk_size=2)
    assert seen and not any(apart for _, apart in seen)


def test_the_caller_state_is_consumed_by_the_split():
    model, params = tiny_llama(num_layers=2)
    cfg = jaxgen.GenerationConfig(max_new_tokens=4)
    state = jaxgen.init_state(model, [[3, 4]], cfg)
    jaxgen.generate(params, state, cfg, layout="split", streamer=Collect(), chunk_size=2)
    assert state.cache.k.is_deleted()  # freed, as the programs' donation frees it

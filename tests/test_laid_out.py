"""jaxgen.runtime.compiled._laid_out: params laid out for decoding once and kept for the next call with
the same arrays; dropped when the caller's arrays go."""
import gc

import jax
import jax.numpy as jnp
import numpy as np

import jaxgen
from jaxgen.backends.cpu import layer_split
from jaxgen.backends.cpu.kernels import few_rows
from jaxgen.drivers.streamers import BaseStreamer
from jaxgen.models import tiny_llama
from jaxgen.runtime import compiled


class Quiet(BaseStreamer):
    def put(self, value):
        pass

    def end(self):
        pass


def _setup(monkeypatch):
    monkeypatch.setattr(layer_split, "SPLIT_MIN_BYTES", 0)  # as if the tiny model were large
    calls = []
    real = compiled._layout_pieces_jit

    def counting(params, *, loop, layout):  # loop: the plan, as sorted (keyword, value) pairs
        calls.append(dict(loop))
        return real(params, loop=loop, layout=layout)

    monkeypatch.setattr(compiled, "_layout_pieces_jit", counting)
    compiled._LAID_OUT.clear()
    return calls


def _generate(model, params, prompts, layout="auto", **settings):
    cfg = jaxgen.GenerationConfig(max_new_tokens=5, pad_token_id=0, **settings)
    return jaxgen.generate(params, jaxgen.init_state(model, prompts, cfg), cfg, layout=layout)


def test_the_same_params_are_laid_out_once_across_calls_and_chunks(monkeypatch):
    calls = _setup(monkeypatch)
    model, params = tiny_llama(num_layers=2, intermediate_size=40)
    first = _generate(model, params, [[3, 1, 4], [1, 5]])
    again = _generate(model, params, [[2, 7], [1, 8, 2]])
    cfg = jaxgen.GenerationConfig(max_new_tokens=5, pad_token_id=0)
    streamed = jaxgen.generate(params, jaxgen.init_state(model, [[3, 1, 4], [1, 5]], cfg), cfg,
                               streamer=[Quiet(), Quiet()])
    assert len(calls) == 1  # three calls (one streamed in chunks), one layout
    stacked = _generate(model, params, [[3, 1, 4], [1, 5]], layout="portable")
    assert len(calls) == 1  # the portable program lays nothing out
    assert jnp.array_equal(first.sequences, stacked.sequences)
    assert jnp.array_equal(streamed.sequences, stacked.sequences)
    assert again.sequences.shape == first.sequences.shape


def test_other_params_or_another_plan_lay_out_again_and_freed_params_free_the_copy(monkeypatch):
    calls = _setup(monkeypatch)
    model, params = tiny_llama(num_layers=2, intermediate_size=40)
    _generate(model, params, [[3, 1, 4], [1, 5]])
    monkeypatch.setattr(few_rows, "available", lambda: False)  # XLA's products: another plan
    _generate(model, params, [[3, 1, 4], [1, 5]])  # same params, another layout
    other = jax.tree_util.tree_map(lambda a: a * 1.0, params)  # new arrays, same values
    _generate(model, other, [[3, 1, 4], [1, 5]])
    assert len(calls) == 3
    assert compiled._LAID_OUT and compiled._LAID_OUT[0].refs[0]() is not None
    del other
    gc.collect()
    assert compiled._LAID_OUT == []  # the caller's arrays are gone: so is the laid-out copy


def test_params_under_a_trace_are_laid_out_inside_the_program(monkeypatch):
    calls = _setup(monkeypatch)
    model, params = tiny_llama(num_layers=2, intermediate_size=40)
    cfg = jaxgen.GenerationConfig(max_new_tokens=4, pad_token_id=0)
    state = jaxgen.init_state(model, [[3, 1, 4], [1, 5]], cfg)
    traced = jax.jit(lambda p: jaxgen.generate(p, state, cfg).sequences)(params)
    assert calls == []  # tracers: nothing kept
    direct = jaxgen.generate(params, jaxgen.init_state(model, [[3, 1, 4], [1, 5]], cfg), cfg)
    np.testing.assert_array_equal(traced, direct.sequences)

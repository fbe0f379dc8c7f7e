"""jaxgen/backends/cpu/layer_split.py: stacked weights split once per compiled call give the stacked
layout's tokens, and the decode loop then slices no weight out of a stack."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxgen.backends.cpu import layer_split
from jaxgen.backends.cpu.layer_split import is_stacked, split_layers
from jaxgen.core.step import forward_last
from jaxgen.models import tiny_llama, unstack_layers

STEPS = 3


def _decode_loop(model, prepare):
    """A jitted fori_loop of one-token forwards over params prepared by `prepare`."""

    def run(params, cache, tokens, length):
        params = prepare(params)

        def body(i, carry):
            cache, toks = carry
            logits, cache = forward_last(model, params, toks, length + i, cache)  # [B, V]
            return cache, toks.at[:, 0].set(jnp.argmax(logits, -1).astype(jnp.int32))

        return jax.lax.fori_loop(0, STEPS, body, (cache, tokens))

    return jax.jit(run)


def test_split_keeps_the_outputs_and_removes_the_per_step_weight_slices():
    model, params = tiny_llama(num_layers=3, intermediate_size=40)
    cache = model.init_cache(2, 8)
    tokens = jnp.array([[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8]], jnp.int32)  # [B, T]
    args = (params, cache, tokens, jnp.array([2, 3], jnp.int32))
    stacked = _decode_loop(model, lambda p: p).lower(*args).compile()
    split = _decode_loop(model, split_layers).lower(*args).compile()
    for a, b in zip(jax.tree_util.tree_leaves(split(*args)),
                    jax.tree_util.tree_leaves(stacked(*args))):
        assert jnp.allclose(a, b, atol=1e-5)  # same tokens, same cache

    # under the scan every step copies each layer's matrices out of the stack (a dynamic
    # slice [1, D, F] of w_gate / w_up [L, D, F]); split once per call, none is left
    def weight_slices(compiled) -> int:
        return sum(1 for line in compiled.as_text().splitlines()
                   if "= f32[1,16,40]" in line and " dynamic-slice(" in line)

    assert weight_slices(stacked) > 0
    assert weight_slices(split) == 0


def test_split_is_the_unstacked_layout():
    model, params = tiny_llama(num_layers=2)
    unstacked = unstack_layers(model, params)
    shapes = jax.eval_shape(split_layers, params)
    assert jax.tree_util.tree_structure(shapes) == jax.tree_util.tree_structure(unstacked)
    assert is_stacked(params) and not is_stacked(unstacked)
    assert split_layers(unstacked) is unstacked


def _generate_counting_splits(monkeypatch, layout, max_new_tokens, prompts=((3, 1, 4), (1, 5)),
                              **settings):
    """generate(..., layout=layout) on a tiny Llama: (output, the `fuse` flag of each layout
    planned)."""
    from layout_plans import record_layout_plans

    import jaxgen

    plans = record_layout_plans(monkeypatch)
    monkeypatch.setenv("JAXGEN_CPU_KERNELS", "off")  # XLA's layouts; the kernel: test_few_rows_kernel.py
    model, params = tiny_llama(num_layers=3, intermediate_size=40)
    cfg = jaxgen.GenerationConfig(max_new_tokens=max_new_tokens, **settings)
    out = jaxgen.generate(params, jaxgen.init_state(model, [list(p) for p in prompts], cfg), cfg,
                          layout=layout)
    return out, [plan["fuse"] for plan in plans]


def test_generate_decodes_split_weights_by_default_on_cpu(monkeypatch):
    small, small_calls = _generate_counting_splits(monkeypatch, "auto", 4)
    monkeypatch.setattr(layer_split, "SPLIT_MIN_BYTES", 0)  # as if the tiny model were large
    split, split_calls = _generate_counting_splits(monkeypatch, "auto", 5)
    stacked, stacked_calls = _generate_counting_splits(monkeypatch, "portable", 6)
    assert small_calls == [] and split_calls == [True] and stacked_calls == []  # 2 rows
    for row, length in enumerate(split.lengths.tolist()):  # the same first 5 new tokens
        assert jnp.array_equal(split.sequences[row, :length], stacked.sequences[row, :length])


def test_auto_splits_only_layer_weights_large_enough_to_gain():
    model, params = tiny_llama()
    assert layer_split._layer_bytes(params) < layer_split.SPLIT_MIN_BYTES
    assert layer_split.for_decoding(model, params) is params
    big = dict(params, layers={"wq": jnp.zeros((2, 2048, 2048), jnp.float32)})  # 32 MiB
    assert layer_split._layer_bytes(big) == 2 * 2048 * 2048 * 4
    assert not layer_split.is_stacked(layer_split.for_decoding(model, big))


def test_a_bad_layout_names_the_argument_and_the_choices_before_anything_compiles(monkeypatch):
    import pytest
    from layout_plans import record_layout_plans

    import jaxgen
    from jaxgen.api.plan import make_plan
    from jaxgen.models import TINY_VOCAB, tiny_tokenizer

    plans = record_layout_plans(monkeypatch)
    monkeypatch.setattr(layer_split, "SPLIT_MIN_BYTES", 0)
    model, params = tiny_llama(num_layers=3, intermediate_size=40)
    cfg = jaxgen.GenerationConfig(max_new_tokens=3)
    state = jaxgen.init_state(model, [[3, 1, 4]], cfg)
    before = jaxgen.trace_count()
    allowed = "expected one of 'auto', 'portable', 'split'"
    for bad in ("fused", "stacked", None):  # the old "stacked" is now "portable"
        with pytest.raises(ValueError, match=rf"layout={bad!r} is not a layout; {allowed}"):
            jaxgen.generate(params, state, cfg, layout=bad)
    choices = rf"layout='fused' is not a layout; {allowed}"
    with pytest.raises(ValueError, match=choices):
        jaxgen.generate_ids(model, params, [[3, 1, 4]], cfg, layout="fused")
    with pytest.raises(ValueError, match=choices):
        jaxgen.generate_text(*tiny_llama(vocab_size=TINY_VOCAB), tiny_tokenizer(), ["hi"], cfg,
                             layout="fused")
    with pytest.raises(ValueError, match=choices):
        make_plan(state, cfg, layout="fused")
    assert jaxgen.trace_count() == before and plans == []  # refused before any layout or trace


def test_switching_the_layout_between_calls_needs_no_cache_clearing(monkeypatch):
    from layout_plans import record_layout_plans

    import jaxgen

    plans = record_layout_plans(monkeypatch)
    monkeypatch.setattr(layer_split, "SPLIT_MIN_BYTES", 0)
    monkeypatch.setenv("JAXGEN_CPU_KERNELS", "off")
    model, params = tiny_llama(num_layers=3, intermediate_size=44)  # its own programs
    cfg = jaxgen.GenerationConfig(max_new_tokens=4)
    prompts = [[3, 1, 4], [1, 5]]
    outs, traced = {}, []
    for layout in ("portable", "split", "portable", "auto"):  # one process, no jax.clear_caches
        before, traces = len(plans), jaxgen.trace_count()
        outs.setdefault(layout, []).append(
            jaxgen.generate(params, jaxgen.init_state(model, prompts, cfg), cfg, layout=layout))
        assert (len(plans) > before) == (layout != "portable"), layout  # each call's own layout
        traced.append(jaxgen.trace_count() - traces)
    assert traced == [1, 1, 0, 1]  # a program per layout (a static argument), each kept
    for out in (*outs["portable"], *outs["split"], *outs["auto"]):
        assert jnp.array_equal(out.sequences, outs["portable"][0].sequences)


def test_one_row_programs_fuse_the_projections_and_keep_the_tokens(monkeypatch):
    monkeypatch.setattr(layer_split, "SPLIT_MIN_BYTES", 0)
    one, one_calls = _generate_counting_splits(monkeypatch, "auto", 7, prompts=((3, 1, 4),))
    stacked, _ = _generate_counting_splits(monkeypatch, "portable", 8, prompts=((3, 1, 4),))
    assert one_calls == [True]  # batch 1, plain decoding: fused
    assert jnp.array_equal(one.sequences[0, :one.lengths[0]],
                           stacked.sequences[0, :one.lengths[0]])


def test_programs_fuse_when_every_forward_runs_at_most_four_rows(monkeypatch):
    """Plain and assisted decoding: the batch (a plain step); beam search: batch x beams."""
    import jaxgen
    from jaxgen.backends.cpu.tuning import ROWWISE_MAX_ROWS
    from jaxgen.loops.beam import BeamLoop
    from jaxgen.loops.decode import DecodeLoop
    from jaxgen.runtime.compiled import _prepared
    from jaxgen.speculative.drafters import prompt_lookup
    from jaxgen.speculative.loop import SpeculativeLoop

    monkeypatch.setattr(layer_split, "SPLIT_MIN_BYTES", 0)
    monkeypatch.setenv("JAXGEN_CPU_KERNELS", "off")  # with the kernel every program fuses
    model, params = tiny_llama()

    def fused(loop, batch, **settings) -> bool:
        cfg = jaxgen.GenerationConfig(max_new_tokens=2, pad_token_id=0, **settings)
        state = jaxgen.init_state(model, [[3, 1, 4]] * batch, cfg)
        return "wqkv" in _prepared(params, state, loop, cfg, "auto")[0]["layers"][0]

    top = ROWWISE_MAX_ROWS
    assert fused(DecodeLoop(), top) and not fused(DecodeLoop(), top + 1)
    assert fused(BeamLoop(), 1, num_beams=top) and not fused(BeamLoop(), 1, num_beams=top + 1)
    assert not fused(BeamLoop(), 2, num_beams=top // 2 + 1)
    lookup = SpeculativeLoop(prompt_lookup.PromptLookupDrafter(2, 2))
    assert fused(lookup, 1) and not fused(lookup, top + 1)


def test_fused_projections_give_the_separate_ones_outputs_with_biases_and_qk_norm():
    from jaxgen.backends.cpu.layer_split import fuse_projections

    model, params = tiny_llama(num_layers=2, attention_bias=True, qk_norm=True, num_kv_heads=1)
    fused = jax.jit(lambda p: split_layers(p, fuse=True))(params)
    layer = fused["layers"][0]
    assert "wqkv" in layer and "wq" not in layer and "w_gate_up" in layer and "bq" in layer
    tokens, positions = jnp.array([[3, 1, 4, 1]]), jnp.arange(4)[None]  # [1, 4]
    want = model(params, tokens, positions, model.init_cache(1, 4)).logits  # [1, 4, V]
    got = model(fused, tokens, positions, model.init_cache(1, 4)).logits  # [1, 4, V]
    assert jnp.allclose(got, want, atol=1e-5)
    int8_like = {"wq": (1, 2), "wk": jnp.ones((2, 2)), "wv": jnp.ones((2, 2))}  # not all arrays
    assert fuse_projections(int8_like) == int8_like

"""jaxgen/backends/cpu/rowwise.py: products with a few rows run one matrix-vector product per row, with the
plain product's values, and generate's CPU programs run them (beam search included)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxgen.backends.cpu.rowwise import RowwiseMatrix, rowwise_layer
from jaxgen.backends.cpu.tuning import ROWWISE_MAX_ROWS


def _dots(fn, *args) -> int:
    """dot_general equations in fn's jaxpr."""
    return str(jax.make_jaxpr(fn)(*args)).count("dot_general")


@pytest.mark.parametrize("lead", [(1, 1), (2, 1), (1, 3), (4, 2), (ROWWISE_MAX_ROWS, 1),
                                  (ROWWISE_MAX_ROWS + 1, 1), (3, 5)])
def test_rowwise_product_is_the_plain_product_and_splits_only_few_rows(lead):
    weight = jax.random.normal(jax.random.key(0), (24, 40))  # [K, N]
    x = jax.random.normal(jax.random.key(1), lead + (24,))  # [B, S, K]
    wrapped = RowwiseMatrix(weight)
    got = x @ wrapped  # [B, S, N]
    assert got.shape == lead + (40,)
    assert jnp.allclose(got, x @ weight, rtol=1e-5, atol=1e-5)
    rows = lead[0] * lead[1]
    want_dots = rows if 2 <= rows <= ROWWISE_MAX_ROWS else 1
    assert _dots(lambda a, w: a @ w, x, wrapped) == want_dots


def test_rowwise_layer_wraps_float_matrices_only_and_passes_through_jit():
    layer = {"wq": jnp.ones((4, 6)), "attn_norm": jnp.ones(4), "bq": jnp.ones(6)}
    wrapped = jax.jit(rowwise_layer)(layer)
    assert isinstance(wrapped["wq"], RowwiseMatrix) and wrapped["wq"].shape == (4, 6)
    assert not isinstance(wrapped["attn_norm"], RowwiseMatrix)
    assert not isinstance(wrapped["bq"], RowwiseMatrix)


def _beam_run(monkeypatch, layout, new_tokens):
    from layout_plans import record_layout_plans

    import jaxgen
    from jaxgen.backends.cpu import layer_split
    from jaxgen.models import tiny_llama

    plans = record_layout_plans(monkeypatch)
    monkeypatch.setattr(layer_split, "SPLIT_MIN_BYTES", 0)
    monkeypatch.setenv("JAXGEN_CPU_KERNELS", "off")  # XLA's products (the kernel's own tests: test_few_rows_kernel.py)
    model, params = tiny_llama(num_layers=2, intermediate_size=40)
    cfg = jaxgen.GenerationConfig(num_beams=4, num_return_sequences=2,
                                  max_new_tokens=new_tokens, pad_token_id=0)
    out = jaxgen.generate(params, jaxgen.init_state(model, [[3, 1, 4], [1, 5]], cfg), cfg,
                          layout=layout)
    return out, [plan["rowwise"] for plan in plans]


def test_beam_search_runs_rowwise_weights_with_the_stacked_layouts_beams(monkeypatch):
    # the layout is a static argument: each run has its own program, no cache cleared
    rowwise, seen = _beam_run(monkeypatch, "auto", 5)
    stacked, stacked_seen = _beam_run(monkeypatch, "portable", 5)
    assert seen == [True] and stacked_seen == []
    assert jnp.array_equal(rowwise.sequences, stacked.sequences)
    assert jnp.allclose(rowwise.sequences_scores, stacked.sequences_scores, atol=1e-5)

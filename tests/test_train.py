"""jaxgen.train: a tiny drafter trains (its loss falls), orbax checkpoints round-trip, and a
run stopped and resumed from its checkpoint ends exactly where an uninterrupted run ends."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgen.models import Llama, tiny_llama
from jaxgen.train import fit_exit_adapter as exit_recipe
from jaxgen.train.batches import DistillSet, pick, position_batch, sequence_batch
from jaxgen.train.checkpoint import checkpoint_manager, restore_latest, save_state
from jaxgen.train.fit_standalone_draft import (
    draft_config,
    init_draft,
    make_loss,
    target_frozen,
)
from jaxgen.train.optim import OptimConfig
from jaxgen.train.trainer import TrainConfig, train

SEQS, LENGTH, PROMPT = 16, 12, 3


@pytest.fixture(scope="module")
def setup():
    """A 2-layer tiny target, its self-distillation data on repetitive sequences (something
    learnable), and a 1-layer draft."""
    target, params = tiny_llama(seed=1, num_layers=2)
    rng = np.random.default_rng(0)
    period = rng.integers(2, 5, size=SEQS)
    tokens = np.stack([np.resize(rng.integers(0, 32, size=p), LENGTH) for p in period])
    cache = target.init_cache(SEQS, LENGTH)
    positions = jnp.broadcast_to(jnp.arange(LENGTH), (SEQS, LENGTH))
    x = target.embed(params, jnp.asarray(tokens))
    mid, cache = target.run_layers(params, x, positions, cache, 0, 1)
    final, _ = target.run_layers(params, mid, positions, cache, 1, 2)
    data = DistillSet(tokens=tokens.reshape(-1).astype(np.int32),
                      starts=np.arange(SEQS + 1) * LENGTH,
                      prompt_lens=np.full(SEQS, PROMPT, np.int32),
                      final=np.asarray(final, np.float16).reshape(SEQS * LENGTH, -1),
                      layers={1: np.asarray(mid, np.float16).reshape(SEQS * LENGTH, -1)})
    draft = Llama(draft_config(target.config, hidden=16, layers=1, heads=2, kv_heads=1,
                               intermediate=32))
    draft_params = init_draft(jax.random.key(0), draft, params["embed"])
    return target, params, data, draft, draft_params


def draft_run(setup, steps, **kwargs):
    target, params, data, draft, draft_params = setup
    cfg = TrainConfig(OptimConfig(learning_rate=1e-2, warmup_steps=2, total_steps=steps),
                      checkpoint_every=5, log_every=5)
    batch_at = lambda step: sequence_batch(data, step, 4, LENGTH, seed=3)  # noqa: E731
    return train(make_loss(draft, target), draft_params, target_frozen(target, params),
                 batch_at, cfg, log=None, **kwargs)


def test_draft_loss_falls(setup):
    _, history = draft_run(setup, 40)
    first, last = history[0], history[-1]
    assert last["kl"] < 0.7 * first["kl"], (first, last)
    assert last["overlap"] > first["overlap"]


def test_exit_adapter_loss_falls(setup):
    target, params, data, _, _ = setup
    positions = data.answer_positions()
    adapter = jax.tree_util.tree_map(
        lambda a: a, exit_recipe.init_exit_adapter(jax.random.key(0), 16, 8))
    cfg = TrainConfig(OptimConfig(learning_rate=2e-2, warmup_steps=2, total_steps=40),
                      log_every=5)
    batch_at = lambda step: position_batch(data, positions, step, 64, 1, seed=0)  # noqa
    _, history = train(exit_recipe.make_loss(target), adapter, target_frozen(target, params),
                       batch_at, cfg, log=None)
    assert history[-1]["kl"] < 0.7 * history[0]["kl"], (history[0], history[-1])


def test_checkpoint_round_trip(tmp_path):
    state = {"params": {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3, jnp.bfloat16)},
             "step": jnp.int32(7)}
    manager = checkpoint_manager(str(tmp_path))
    save_state(manager, 7, state)
    like = jax.tree_util.tree_map(jnp.zeros_like, state)
    step, restored = restore_latest(manager, like)
    manager.close()
    assert step == 7
    for got, want in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(state)):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_resumed_run_equals_uninterrupted(setup, tmp_path):
    whole, _ = draft_run(setup, 20, checkpoint_dir=str(tmp_path / "whole"))
    stopped, _ = draft_run(setup, 20, checkpoint_dir=str(tmp_path / "split"), stop_at=10)
    resumed, _ = draft_run(setup, 20, checkpoint_dir=str(tmp_path / "split"))
    leaves = jax.tree_util.tree_leaves
    assert any(not np.array_equal(a, b) for a, b in zip(leaves(stopped), leaves(whole)))
    for got, want in zip(leaves(resumed), leaves(whole)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-6)


def test_batches_depend_on_seed_and_step_only():
    first = [pick(10, 4, seed=1, step=s).tolist() for s in range(5)]
    again = [pick(10, 4, seed=1, step=s).tolist() for s in reversed(range(5))][::-1]
    assert first == again
    epoch = sorted(sum(first[:5], [])[:10])  # steps 0..2 cover the first epoch once
    assert epoch == list(range(10))

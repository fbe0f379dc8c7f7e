"""MTP-layer training (jaxgen/train/fit_mtp_layer.py): the training forward is jaxgen/models/mtp.py's depth
0, the loss falls, a stopped run resumes exactly, the export attaches as params["mtp"]; the
shipped SmolLM2 MTP layer is lossless with use_mtp and accepts far more than a random one
(slow)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from distill_fixtures import LENGTH, VOCAB, repetitive_target_set

from jaxgen.models.mtp import teacher_forced_logits
from jaxgen.models.shipped_drafters import attach_mtp_layer
from jaxgen.train import fit_mtp_layer as recipe
from jaxgen.train.batches import sequence_batch
from jaxgen.train.optim import OptimConfig
from jaxgen.train.trainer import TrainConfig, train


@pytest.fixture(scope="module")
def setup():
    """A 2-layer tiny target and its data on repetitive sequences: final states and the
    input of its last layer (what eh_proj's fit reads)."""
    target, params, data = repetitive_target_set()
    model, mtp = recipe.init_from_target(target, params, data)
    return target, params, data, model, mtp


def run(setup, steps, **kwargs):
    target, params, data, model, mtp = setup
    cfg = TrainConfig(OptimConfig(learning_rate=1e-2, warmup_steps=2, total_steps=steps),
                      checkpoint_every=4, log_every=4)
    batch_at = lambda step: sequence_batch(data, step, 4, LENGTH, seed=3)  # noqa: E731
    return train(recipe.make_loss(model), mtp, recipe.frozen_target(params, VOCAB), batch_at,
                 cfg, log=None, **kwargs)


def test_training_forward_is_the_mtp_depth(setup):
    """The student logits are jaxgen/models/mtp.py's teacher-forced depth 0 on the vocabulary rows;
    the teacher is the target's own next-token logits one position later."""
    target, params, data, model, mtp = setup
    batch = sequence_batch(data, 0, 2, LENGTH)
    student, teacher = recipe.student_teacher_logits(
        model, mtp, recipe.frozen_target(params, VOCAB), batch)
    full = {**params, "mtp": mtp}
    tokens = jnp.asarray(batch["tokens"])  # [2, T]
    hidden = jnp.asarray(batch["hidden"][:, :-1], jnp.float32)  # [2, T-1, D]
    (expected,) = teacher_forced_logits(model, full, tokens, hidden)  # [2, T-1, V]
    np.testing.assert_allclose(np.asarray(student), np.asarray(expected)[..., list(VOCAB)],
                               rtol=1e-4, atol=1e-4)
    own = target(params, tokens, jnp.arange(LENGTH)[None], target.init_cache(2, LENGTH)).logits
    np.testing.assert_allclose(np.asarray(teacher), np.asarray(own)[:, 1:, list(VOCAB)],
                               rtol=2e-2, atol=2e-2)  # stored hidden states are fp16


@pytest.mark.slow  # test_train.py keeps the resume check in the default suite
def test_loss_falls_resumes_exactly_and_attaches(setup, tmp_path):
    target, params, _, model, _ = setup
    whole, history = run(setup, 12, checkpoint_dir=str(tmp_path / "whole"))
    assert history[-1]["kl"] < 0.7 * history[0]["kl"], (history[0], history[-1])
    run(setup, 12, checkpoint_dir=str(tmp_path / "split"), stop_at=4)
    resumed, _ = run(setup, 12, checkpoint_dir=str(tmp_path / "split"))
    for got, want in zip(jax.tree_util.tree_leaves(resumed), jax.tree_util.tree_leaves(whole)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-6)
    folder = recipe.save(model, params, whole, str(tmp_path / "out"), {"test": True},
                         dtype="float32")
    attached, with_mtp = attach_mtp_layer(target, params, folder=folder)
    assert attached.config.num_mtp_layers == 1 and attached.mtp_layers() is not None
    attached.check_params(with_mtp)
    for got, want in zip(jax.tree_util.tree_leaves(with_mtp["mtp"]),
                         jax.tree_util.tree_leaves(whole)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.slow
def test_eh_proj_fit_starts_closer_to_the_target(setup):
    target, params, data, model, mtp = setup
    _, unfit = recipe.init_from_target(target, params)  # no data: [noise; I]
    batch = sequence_batch(data, 0, 8, LENGTH)
    loss_fn = recipe.make_loss(model)
    frozen = recipe.frozen_target(params, VOCAB)
    assert loss_fn(mtp, frozen, batch)[0] < loss_fn(unfit, frozen, batch)[0]


@pytest.mark.slow
def test_shipped_mtp_layer_is_lossless_and_accepts_on_smollm2():
    """load("smollm2-135m-instruct") carries the trained MTP layer: use_mtp greedy equals plain
    greedy (ragged batch of 2), and the trained layer's single drafts are accepted far more
    often than a random layer's. Bounds: on 20 held-out prompts (96 new tokens) the shipped
    layer's acceptance rate was 0.34 at K=1 (mean accepted length 1.34); a random layer
    (std 0.02) proposes near-uniform tokens over 49k, accepted by chance only."""
    import jaxgen
    from jaxgen import generate, init_state
    from jaxgen.api.generate import default_config, outputs_to_lists
    from jaxgen.models.mtp import init_mtp_params

    model, params, tokenizer = jaxgen.models.load("smollm2-135m-instruct")
    assert model.config.num_mtp_layers == 1 and "mtp" in params
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}])
               for q in ("What is the capital of France?", "Name three colors.")]
    cfg = default_config(model, None, max_new_tokens=32)
    ref = outputs_to_lists(generate(params, init_state(model, prompts, cfg), cfg))
    mtp_cfg = cfg.replace(use_mtp=True, num_assistant_tokens=1)
    rates = {}
    for name, weights in (("trained", params["mtp"]),
                          ("random", init_mtp_params(model, jax.random.key(0)))):
        out = generate({**params, "mtp": weights}, init_state(model, prompts, mtp_cfg), mtp_cfg)
        assert outputs_to_lists(out) == ref, name
        rates[name] = int(np.sum(out.speculative.accepted)) / int(np.sum(
            out.speculative.drafted))
    assert rates["trained"] > 0.25 and rates["random"] < 0.1, rates

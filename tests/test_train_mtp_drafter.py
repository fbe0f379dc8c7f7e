"""MTP-drafter training (jaxgen/train/fit_mtp_drafter.py): the training forward is the assisted
loop's draft steps, its loss falls, the export loads with its draft vocabulary; the shipped
SmolLM2 drafter is lossless (slow)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from distill_fixtures import LENGTH, VOCAB, repetitive_target_set

from jaxgen.models import tiny_llama
from jaxgen.models.mtp_drafter import MtpDrafterModel, drafter_with_draft_head
from jaxgen.models.mtp_drafter_io import load_mtp_drafter
from jaxgen.train import fit_mtp_drafter as recipe
from jaxgen.train.batches import sequence_batch
from jaxgen.train.optim import OptimConfig
from jaxgen.train.trainer import TrainConfig, train


@pytest.fixture(scope="module")
def setup():
    """A 2-layer tiny target, its data on repetitive sequences (final states and the input
    of its last layer, whose K/V the drafter reads) and a 1-layer drafter on 18 tokens."""
    target, params, data = repetitive_target_set()
    drafter = MtpDrafterModel(recipe.drafter_config(target.config, sorted(VOCAB), hidden=16,
                                                    intermediate=32))
    return target, params, data, drafter, drafter.init_params(jax.random.key(0), scale=0.3)


def test_training_forward_is_the_assisted_draft_steps(setup):
    """At position P the training forward's step i equals drafter.step chained on a cache
    that holds only positions < P (what the assisted loop hands it)."""
    target, tparams, data, drafter, params = setup
    batch = sequence_batch(data, 0, 2, LENGTH, layers=(1,))
    frozen = recipe.frozen_target(drafter, tparams)
    _, logits = recipe.chained_logits(drafter, target, params, frozen, batch, steps=3)
    with_head = drafter_with_draft_head(drafter, params, tparams)
    tokens = jnp.asarray(batch["tokens"][:1])  # [1, T]
    vocab = np.asarray(sorted(VOCAB))
    for P in (1, 5, 8):
        cache = target(tparams, tokens[:, :P], jnp.arange(P)[None],
                       target.init_cache(1, LENGTH)).cache  # positions < P
        hidden = jnp.asarray(batch["hidden"][:1, P - 1], jnp.float32)  # [1, D]
        for i in range(3):
            step_logits, hidden = drafter.step(with_head, target, tparams, tokens[:, P + i],
                                               hidden, jnp.array([P]), cache)  # [1, V]
            np.testing.assert_allclose(np.asarray(step_logits[0])[vocab],
                                       np.asarray(logits[i][0, P]), rtol=2e-4, atol=2e-4)
            outside = np.setdiff1d(np.arange(target.vocab_size), vocab)
            assert np.all(np.isneginf(np.asarray(step_logits[0])[outside]))


def test_loss_falls_and_the_export_loads(setup, tmp_path):
    target, tparams, data, drafter, params = setup
    cfg = TrainConfig(OptimConfig(learning_rate=1e-2, warmup_steps=2, total_steps=30),
                      log_every=5)
    batch_at = lambda step: sequence_batch(data, step, 4, LENGTH, seed=3,  # noqa: E731
                                           layers=(1,))
    trained, history = train(recipe.make_loss(drafter, target, steps=2), params,
                             recipe.frozen_target(drafter, tparams), batch_at, cfg, log=None)
    assert history[-1]["loss"] < 0.7 * history[0]["loss"]
    folder = recipe.save(drafter, trained, str(tmp_path / "drafter"), {"test": True})
    loaded, loaded_params = load_mtp_drafter(folder)
    assert loaded == drafter and loaded.config.draft_vocab == tuple(sorted(VOCAB))
    np.testing.assert_allclose(np.asarray(loaded_params["pre_projection"]),
                               np.asarray(trained["pre_projection"]), rtol=1e-3, atol=1e-3)


def test_linear_init_starts_closer_to_the_target(setup):
    target, tparams, data, drafter, params = setup
    batch = sequence_batch(data, 0, 8, LENGTH, layers=(1,))
    frozen = recipe.frozen_target(drafter, tparams)
    loss_fn = recipe.make_loss(drafter, target, steps=1)
    fitted = recipe.linear_init(drafter, params, data, tparams["embed"])
    assert fitted["pre_projection"].shape == params["pre_projection"].shape
    assert loss_fn(fitted, frozen, batch)[0] < 0.7 * loss_fn(params, frozen, batch)[0]


def test_a_wrong_draft_head_is_refused(setup):
    target, tparams, _, drafter, params = setup
    with pytest.raises(ValueError, match="draft_head"):
        drafter.check_params({**params, "draft_head": jnp.zeros((16, 3))})


@pytest.mark.slow
def test_sampling_with_a_draft_vocabulary_is_lossless():
    """q is zero outside the drafter's vocabulary, yet the 3-token distribution of assisted
    sampling is the target's (chi-square against the exact product of its conditionals)."""
    from exact_sampling import (
        SMALL_V,
        TEMPERATURE,
        TOP_K,
        assert_follows,
        first_three_counts,
        three_token_joint,
    )
    from test_mtp_assistant import run

    import jaxgen
    from jaxgen.models.mtp_drafter import MtpDrafterConfig

    model, params = tiny_llama(seed=9, num_layers=3, vocab_size=SMALL_V)
    params = {**params, "embed": params["embed"] * 4.0}  # a peaked, context-dependent model
    drafter = MtpDrafterModel(MtpDrafterConfig.for_target(
        model.config, hidden_size=16, intermediate_size=32, num_layers=1, kv_layers=(0,),
        draft_vocab=(0, 2, 3, 5)))
    dparams = drafter_with_draft_head(drafter, drafter.init_params(jax.random.key(3), scale=0.8),
                                      params)
    prompt = [2, 3, 2, 3, 2]
    exact = three_token_joint(model, params, prompt)  # [V, V, V]
    rows = 12000
    cfg = jaxgen.GenerationConfig(do_sample=True, temperature=TEMPERATURE, top_k=TOP_K,
                                  max_new_tokens=4, num_assistant_tokens=2,
                                  assistant_confidence_threshold=0.0)
    out = run((model, params), cfg, [prompt] * rows, (drafter, dparams), key=jax.random.key(11))
    counts = first_three_counts(out.sequences, len(prompt), SMALL_V)  # [V, V, V]
    assert_follows(counts, exact)
    outside = [t for t in range(SMALL_V) if t not in (0, 2, 3, 5)]
    assert counts[outside].sum() + counts[:, outside].sum() + counts[:, :, outside].sum() > 0
    assert 0 < int(np.sum(out.speculative.accepted)) < int(np.sum(out.speculative.drafted))


@pytest.mark.slow
def test_shipped_mtp_drafter_is_lossless_on_smollm2():
    """load("smollm2-135m-instruct-mtp-drafter") fits the target and greedy with it equals
    plain greedy (ragged batch of 2), with some drafts accepted."""
    import jaxgen
    from jaxgen import generate, init_state
    from jaxgen.api.generate import default_config, outputs_to_lists

    model, params, tokenizer = jaxgen.models.load("smollm2-135m-instruct")
    drafter, dparams, dtok = jaxgen.models.load("smollm2-135m-instruct-mtp-drafter")
    drafter.check_target(model)
    assert drafter.config.draft_vocab and "draft_head" in dparams
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}])
               for q in ("What is the capital of France?", "Name three colors.")]
    cfg = default_config(model, None, max_new_tokens=24)
    ref = outputs_to_lists(generate(params, init_state(model, prompts, cfg), cfg))
    spec_cfg = cfg.replace(num_assistant_tokens=3)
    out = generate(params, init_state(model, prompts, spec_cfg), spec_cfg,
                   assistant_model=(drafter, dparams))
    assert outputs_to_lists(out) == ref
    assert int(np.sum(out.speculative.accepted)) > 0

"""SynthID-text: the processor against HF's stateful SynthIDTextWatermarkLogitsProcessor step
by step, the detector's g-values and masks against HF's, and detection of jaxgen text."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.generation.logits_process import SynthIDTextWatermarkLogitsProcessor

import jaxgen
from jaxgen.config.generation import GenerationConfig
from jaxgen.logits.chain import ProcessorContext
from jaxgen.logits.watermark.synthid import (
    SynthIDTextWatermarkingConfig,
    sampling_table,
    synthid_scores,
)
from jaxgen.logits.watermark.synthid_detect import (
    SynthIDTextDetector,
    compute_g_values,
    context_repetition_mask,
    eos_token_mask,
)
from tests.stubs import BigramStub, random_table

V = 64
KEYS = (654, 400, 836, 123, 2**62 + 17)  # one key past 2**32: the 64-bit hash carries


def hf_processor(wm: SynthIDTextWatermarkingConfig) -> SynthIDTextWatermarkLogitsProcessor:
    return SynthIDTextWatermarkLogitsProcessor(
        ngram_len=wm.ngram_len, keys=list(wm.keys), sampling_table_size=wm.sampling_table_size,
        sampling_table_seed=wm.sampling_table_seed,
        context_history_size=wm.context_history_size, device="cpu",
        skip_first_ngram_calls=wm.skip_first_ngram_calls, debug_mode=wm.debug_mode)


def test_sampling_table_is_torchs():
    theirs = hf_processor(SynthIDTextWatermarkingConfig(ngram_len=3, keys=KEYS,
                                                        sampling_table_seed=3))
    np.testing.assert_array_equal(sampling_table(3, 2**16), theirs.sampling_table.numpy())


@pytest.mark.parametrize("skip", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_processor_matches_transformers_step_by_step(skip):
    """HF's processor keeps a context and a history across calls; jaxgen reads both from the
    row. A small alphabet repeats contexts; a short history forgets them."""
    wm = SynthIDTextWatermarkingConfig(ngram_len=3, keys=KEYS, context_history_size=5,
                                       sampling_table_size=999, skip_first_ngram_calls=skip)
    hf = hf_processor(wm)
    rng = np.random.default_rng(0)
    prompt, generated, width = [3, 9, 4], rng.integers(0, 3, size=14).tolist(), 24
    run = jax.jit(synthid_scores, static_argnums=2)
    repeated = 0
    for step in range(len(generated)):
        ids = prompt + generated[:step]
        scores = rng.normal(size=(1, V)).astype(np.float32)
        scores[0, :5] = -np.inf  # filtered tokens: HF's log(0) becomes float32's min
        want = hf(torch.tensor([ids]), torch.tensor(scores)).numpy()
        tokens = np.zeros((1, width), np.int32)
        tokens[0, :len(ids)] = ids
        ctx = ProcessorContext(tokens=jnp.asarray(tokens), length=jnp.array([len(ids)]),
                               prompt_len=jnp.array([len(prompt)]))
        ours = np.asarray(run(jnp.asarray(scores), ctx, wm))
        np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-5, err_msg=f"step {step}")
        repeated += np.array_equal(ours, scores)
    assert 0 < repeated < len(generated)  # both branches were exercised


def test_g_values_and_masks_match_transformers():
    wm = SynthIDTextWatermarkingConfig(ngram_len=4, keys=KEYS, context_history_size=3)
    hf = hf_processor(wm)
    ids = np.random.default_rng(1).integers(0, 5, size=(3, 20))
    ids[1, 12] = 2  # an EOS in one row
    ids_t = torch.tensor(ids)
    np.testing.assert_array_equal(compute_g_values(wm, ids), hf.compute_g_values(ids_t).numpy())
    np.testing.assert_array_equal(context_repetition_mask(wm, ids),
                                  hf.compute_context_repetition_mask(ids_t).numpy())
    np.testing.assert_array_equal(eos_token_mask(ids, 2),
                                  hf.compute_eos_token_mask(ids_t, 2).numpy())


def test_detector_separates_watermarked_from_plain_text():
    model, params = BigramStub(vocab_size=V), random_table(V, seed=21, scale=0.5)
    wm = SynthIDTextWatermarkingConfig(ngram_len=3, keys=KEYS)
    prompts = [[int(t)] for t in np.random.default_rng(4).integers(0, V, size=6)]
    base = GenerationConfig(do_sample=True, max_new_tokens=40, top_k=0)
    detector = SynthIDTextDetector(wm)
    z = {}
    for name, config in (("plain", None), ("marked", wm)):
        cfg = base.replace(watermarking_config=config)
        out = jaxgen.generate(params, jaxgen.init_state(model, prompts, cfg,
                                                         jax.random.key(2)), cfg)
        new = np.asarray(out.sequences)[:, 1:41]  # the generated tokens
        z[name] = detector(new).z_score
        if name == "marked":  # HF's g-values on jaxgen's text are ours
            theirs = hf_processor(wm).compute_g_values(torch.tensor(new)).numpy()
            np.testing.assert_array_equal(compute_g_values(wm, new), theirs)
    assert (z["marked"] > 4).all(), z
    assert (np.abs(z["plain"]) < 3.5).all(), z


@pytest.mark.parametrize("value, needle", [
    ({"ngram_len": 1, "keys": [1]}, "ngram_len` must be an int >= 2"),
    ({"ngram_len": 3, "keys": []}, "keys` must be a non-empty list"),
    ({"ngram_len": 3, "keys": [1, -2]}, "keys` must be a non-empty list"),
    ({"ngram_len": 3, "keys": [1], "sampling_table_size": 2**24 + 1}, "2\\*\\*24"),
    ({"ngram_len": 3, "keys": [1], "depth": 3}, "unknown key\\(s\\) \\['depth'\\]"),
])
def test_bad_configs_are_refused(value, needle):
    with pytest.raises(ValueError, match=needle):
        GenerationConfig(watermarking_config=value)


def test_hugging_faces_config_object_is_accepted():
    import transformers
    theirs = transformers.SynthIDTextWatermarkingConfig(ngram_len=5, keys=[654, 400])
    ours = GenerationConfig(watermarking_config=theirs).watermarking_config
    assert ours == SynthIDTextWatermarkingConfig(ngram_len=5, keys=(654, 400))

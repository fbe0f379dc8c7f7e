"""The green-list watermark: torch's permutation reproduced bit for bit, the processor against
HF's WatermarkLogitsProcessor, the detector against HF's WatermarkDetector (same numbers on
the same ids and key), and detection of jaxgen-generated text."""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from transformers.generation import WatermarkDetector as HFDetector
from transformers.generation.logits_process import WatermarkLogitsProcessor

import jaxgen
from jaxgen.config.generation import GenerationConfig
from jaxgen.config.watermarking import WatermarkingConfig
from jaxgen.logits.chain import ProcessorContext, process_logits
from jaxgen.logits.watermark.detect import WatermarkDetector
from jaxgen.logits.watermark.green_list import green_list_bias
from jaxgen.logits.watermark.rng import randperm_prefix
from tests.stubs import BigramStub, random_table

V = 211
SCHEMES = [dict(seeding_scheme="lefthash", context_width=1),
           dict(seeding_scheme="lefthash", context_width=3, greenlist_ratio=0.4),
           dict(seeding_scheme="selfhash", context_width=1, hashing_key=12345)]


@pytest.mark.parametrize("n", [pytest.param(1, marks=pytest.mark.slow), 9,
                               pytest.param(1000, marks=pytest.mark.slow)])
def test_randperm_is_torchs(n):
    seeds = [0, 1, 15485863, 2**32 - 1, 987654321]
    want = []
    for seed in seeds:
        want.append(torch.randperm(n, generator=torch.Generator().manual_seed(seed)).numpy())
    ours = np.asarray(randperm_prefix(jnp.asarray(seeds, jnp.uint32), n, n))
    np.testing.assert_array_equal(ours, np.stack(want))
    head = max(1, n // 4)
    np.testing.assert_array_equal(
        np.asarray(randperm_prefix(jnp.asarray(seeds, jnp.uint32), n, head)),
        np.stack(want)[:, :head])


def hf_processor(fields: dict, vocab: int = V) -> WatermarkLogitsProcessor:
    return WatermarkLogitsProcessor(vocab_size=vocab, device="cpu",
                                    **WatermarkingConfig(**fields).to_dict())


def slow_unless(keep: bool):
    return () if keep else (pytest.mark.slow,)


SCHEME_CASES = [pytest.param(f, id=f"{f['seeding_scheme']}-{f['context_width']}",
                             marks=slow_unless(f["context_width"] == 1)) for f in SCHEMES]


@pytest.mark.parametrize("fields", SCHEME_CASES)
def test_processor_matches_transformers(fields):
    rng = np.random.default_rng(0)
    rows, width = 5, 12
    scores = (rng.normal(size=(rows, V)) * 2).astype(np.float32)
    scores[0, :50] = -np.inf
    tokens = rng.integers(0, V, size=(rows, width)).astype(np.int32)
    length = np.array([1, 2, 5, 9, 12], np.int32)  # row 0 (and 1) shorter than width 3
    ctx = ProcessorContext(tokens=jnp.asarray(tokens), length=jnp.asarray(length),
                           prompt_len=jnp.ones((rows,), jnp.int32))
    ours = np.asarray(jax.jit(green_list_bias, static_argnums=2)(
        jnp.asarray(scores), ctx, WatermarkingConfig(**fields)))
    processor = hf_processor(fields)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for b in range(rows):  # HF on each row alone
            ids = torch.tensor(tokens[b, :length[b]][None], dtype=torch.long)
            want = processor(ids, torch.tensor(scores[b][None]))[0].numpy()
            np.testing.assert_array_equal(ours[b], want)
    assert (ours != scores).any()


def test_watermark_runs_after_the_warpers_and_before_renormalize():
    rng = np.random.default_rng(1)
    scores = jnp.asarray(rng.normal(size=(2, V)).astype(np.float32))
    ctx = ProcessorContext(tokens=jnp.array([[4, 0], [7, 0]]), length=jnp.array([1, 1]),
                           prompt_len=jnp.array([1, 1]))
    wm = WatermarkingConfig(bias=3.0)
    cfg = GenerationConfig(do_sample=True, top_k=0, temperature=0.5, watermarking_config=wm,
                           renormalize_logits=True)
    plain_cfg = cfg.replace(watermarking_config=None, renormalize_logits=False)

    @jax.jit
    def both(scores, ctx):
        plain = process_logits(plain_cfg, scores, ctx)
        return process_logits(cfg, scores, ctx), jax.nn.log_softmax(
            green_list_bias(plain, ctx, wm), axis=-1)

    ours, want = both(scores, ctx)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(want), rtol=1e-6)


def hf_detector(fields: dict, vocab: int = V, bos: int = V + 1, **kwargs) -> HFDetector:
    """HF's detector (its BOS check needs an int: the default V + 1 is never in the ids)."""
    config = transformers.LlamaConfig(vocab_size=vocab, bos_token_id=bos)
    return HFDetector(model_config=config, device="cpu",
                      watermarking_config=WatermarkingConfig(**fields).to_dict(), **kwargs)


@pytest.mark.parametrize("fields, ignore_repeated", [
    pytest.param(f, ignore, id=f"{f['seeding_scheme']}-{f['context_width']}-{ignore}",
                 marks=slow_unless(f["context_width"] == 1
                                   and (f["seeding_scheme"] == "selfhash") == ignore))
    for f in SCHEMES for ignore in (False, True)])
def test_detector_matches_transformers_on_random_ids(fields, ignore_repeated):
    rng = np.random.default_rng(2)
    ids = rng.integers(1, 30, size=(3, 25))  # a small alphabet: repeated n-grams
    ids[:, 0] = 0  # a BOS on every row: both drop it
    ours = WatermarkDetector(fields, V, bos_token_id=0, ignore_repeated_ngrams=ignore_repeated)
    theirs = hf_detector(fields, bos=0, ignore_repeated_ngrams=ignore_repeated)
    a = ours(ids, return_dict=True)
    b = theirs(torch.tensor(ids), return_dict=True)
    for name in ("num_tokens_scored", "num_green_tokens", "z_score", "p_value", "prediction"):
        np.testing.assert_allclose(getattr(a, name), getattr(b, name), rtol=1e-12,
                                   err_msg=name)


@pytest.fixture(scope="module")
def generated():
    """jaxgen samples with and without the lefthash watermark from one bigram model."""
    model, params = BigramStub(vocab_size=V), random_table(V, seed=11, scale=1.0)
    prompts = [[int(t)] for t in np.random.default_rng(3).integers(0, V, size=8)]
    base = GenerationConfig(do_sample=True, max_new_tokens=40, top_k=0)
    out = {}
    for name, wm in (("plain", None), ("marked", WatermarkingConfig(bias=4.0))):
        cfg = base.replace(watermarking_config=wm)
        state = jaxgen.init_state(model, prompts, cfg, jax.random.key(5))
        out[name] = np.asarray(jaxgen.generate(params, state, cfg).sequences)
    return out


def test_detection_finds_watermarked_text_and_agrees_with_transformers(generated):
    ours = WatermarkDetector(WatermarkingConfig(bias=4.0), V)
    theirs = hf_detector(dict(bias=4.0))
    for name, ids in generated.items():
        a = ours(ids, return_dict=True)
        b = theirs(torch.tensor(ids), return_dict=True)
        np.testing.assert_allclose(a.z_score, b.z_score, rtol=1e-12)
        if name == "marked":
            assert (a.z_score > 4).all() and a.prediction.all(), a.z_score
        else:
            assert (np.abs(a.z_score) < 3.5).all() and not a.prediction.any(), a.z_score


def test_a_wrong_key_finds_nothing(generated):
    other = WatermarkDetector(WatermarkingConfig(bias=4.0, hashing_key=7), V)
    assert (np.abs(other(generated["marked"], return_dict=True).z_score) < 3.5).all()


@pytest.mark.slow
def test_greedy_selfhash_generation_is_all_green():
    """HF watermarks greedy decoding too: with a bias far above the logits, every new token
    is one of the (self-seeded) green candidates."""
    model, params = BigramStub(vocab_size=V), random_table(V, seed=12, scale=1.0)
    wm = WatermarkingConfig(seeding_scheme="selfhash", bias=1e4, hashing_key=99)
    cfg = GenerationConfig(max_new_tokens=12, watermarking_config=wm)
    out = jaxgen.generate(params, jaxgen.init_state(model, [[5], [6]], cfg), cfg)
    new = np.asarray(out.sequences)[:, 1:13]  # the 12 new tokens of each row
    counts = WatermarkDetector(wm, V)(new, return_dict=True)
    assert (counts.num_green_tokens == counts.num_tokens_scored).all()
    assert counts.z_score.min() > 5


@pytest.mark.parametrize("value, needle", [
    ({"seeding_scheme": "minhash"}, "seeding_scheme` must be one of"),
    ({"greenlist_ratio": 1.0}, "greenlist_ratio` must be a float in the open interval"),
    ({"greenlist_ratio": 0.0}, "greenlist_ratio` must be a float in the open interval"),
    ({"context_width": 0}, "context_width` must be an int >= 1"),
    ({"seeding_scheme": "selfhash", "context_width": 2}, "not supported for generation"),
    ({"hashing_key": 2**32}, "hashing_key` must be an int in \\[0, 2\\*\\*32\\)"),
    ({"bias": float("nan")}, "bias` must be a finite float"),
    ({"gamma": 0.25}, "unknown key\\(s\\) \\['gamma'\\]"),
    ("lefthash", "must be a WatermarkingConfig"),
])
def test_bad_configs_are_refused_before_compile(value, needle):
    with pytest.raises(ValueError, match=needle):
        GenerationConfig(watermarking_config=value)


def test_hugging_faces_config_object_is_accepted():
    theirs = transformers.WatermarkingConfig(bias=2.5, seeding_scheme="selfhash")
    cfg = GenerationConfig(watermarking_config=theirs)
    assert cfg.watermarking_config == WatermarkingConfig(bias=2.5, seeding_scheme="selfhash")
    assert GenerationConfig(watermarking_config={"bias": 2.5, "seeding_scheme": "selfhash"}
                            ) == cfg

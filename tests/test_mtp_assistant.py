"""The MTP drafter assistant (`assistant_model=(MtpDrafterModel, params)`): a light model that
drafts from the target's hidden state, embeddings, LM head and KV cache.

Greedy equality with plain greedy (Llama, a GQA / Qwen3-style target, other cache kinds,
SmolLM2; batch 1 and a ragged batch of 4), what the drafter reads from the cache, lossless
sampling and the static ensemble (chi-square against exactly computed distributions), batch
invariance, one compile per bucket, the chunked driver, statistics, bad input before compiling,
and the checkpoint folder.
"""
from __future__ import annotations

import dataclasses
import json
import os
import threading

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from exact_sampling import (
    SMALL_V,
    TEMPERATURE,
    TOP_K,
    assert_follows,
    chi_square,
    first_three_counts,
    next_probs,
    processed_probs,
    three_token_joint,
)
from test_chunked import Collect
from test_early_exit import RAGGED

import jaxgen
from jaxgen import stopping
from jaxgen.models import load, tiny_llama
from jaxgen.models.mtp_drafter import MODEL_TYPE, MtpDrafterConfig, MtpDrafterModel
from jaxgen.models.mtp_drafter_io import load_mtp_drafter, save_mtp_drafter
from jaxgen.models.safetensors_io import read_safetensors, write_safetensors
from jaxgen.speculative.drafters.draft_model import DraftModelDrafter
from jaxgen.speculative.drafters.mtp_assistant import MtpAssistantDrafter

LLAMA = tiny_llama(seed=4, num_layers=3, vocab_size=64, hidden_size=32, intermediate_size=64,
                   num_heads=4, num_kv_heads=2)
# GQA with one kv head, head_dim != hidden / heads, Qwen3's q/k norms and biases (a tied head
# is SmolLM2's; a tiny random tied model only repeats its last token)
QWEN_LIKE = tiny_llama(seed=5, num_layers=2, vocab_size=64, hidden_size=32,
                       intermediate_size=64, num_heads=4, num_kv_heads=1, head_dim=16,
                       qk_norm=True, attention_bias=True)


def near_bigram_drafter(target, seed: int = 1, num_layers: int = 2, scale: float = 0.05,
                        kv_layers=None):
    """A drafter that mostly agrees with a small random target: the projections pass the
    token's embedding through (so it drafts what the target predicts from the token alone),
    perturbed by random layers that read the target's cache and hidden state. Some drafts are
    accepted, some rejected: both paths of the loop run."""
    hidden = target.config.hidden_size
    model = MtpDrafterModel(MtpDrafterConfig.for_target(
        target.config, hidden_size=hidden, intermediate_size=2 * hidden, num_layers=num_layers,
        kv_layers=kv_layers))
    params = model.init_params(jax.random.key(seed), scale=scale)
    eye = jnp.eye(hidden)
    params = {**params,
              "pre_projection": jnp.concatenate([eye, params["pre_projection"][hidden:]], 0),
              "post_projection": eye + params["post_projection"]}
    return model, params


def run(target_pair, cfg, prompts, assistant=None, key=None, **kw):
    model, params = target_pair
    if assistant is not None:
        kw["assistant_model"] = assistant
    return jaxgen.generate(params, jaxgen.init_state(model, prompts, cfg, key), cfg, **kw)


def check_greedy(target_pair, prompts, assistant, **fields):
    """Assisted greedy == plain greedy; returns the assisted output."""
    plain_cfg = jaxgen.GenerationConfig(max_new_tokens=16, **fields)
    plain = run(target_pair, plain_cfg, prompts)
    cfg = plain_cfg.replace(num_assistant_tokens=3, assistant_confidence_threshold=0.0)
    out = run(target_pair, cfg, prompts, assistant)
    chex.assert_trees_all_equal(out.sequences, plain.sequences)
    chex.assert_trees_all_equal(out.lengths, plain.lengths)
    return out


# ------------------------------------------------------------------------- greedy
def test_greedy_equals_plain_greedy_ragged_batch_compiles_once_and_fills_stats():
    assistant = near_bigram_drafter(LLAMA[0], kv_layers=(2, 0))
    out = check_greedy(LLAMA, RAGGED, assistant)
    stats = out.speculative
    drafted, accepted = np.asarray(stats.drafted), np.asarray(stats.accepted)
    assert 0 < accepted.sum() < drafted.sum()  # accepted and rejected drafts both happen
    assert (np.asarray(stats.rounds) > 0).all()
    assert int(stats.target_forwards) == int(np.max(stats.rounds)) + 1  # prefill + rounds
    # one drafter step per draft position of the round's longest draft
    assert int(np.max(drafted)) <= int(stats.draft_forwards) <= 3 * int(np.max(stats.rounds))
    assert int(stats.verified_positions) >= int(np.max(stats.rounds))
    tried = np.asarray(stats.position_tried).sum(1)
    np.testing.assert_array_equal(tried, drafted)
    # the same bucket with other prompts and other drafter weights: nothing recompiles
    cfg = jaxgen.GenerationConfig(max_new_tokens=16, num_assistant_tokens=3,
                                  assistant_confidence_threshold=0.0)
    before = jaxgen.trace_count()
    other = near_bigram_drafter(LLAMA[0], seed=2, kv_layers=(2, 0))
    again = run(LLAMA, cfg, [[1, 2, 3], [4], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20,
                                              21, 22, 23, 24], [30, 31]], other)
    assert jaxgen.trace_count() == before
    assert int(np.sum(again.speculative.drafted)) > 0


def test_tokenizers_passed_with_an_mtp_drafter_keep_plain_assisted_decoding():
    # the CLI passes both tokenizers with every assistant; an MTP drafter drafts in the
    # target's own tokens (its vocabulary is its draft vocabulary), so it is not UAD
    from jaxgen.speculative.uad.bridge import universal_assistant

    drafter = near_bigram_drafter(LLAMA[0])
    tokenizer = object()  # never read for an MTP drafter
    assert universal_assistant(drafter, tokenizer, tokenizer, LLAMA[0]) is drafter


@pytest.mark.slow
@pytest.mark.parametrize("target", ["llama", "qwen_like"])
@pytest.mark.parametrize("prompts", [RAGGED[:1], RAGGED], ids=["batch1", "ragged4"])
def test_greedy_equals_plain_greedy(target, prompts):
    pair = LLAMA if target == "llama" else QWEN_LIKE
    kv_layers = (2, 0) if target == "llama" else (1, 1)
    out = check_greedy(pair, prompts, near_bigram_drafter(pair[0], kv_layers=kv_layers))
    assert 0 < int(np.sum(out.speculative.accepted)) < int(np.sum(out.speculative.drafted))


@pytest.mark.slow
@pytest.mark.parametrize("kind, options", [
    ("quantized", {"residual_length": 4}), ("sliding_window", {"sliding_window": 6})])
def test_greedy_equals_plain_greedy_on_other_cache_kinds(kind, options):
    check_greedy(LLAMA, RAGGED, near_bigram_drafter(LLAMA[0]), cache_implementation=kind,
                 cache_config=options)


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_equals_plain_greedy_on_smollm2(batch):
    from model_fixtures import smollm2_load  # torch: imported only here

    model, params, tokenizer = smollm2_load()
    questions = ["What is the capital of France?", "Name three colors.",
                 "Write a haiku about rain, please, in English.", "Hi"][:batch]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}])
               for q in questions]
    drafter = MtpDrafterModel(MtpDrafterConfig.for_target(
        model.config, hidden_size=256, intermediate_size=512, num_layers=2))
    assistant = (drafter, drafter.init_params(jax.random.key(0)))
    out = check_greedy((model, params), prompts, assistant, eos_token_id=None)
    assert int(np.sum(out.speculative.drafted)) > 0


# ------------------------------------------------------------------------- what it reads
def test_the_drafter_reads_the_verified_cache_entries_and_the_hidden_state():
    target, target_params = LLAMA
    drafter, params = near_bigram_drafter(target, scale=0.5, kv_layers=(2, 0))
    tokens = jnp.array([[5, 9, 11, 5, 9, 3]])  # position 5 holds the newest token
    forward = jax.jit(lambda p, t, pos, c: target(p, t, pos, c).cache)
    cache = forward(target_params, tokens, jnp.arange(6)[None], target.init_cache(1, 8))
    step = jax.jit(lambda cache, hidden: drafter.step(params, target, target_params,
                                                      jnp.array([3]), hidden, jnp.array([5]),
                                                      cache)[0])
    hidden = jax.random.normal(jax.random.key(0), (1, 32))
    logits = step(cache, hidden)
    noise = jax.random.normal(jax.random.key(1), cache.k.shape)  # [L, B, Hkv, T, Dh]
    stale = cache.k.at[:, :, :, 5:].add(noise[:, :, :, 5:])  # positions >= 5: not verified
    np.testing.assert_array_equal(step(dataclasses.replace(cache, k=stale), hidden), logits)
    for layer in (0, 2):  # the layers it reads
        verified = cache.k.at[layer, :, :, 4].add(noise[layer, :, :, 4])
        assert not np.allclose(step(dataclasses.replace(cache, k=verified), hidden), logits)
    unread = cache.k.at[1].add(noise[1])  # layer 1: no drafter layer reads it
    np.testing.assert_array_equal(step(dataclasses.replace(cache, k=unread), hidden), logits)
    assert not np.allclose(step(cache, hidden * 2.0 + 1.0), logits)


# ------------------------------------------------------------------------- sampling
def _tiny_vocab_target_and_drafter():
    model, params = tiny_llama(seed=9, num_layers=3, vocab_size=SMALL_V)
    params = {**params, "embed": params["embed"] * 4.0}  # a peaked, context-dependent model
    drafter = MtpDrafterModel(MtpDrafterConfig.for_target(
        model.config, hidden_size=16, intermediate_size=32, num_layers=2, kv_layers=(0, 0)))
    return (model, params), (drafter, drafter.init_params(jax.random.key(3), scale=0.8))


def test_sampling_is_lossless():
    (model, params), assistant = _tiny_vocab_target_and_drafter()
    prompt = [2, 3, 2, 3, 2]
    exact = three_token_joint(model, params, prompt)  # [V, V, V]
    rows = 12000
    cfg = jaxgen.GenerationConfig(do_sample=True, temperature=TEMPERATURE, top_k=TOP_K,
                                  max_new_tokens=4, num_assistant_tokens=2,
                                  assistant_confidence_threshold=0.0)
    out = run((model, params), cfg, [prompt] * rows, assistant, key=jax.random.key(11))
    counts = first_three_counts(out.sequences, len(prompt), SMALL_V)  # [V, V, V]
    assert_follows(counts, exact)
    accepted, drafted = int(np.sum(out.speculative.accepted)), int(np.sum(out.speculative.drafted))
    assert 0 < accepted < drafted  # q differs from p: some drafts are rejected


@pytest.mark.slow
def test_the_static_ensemble_follows_the_mixture():
    """With one draft per round, the token after the first round follows v = w p + (1 - w) q,
    where q is the drafter's processed distribution, computed here from its own step."""
    (model, params), (drafter, dparams) = _tiny_vocab_target_and_drafter()
    prompt, w, rows = [2, 3, 2, 3, 2], 0.4, 16000
    p1 = next_probs(model, params, [prompt])[0]  # [V]
    p2 = next_probs(model, params, [prompt + [a] for a in range(SMALL_V)])  # [V, V]
    P = len(prompt)
    out = model(params, jnp.asarray([prompt]), jnp.arange(P)[None], model.init_cache(1, P + 2))
    tokens = jnp.arange(SMALL_V, dtype=jnp.int32)  # every first token t1, one row each
    cache = dataclasses.replace(out.cache, k=jnp.repeat(out.cache.k, SMALL_V, 1),
                                v=jnp.repeat(out.cache.v, SMALL_V, 1),
                                length=jnp.repeat(out.cache.length, SMALL_V))  # V rows
    hidden = jnp.repeat(out.hidden[:, -1], SMALL_V, 0)  # [V, D] what predicted t1
    logits, _ = drafter.step(dparams, model, params, tokens, hidden,
                             jnp.full((SMALL_V,), P, jnp.int32), cache)
    q2 = processed_probs(np.asarray(logits, np.float64))  # [V, V]
    cfg = jaxgen.GenerationConfig(do_sample=True, temperature=TEMPERATURE, top_k=TOP_K,
                                  max_new_tokens=3, num_assistant_tokens=1,
                                  assistant_confidence_threshold=0.0,
                                  assistant_ensemble_weight=w)
    result = run((model, params), cfg, [prompt] * rows, (drafter, dparams),
                 key=jax.random.key(2))
    new = np.asarray(result.sequences)[:, P:P + 2]  # [rows, 2]
    counts = np.zeros((SMALL_V, SMALL_V))
    np.add.at(counts, (new[:, 0], new[:, 1]), 1)
    assert (np.asarray(result.speculative.position_tried)[:, 0] > 0).all()
    assert chi_square(counts, p1[:, None] * (w * p2 + (1 - w) * q2)) > 1e-3
    # the mixture is visibly not p: tokens outside the target's top-k come from q
    assert counts[p1[:, None] * p2 == 0].sum() > 0.05 * rows


@pytest.mark.slow
def test_sampled_rows_do_not_depend_on_the_batch():
    cfg = jaxgen.GenerationConfig(max_new_tokens=12, do_sample=True, temperature=0.9,
                                  num_assistant_tokens=3, assistant_confidence_threshold=0.0)
    assistant = near_bigram_drafter(LLAMA[0])
    keys = jax.random.split(jax.random.key(5), len(RAGGED))
    batched = np.asarray(run(LLAMA, cfg, RAGGED, assistant, key=keys).sequences)
    for b, prompt in enumerate(RAGGED):
        alone = np.asarray(run(LLAMA, cfg, [prompt], assistant, key=keys[b:b + 1]).sequences)
        n = len(prompt) + 12
        np.testing.assert_array_equal(alone[0, :n], batched[b, :n])


# ------------------------------------------------------------------------- chunked driver
@pytest.mark.slow
def test_streaming_max_time_and_cancellation_through_the_chunked_driver():
    cfg = jaxgen.GenerationConfig(max_new_tokens=16, num_assistant_tokens=3,
                                  assistant_confidence_threshold=0.0)
    assistant = near_bigram_drafter(LLAMA[0])
    single = run(LLAMA, cfg, RAGGED, assistant)
    streamers = [Collect() for _ in RAGGED]
    chunked = run(LLAMA, cfg, RAGGED, assistant, streamer=streamers, chunk_size=2)
    chex.assert_trees_all_equal(chunked.sequences, single.sequences)
    chex.assert_trees_all_equal(chunked.speculative.accepted, single.speculative.accepted)
    for b, streamer in enumerate(streamers):
        assert streamer.ended
        assert sum(streamer.puts, []) == np.asarray(single.sequences)[
            b, :int(single.lengths[b])].tolist()
    event = threading.Event()
    event.set()  # cancelled before the second chunk: the prefill token only
    cancelled = run(LLAMA, cfg, RAGGED, assistant, stop_event=event)
    np.testing.assert_array_equal(np.asarray(cancelled.lengths),
                                  [len(p) + 1 for p in RAGGED])
    assert (np.asarray(cancelled.stop_reason) == stopping.CANCELLED).all()
    timed = run(LLAMA, cfg.replace(max_time=1e-6), RAGGED, assistant, chunk_size=1)
    assert (np.asarray(timed.stop_reason) == stopping.MAX_TIME).all()
    assert (np.asarray(timed.lengths) < np.asarray(single.lengths)).all()


# ------------------------------------------------------------------------- bad input
def test_bad_input_fails_before_compiling(tmp_path):
    target, _ = LLAMA
    drafter, params = near_bigram_drafter(target)
    cfg = jaxgen.GenerationConfig(max_new_tokens=4)
    before = jaxgen.trace_count()
    wider = dataclasses.replace(target.config, hidden_size=48, num_layers=4)
    wrong = MtpDrafterModel(MtpDrafterConfig.for_target(wider, hidden_size=8,
                                                        intermediate_size=8, num_layers=2))
    with pytest.raises(ValueError, match=r"built for a target with hidden_size=48, "
                                         r"num_hidden_layers=4, but the target model \(Llama\) "
                                         r"has hidden_size=32, num_hidden_layers=3"):
        run(LLAMA, cfg, RAGGED, (wrong, params))
    with pytest.raises(ValueError, match=r"params\['layers'\]\['wq'\] has shape"):
        run(LLAMA, cfg, RAGGED, (drafter, {**params, "layers": {
            **params["layers"], "wq": params["layers"]["wq"][:, :, :-1]}}))
    for fields, needle in [(dict(prompt_lookup_num_tokens=3), "prompt_lookup_num_tokens"),
                           (dict(assistant_early_exit=1), "assistant_early_exit"),
                           (dict(use_mtp=True), "use_mtp"),
                           (dict(num_beams=2), "beam search")]:
        with pytest.raises(ValueError, match=needle):
            run(LLAMA, cfg.replace(**fields), RAGGED, (drafter, params))
    assert jaxgen.trace_count() == before
    # the stand-alone draft-model kind leaves the MTP drafter to its own kind
    assert DraftModelDrafter.from_request(cfg, target, (drafter, params)) is None
    built, _ = MtpAssistantDrafter.from_request(cfg, target, (drafter, params))
    assert built.reads == {"params", "hidden", "cache"}


def test_checkpoint_folder_round_trip_and_strict_loading(tmp_path):
    drafter, params = near_bigram_drafter(QWEN_LIKE[0], kv_layers=(1, 0))
    folder = save_mtp_drafter(drafter, params, str(tmp_path / "drafter"))
    config = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert config["model_type"] == MODEL_TYPE
    assert config["architectures"] == ["JaxgenMtpDrafter"]
    assert config["target"] == {"hidden_size": 32, "num_attention_heads": 4,
                                "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 64,
                                "num_hidden_layers": 2, "kv_layers": [1, 0]}
    loaded, loaded_params, tokenizer = load(folder)
    assert tokenizer is None
    assert loaded.config == drafter.config and loaded.config.q_norm
    chex.assert_trees_all_close(loaded_params, params)
    # wrong shapes, unexpected, missing and non-finite tensors are refused, naming them
    path = os.path.join(folder, "model.safetensors")
    tensors = read_safetensors(path)
    for change, needle in [
            (dict(tensors, **{"layers.1.self_attn.q_proj.weight": np.zeros((64, 31),
                                                                            np.float32)}),
             r"'layers.1.self_attn.q_proj.weight' has shape \(64, 31\), expected \(64, 32\)"),
            (dict(tensors, extra=np.zeros(2, np.float32)), "does not use: extra"),
            ({k: v for k, v in tensors.items() if k != "norm.weight"}, "missing tensor "
                                                                       "'norm.weight'"),
            (dict(tensors, **{"norm.weight": np.full(32, np.nan, np.float32)}), "non-finite")]:
        write_safetensors(path, change)
        with pytest.raises(ValueError, match=needle):
            load_mtp_drafter(folder)
    write_safetensors(path, tensors)
    config["target"]["kv_layers"] = [1, 5]
    (tmp_path / "drafter" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"kv_layers=\[1, 5\].*target_num_layers=2"):
        load(folder)

"""MTP layers from the checkpoint (`use_mtp=True`): loading them from Hugging Face folders, every
depth's logits against transformers' MtpModel, HF's generate(use_mtp=True) token for token and
round for round, greedy equal to plain greedy (ragged batches, K > depths), lossless sampling
(chi-square against exactly computed distributions), one compile across calls, and bad input
before compiling.
"""
from __future__ import annotations

import itertools
import json

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
from jaxgen.drivers.chunked import ChunkTimings
from jaxgen.models import load, tiny_llama
from jaxgen.models.mtp import teacher_forced_logits, with_mtp
from jaxgen.models.mtp_checkpoint import save_mtp_checkpoint
from jaxgen.models.safetensors_io import read_safetensors, write_safetensors
from jaxgen.speculative.drafters.mtp_layers import MtpDrafter

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LLAMA = tiny_llama(seed=4, num_layers=2, vocab_size=64, hidden_size=32, intermediate_size=64,
                   num_heads=4, num_kv_heads=2, tie_word_embeddings=False)


def near_target_mtp(pair, depths: int, seed: int = 1):
    """(model, params) with D random MTP depths whose projection passes the token's embedding
    through (so a depth drafts roughly what the target predicts from the token alone), perturbed
    by random blocks that attend over the depth's cache: some drafts are accepted, some not."""
    model, params = with_mtp(*pair, jax.random.key(seed), depths=depths)
    hidden = model.config.hidden_size
    eye = jnp.concatenate([jnp.eye(hidden), jnp.zeros((hidden, hidden))])[None]  # [1, 2H, H]
    mtp = {**params["mtp"], "eh_proj": params["mtp"]["eh_proj"] + eye}
    return model, {**params, "mtp": mtp}


def run(pair, cfg, prompts, key=None, **kw):
    model, params = pair
    return jaxgen.generate(params, jaxgen.init_state(model, prompts, cfg, key), cfg, **kw)


def hf_with_mtp(pair, folder):
    """transformers' model of the same weights, with the MTP layers registered as the main
    class's ignored keys (as DeepSeek-V3 registers its own) so that MtpModel finds them."""
    model, params = pair
    save_mtp_checkpoint(model, params, str(folder))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder),
                                                           attn_implementation="eager").eval()
    first = model.config.num_layers
    hf._keys_to_ignore_on_load_unexpected = [
        rf"model\.layers\.{first + k}\..*" for k in range(model.config.num_mtp_layers)]
    return hf


# ------------------------------------------------------------------------- parity with HF
@pytest.mark.parametrize("depths", [2, pytest.param(1, marks=pytest.mark.slow)])
def test_every_depth_equals_transformers_mtp_model(tmp_path, depths):
    from transformers.cache_utils import MtpCache
    from transformers.modeling_layers import MtpModel

    model, params = near_target_mtp(LLAMA, depths)
    params = {**params, "mtp": {**params["mtp"], "enorm": params["mtp"]["enorm"] + 0.3
                                * jax.random.normal(jax.random.key(7), (depths, 32))}}
    hf = hf_with_mtp((model, params), tmp_path)
    mtp = MtpModel.from_pretrained(hf)
    tokens = np.array([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]])
    count = tokens.shape[1] - depths
    positions = jnp.arange(count)[None]
    hidden = model(params, jnp.asarray(tokens[:, :count]), positions,
                   model.init_cache(1, count)).hidden  # [1, P, H]
    ours = teacher_forced_logits(model, params, jnp.asarray(tokens), hidden)
    with torch.no_grad():
        state = hf(torch.tensor(tokens[:, :count]), output_hidden_states=True).hidden_states[-1]
        cache = MtpCache(config=hf.config.get_mtp_config())
        for depth in range(depths):
            window = slice(1 + depth, 1 + depth + count)  # positions 1+k .. P+k
            state = mtp.forward_layer(depth, state, torch.arange(window.start, window.stop)[None],
                                      cache, input_ids=torch.tensor(tokens[:, window]))
            want = mtp._project_to_logits(state).numpy()  # [1, P, V]
            np.testing.assert_allclose(np.asarray(ours[depth]), want, atol=1e-4, rtol=0)


def _hf_rounds(hf, prompt, new):
    """HF's greedy generate(use_mtp=True): (tokens, accepted drafts per round)."""
    from transformers.generation.candidate_generator import MTPCandidateGenerator

    matches, original = [], MTPCandidateGenerator.get_candidates

    def record(self, *args, **kwargs):
        if not kwargs.get("is_first_iteration", args[3] if len(args) > 3 else False):
            matches.append(int(kwargs.get("n_last_matches", args[4] if len(args) > 4 else 0)))
        return original(self, *args, **kwargs)

    MTPCandidateGenerator.get_candidates = record
    try:
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), use_mtp=True, do_sample=False,
                              max_new_tokens=new, pad_token_id=0)
    finally:
        MTPCandidateGenerator.get_candidates = original
    return out[0].tolist(), matches[1:]  # the first call follows the prefill


def _jaxgen_rounds(pair, prompt, new, **fields):
    """jaxgen's greedy use_mtp run, one round per chunk: (tokens, accepted per round)."""
    cfg = jaxgen.GenerationConfig(max_new_tokens=new, use_mtp=True, **fields)
    timings = ChunkTimings()

    class ByChunk(Collect):  # each token put, tagged with the chunk (round) it came in
        chunk_of: list = []

        def put(self, value):
            super().put(value)
            self.chunk_of.append(len(timings.chunk_s))

    out = run(pair, cfg, [prompt], streamer=ByChunk(), chunk_size=1, timings=timings)
    emitted = [len(list(group)) for _, group in itertools.groupby(ByChunk.chunk_of)]
    # the first chunk is the prompt and the prefill's token; each later one a round
    return (np.asarray(out.sequences[0, :int(out.lengths[0])]).tolist(),
            [m - 1 for m in emitted[1:]])


@pytest.mark.parametrize("depths", [2, pytest.param(1, marks=pytest.mark.slow),
                                    pytest.param(3, marks=pytest.mark.slow)])
def test_hf_generate_use_mtp_gives_the_same_tokens_and_rounds(tmp_path, depths):
    pair = near_target_mtp(LLAMA, depths)
    hf = hf_with_mtp(pair, tmp_path)
    prompt, new = [5, 3, 7, 1, 9], 24
    hf_tokens, hf_accepted = _hf_rounds(hf, prompt, new)
    # HF drafts every round: its round structure is jaxgen's without the plain-step fallback
    tokens, accepted = _jaxgen_rounds(pair, prompt, new, assistant_fallback=False)
    assert tokens == hf_tokens
    assert 0 < sum(accepted) < depths * len(accepted)  # accepted and rejected drafts
    # HF sees a round's matches at the start of the next round: all but the last compare
    assert accepted[:len(hf_accepted)] == hf_accepted


# ------------------------------------------------------------------------- greedy
@pytest.mark.parametrize("depths,width", [
    (2, 5), pytest.param(2, None, marks=pytest.mark.slow),
    pytest.param(1, 3, marks=pytest.mark.slow), pytest.param(3, None, marks=pytest.mark.slow)])
def test_greedy_equals_plain_greedy_ragged_batch_and_compiles_once(depths, width):
    pair = near_target_mtp(LLAMA, depths)
    fields = {} if width is None else dict(num_assistant_tokens=width)
    cfg = jaxgen.GenerationConfig(max_new_tokens=16, use_mtp=True, **fields)
    plain = run(pair, cfg.replace(use_mtp=False), RAGGED)
    out = run(pair, cfg, RAGGED)
    chex.assert_trees_all_equal(out.sequences, plain.sequences)
    chex.assert_trees_all_equal(out.lengths, plain.lengths)
    stats = out.speculative
    drafted, accepted = np.asarray(stats.drafted), np.asarray(stats.accepted)
    assert 0 < accepted.sum() < drafted.sum()
    assert np.asarray(stats.position_tried).shape[1] == (width or depths)  # K = D by default
    np.testing.assert_array_equal(np.asarray(stats.position_tried).sum(1), drafted)
    assert int(stats.target_forwards) == int(np.max(stats.rounds)) + 1
    # the same bucket with other prompts and other MTP weights: nothing recompiles
    before = jaxgen.trace_count()
    other = near_target_mtp(LLAMA, depths, seed=2)
    again = run(other, cfg, [[1, 2, 3], [4], list(range(20, 38)), [30, 31]])
    assert jaxgen.trace_count() == before
    assert int(np.sum(again.speculative.drafted)) > 0


@pytest.mark.slow
@pytest.mark.parametrize("kind,options", [("sliding_window", {"sliding_window": 64}),
                                          ("quantized", {"nbits": 8})])
def test_greedy_equals_plain_greedy_on_other_cache_kinds(kind, options):
    pair = near_target_mtp(LLAMA, 2)
    cfg = jaxgen.GenerationConfig(max_new_tokens=16, use_mtp=True, cache_implementation=kind,
                                  cache_config=options)
    plain = run(pair, cfg.replace(use_mtp=False), RAGGED)
    chex.assert_trees_all_equal(run(pair, cfg, RAGGED).sequences, plain.sequences)


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_equals_plain_greedy_on_smollm2(batch):
    model, params, tokenizer = load("smollm2-135m-instruct")
    pair = with_mtp(model, params, jax.random.key(3), depths=1)
    texts = ["The capital of France is", "def add(a, b):", "1, 2, 3, 4,", "Once upon a time"]
    prompts = [tokenizer.encode(t) for t in texts[:batch]]
    for width in (None, 3):
        fields = {} if width is None else dict(num_assistant_tokens=width)
        cfg = jaxgen.GenerationConfig(max_new_tokens=12, use_mtp=True, **fields)
        plain = run(pair, cfg.replace(use_mtp=False), prompts)
        chex.assert_trees_all_equal(run(pair, cfg, prompts).sequences, plain.sequences)


@pytest.mark.slow
def test_streaming_and_cancellation_through_the_chunked_driver():
    pair = near_target_mtp(LLAMA, 2)
    cfg = jaxgen.GenerationConfig(max_new_tokens=16, use_mtp=True)
    single = run(pair, cfg, RAGGED)
    streamers = [Collect() for _ in RAGGED]
    chunked = run(pair, cfg, RAGGED, streamer=streamers, chunk_size=2)
    chex.assert_trees_all_equal(chunked.sequences, single.sequences)
    assert all(s.ended for s in streamers)
    timed = run(pair, cfg.replace(max_time=1e-6), RAGGED, chunk_size=1)
    assert (np.asarray(timed.lengths) < np.asarray(single.lengths)).all()


# ------------------------------------------------------------------------- sampling
@pytest.mark.slow
def test_sampling_is_lossless():
    model, params = tiny_llama(seed=9, num_layers=3, vocab_size=SMALL_V)
    params = {**params, "embed": params["embed"] * 4.0}  # a peaked, context-dependent model
    pair = near_target_mtp((model, params), depths=2, seed=3)
    prompt = [2, 3, 2, 3, 2]
    exact = three_token_joint(model, params, prompt)  # [V, V, V]
    rows = 12000
    cfg = jaxgen.GenerationConfig(do_sample=True, temperature=TEMPERATURE, top_k=TOP_K,
                                  max_new_tokens=4, use_mtp=True)
    out = run(pair, cfg, [prompt] * rows, key=jax.random.key(11))
    counts = first_three_counts(out.sequences, len(prompt), SMALL_V)  # [V, V, V]
    assert_follows(counts, exact)
    accepted, drafted = int(np.sum(out.speculative.accepted)), int(np.sum(out.speculative.drafted))
    assert 0 < accepted < drafted  # q differs from p: some drafts are rejected


@pytest.mark.slow
def test_the_static_ensemble_follows_the_mixture():
    """One depth, one draft per round: the token after the first round follows
    v = w p + (1 - w) q, q the depth's processed distribution from teacher_forced_logits."""
    model, params = tiny_llama(seed=9, num_layers=3, vocab_size=SMALL_V)
    params = {**params, "embed": params["embed"] * 4.0}
    model, params = with_mtp(model, params, jax.random.key(5), depths=1)  # q far from p
    params = {**params, "mtp": {**params["mtp"], "eh_proj": params["mtp"]["eh_proj"] * 4.0}}
    prompt, w, rows = [2, 3, 2, 3, 2], 0.4, 16000
    P = len(prompt)
    p1 = next_probs(model, params, [prompt])[0]  # [V]
    p2 = next_probs(model, params, [prompt + [a] for a in range(SMALL_V)])  # [V, V]
    out = model(params, jnp.asarray([prompt]), jnp.arange(P)[None], model.init_cache(1, P))
    hidden = jnp.repeat(out.hidden, SMALL_V, 0)  # [V, P, D] the prompt's hidden states
    tokens = jnp.asarray([prompt + [a] for a in range(SMALL_V)], jnp.int32)  # [V, P + 1]
    logits = teacher_forced_logits(model, params, tokens, hidden)[0][:, P - 1]  # [V, V]
    q2 = processed_probs(np.asarray(logits, np.float64))  # [V, V] q of t2 given t1
    cfg = jaxgen.GenerationConfig(do_sample=True, temperature=TEMPERATURE, top_k=TOP_K,
                                  max_new_tokens=3, num_assistant_tokens=1, use_mtp=True,
                                  assistant_ensemble_weight=w)
    result = run((model, params), cfg, [prompt] * rows, key=jax.random.key(2))
    new = np.asarray(result.sequences)[:, P:P + 2]  # [rows, 2]
    counts = np.zeros((SMALL_V, SMALL_V))
    np.add.at(counts, (new[:, 0], new[:, 1]), 1)
    mixture, target = p1[:, None] * (w * p2 + (1 - w) * q2), p1[:, None] * p2  # [V, V]
    assert chi_square(counts, mixture) > 1e-3
    # the mixture is visibly not p, and the counts follow the mixture, not p
    assert 0.5 * np.abs(mixture - target).sum() > 0.05
    seen = counts / rows
    assert 0.5 * np.abs(seen - mixture).sum() < 0.25 * np.abs(seen - target).sum()


@pytest.mark.slow
def test_a_row_samples_the_same_alone_and_in_a_batch():
    pair = near_target_mtp(LLAMA, 2)
    cfg = jaxgen.GenerationConfig(do_sample=True, max_new_tokens=12, use_mtp=True)
    keys = jax.random.split(jax.random.key(7), len(RAGGED))
    batch = run(pair, cfg, RAGGED, key=keys)
    for row, prompt in enumerate(RAGGED):
        alone = run(pair, cfg, [prompt], key=keys[row:row + 1])
        got = np.asarray(batch.sequences)[row, :int(batch.lengths[row])]
        np.testing.assert_array_equal(np.asarray(alone.sequences)[0, :int(alone.lengths[0])],
                                      got)


# ------------------------------------------------------------------------- loading
def test_checkpoint_folder_round_trip_and_strict_loading(tmp_path):
    model, params = near_target_mtp(LLAMA, 2)
    folder = save_mtp_checkpoint(model, params, str(tmp_path / "ckpt"))
    loaded, loaded_params, _ = load(folder)
    assert loaded == model
    chex.assert_trees_all_equal(loaded_params["mtp"], params["mtp"])
    # DeepSeek's original config key, and the per-depth copies of the shared head / embeddings
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    config["num_nextn_predict_layers"] = config.pop("num_mtp_layers")
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    tensors = read_safetensors(str(tmp_path / "ckpt" / "model.safetensors"))
    tensors["model.layers.3.shared_head.head.weight"] = tensors["lm_head.weight"]
    tensors["model.layers.3.embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
    write_safetensors(str(tmp_path / "ckpt" / "model.safetensors"), tensors)
    assert load(folder)[0].config.num_mtp_layers == 2
    # MTP weights of the wrong shape, missing, or without the config saying so
    bad = dict(tensors, **{"model.layers.2.eh_proj.weight": np.zeros((32, 32), np.float32)})
    write_safetensors(str(tmp_path / "ckpt" / "model.safetensors"), bad)
    with pytest.raises(ValueError, match=r"MTP tensor 'model\.layers\.2\.eh_proj\.weight' has "
                                         r"shape \(32, 32\), expected \(32, 64\)"):
        load(folder)
    missing = {k: v for k, v in tensors.items() if k != "model.layers.3.hnorm.weight"}
    write_safetensors(str(tmp_path / "ckpt" / "model.safetensors"), missing)
    with pytest.raises(ValueError, match=r"missing 1 tensor\(s\): model\.layers\.3\.hnorm"):
        load(folder)
    config.pop("num_nextn_predict_layers")
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    write_safetensors(str(tmp_path / "ckpt" / "model.safetensors"), tensors)
    with pytest.raises(ValueError, match=r"does not use: model\.layers\.2\..*0 MTP layer"):
        load(folder)


def test_params_check_names_the_mtp_entry():
    model, params = near_target_mtp(LLAMA, 2)
    model.check_params(params)
    with pytest.raises(ValueError, match=r"params\['mtp'\]\['layers'\]\['wq'\] has shape"):
        model.check_params({**params, "mtp": {**params["mtp"], "layers": {
            **params["mtp"]["layers"], "wq": params["mtp"]["layers"]["wq"][:, :, :-1]}}})
    with pytest.raises(ValueError, match=r"num_mtp_layers=0"):
        LLAMA[0].check_params(params)


# ------------------------------------------------------------------------- bad input
def test_bad_input_fails_before_compiling():
    pair = near_target_mtp(LLAMA, 2)
    model, params = pair
    cfg = jaxgen.GenerationConfig(max_new_tokens=4, use_mtp=True)
    before = jaxgen.trace_count()
    with pytest.raises(ValueError, match=r"use_mtp=True needs a model with MTP layers.*"
                                         r"num_mtp_layers=0"):
        run(LLAMA, cfg, RAGGED)
    with pytest.raises(ValueError, match=r"params have no 'mtp' entry, but the model has "
                                         r"num_mtp_layers=2"):
        run((model, LLAMA[1]), cfg, RAGGED)
    for fields, needle in [(dict(prompt_lookup_num_tokens=3), "prompt_lookup_num_tokens"),
                           (dict(assistant_early_exit=1), "assistant_early_exit"),
                           (dict(num_beams=2), r"use_mtp.*beam search")]:
        with pytest.raises(ValueError, match=needle):
            run(pair, cfg.replace(**fields), RAGGED)
    with pytest.raises(ValueError, match=r"cannot be combined with `assistant_model`"):
        run(pair, cfg, RAGGED, assistant_model=LLAMA)
    for bad in (1, "yes", None.__class__):
        with pytest.raises(ValueError, match=r"`use_mtp` must be True or False"):
            jaxgen.GenerationConfig(use_mtp=bad)
    assert jaxgen.trace_count() == before
    assert MtpDrafter.from_request(cfg.replace(use_mtp=False), model, None) is None
    drafter, _ = MtpDrafter.from_request(cfg.replace(num_assistant_tokens=5), model, None)
    assert drafter.num_tokens == 5 and not drafter.scheduled

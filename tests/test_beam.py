"""Beam search against transformers' generate(): same weights, same sequences, same scores.

Random models: a tiny random LlamaForCausalLM saved with save_pretrained and read back with
jaxgen.models.load(folder). The EOS id is a token the model's beams actually emit at the
second step, so some beams finish early. SmolLM2-135M-Instruct: the embedded GGUF weights,
dequantized, loaded into a transformers LlamaForCausalLM.

Per-row results are compared with HF run on that row alone *and* with HF's batched,
left-padded run (jaxgen right-pads, with per-row prompt lengths).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from model_fixtures import make_hf_model, save_hf_model

import jaxgen
from jaxgen import stopping

PAD = 0
MAX_NEW = 8
LENGTH_PENALTIES = (0.5, 1.0, 2.0)
RAGGED = [[7, 3, 11, 5, 9], [4, 8], [21, 30, 6]]


# ----------------------------------------------------------------------------- helpers
def hf_beam(hf, prompts, *, batched, **kw):
    """[[(generated ids, score)] * R per prompt], and beam_indices [B*R, N] (batched only)."""
    runs = [prompts] if batched else [[p] for p in prompts]
    rows, indices = [], None
    for group in runs:
        width = max(len(p) for p in group)
        ids = torch.tensor([[PAD] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=PAD,
                              return_dict_in_generate=True, output_scores=True, **kw)
        generated = (out.beam_indices != -1).sum(1).numpy()
        returns = kw.get("num_return_sequences", 1)
        for b in range(len(group)):
            rows.append([(out.sequences[i, width:width + generated[i]].tolist(),
                          float(out.sequences_scores[i]))
                         for i in range(b * returns, (b + 1) * returns)])
        indices = out.beam_indices.numpy()
    return rows, indices


def jax_beam(model, params, prompts, cfg):
    out = jaxgen.generate(params, jaxgen.init_state(model, prompts, cfg), cfg)
    seqs, lengths = np.asarray(out.sequences), np.asarray(out.lengths)
    plen, scores = np.asarray(out.prompt_lengths), np.asarray(out.sequences_scores)
    returns = cfg.num_return_sequences
    rows = [[(seqs[i, plen[i]:lengths[i]].tolist(), float(scores[i]))
             for i in range(b * returns, (b + 1) * returns)] for b in range(len(prompts))]
    return rows, out


def assert_same(actual, expected, context="", atol=1e-5, rtol=0.0):
    for b, (got, want) in enumerate(zip(actual, expected)):
        assert [s for s, _ in got] == [s for s, _ in want], f"row {b} {context}"
        np.testing.assert_allclose([x for _, x in got], [x for _, x in want], rtol=rtol,
                                   atol=atol, err_msg=f"row {b} {context}")


def pick_eos(hf, prompt, steps=4):
    """A token the 2nd-best beam emits at step 2: EOS with it makes some beams finish early."""
    with torch.no_grad():
        probe = hf.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False,
                            num_beams=4, num_return_sequences=4, pad_token_id=PAD,
                            eos_token_id=None)
    return int(probe[1, len(prompt) + 1])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf = make_hf_model("llama", seed=11)
    folder = save_hf_model(hf, str(tmp_path_factory.mktemp("tiny_llama")))
    model, params, _ = jaxgen.models.load(folder)
    return hf, model, params, pick_eos(hf, RAGGED[0])


# ------------------------------------------------------------------ random-model parity
# Two corners of the grid run in the default set, the rest in the slow set.
RANDOM_MODEL_GRID = [
    pytest.param(beams, early, returns,
                 marks=() if (beams, early, returns) in ((2, False, "one"), (4, "never", "all"))
                 else pytest.mark.slow)
    for beams in (2, 4) for early in (False, True, "never") for returns in ("one", "all")]


@pytest.mark.parametrize("num_beams,early_stopping,num_return", RANDOM_MODEL_GRID)
def test_matches_transformers_on_random_model(tiny, num_beams, early_stopping, num_return):
    hf, model, params, eos = tiny
    returns = 1 if num_return == "one" else num_beams
    early_eos = False
    for lp in LENGTH_PENALTIES:  # length_penalty is dynamic: one compile per batch shape
        kw = dict(num_beams=num_beams, max_new_tokens=MAX_NEW, early_stopping=early_stopping,
                  length_penalty=lp, num_return_sequences=returns, eos_token_id=eos)
        cfg = jaxgen.GenerationConfig(pad_token_id=PAD, return_dict_in_generate=True, **kw)
        alone, _ = hf_beam(hf, RAGGED, batched=False, **kw)
        batched, hf_indices = hf_beam(hf, RAGGED, batched=True, **kw)
        assert_same(batched, alone, "(HF batched vs HF alone)")
        if (num_beams, num_return) in ((4, "all"), (2, "one")):  # bounded compile count
            single, _ = jax_beam(model, params, RAGGED[:1], cfg)
            assert_same(single, alone[:1], f"batch 1, lp={lp}")
        ragged, out = jax_beam(model, params, RAGGED, cfg)
        assert_same(ragged, alone, f"ragged, lp={lp}")
        indices = np.asarray(out.beam_indices)
        width = hf_indices.shape[1]
        np.testing.assert_array_equal(indices[:, :width], hf_indices)
        assert (indices[:, width:] == -1).all()
        early_eos |= any(seq and seq[-1] == eos and len(seq) < MAX_NEW
                         for row in alone for seq, _ in row)
    assert early_eos, "the grid should exercise beams that finish early on EOS"


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("num_beams", [3, 5])
@pytest.mark.parametrize("early_stopping", [False, True, "never"])
def test_matches_transformers_larger_grid(tmp_path, seed, num_beams, early_stopping):
    hf = make_hf_model("llama", seed=seed)
    model, params, _ = jaxgen.models.load(save_hf_model(hf, str(tmp_path)))
    prompts = [[5 + seed, 9, 2 * seed + 1], [40, 41, 42, 43, 44, 45, 46], [12]]
    eos = (pick_eos(hf, prompts[0]), pick_eos(hf, prompts[1]))  # two EOS ids: W = 3K
    for lp in (-1.0, 0.0, 0.5, 1.0, 2.0):
        for returns in (1, 2, num_beams):
            kw = dict(num_beams=num_beams, max_new_tokens=12, early_stopping=early_stopping,
                      length_penalty=lp, num_return_sequences=returns, eos_token_id=list(eos))
            cfg = jaxgen.GenerationConfig(pad_token_id=PAD, **kw)
            alone, _ = hf_beam(hf, prompts, batched=False, **kw)
            got, _ = jax_beam(model, params, prompts, cfg)
            # lp = -1 multiplies scores by the length (|score| ~ 100s): fp32 needs rtol there
            assert_same(got, alone, f"lp={lp} R={returns}", rtol=1e-6)


def test_max_length_per_row_equals_each_row_alone(tiny):
    """With max_length (not max_new_tokens) each row's budget counts its own prompt."""
    hf, model, params, eos = tiny
    kw = dict(num_beams=3, max_length=10, num_return_sequences=2, eos_token_id=eos,
              early_stopping="never", length_penalty=1.5)
    alone, _ = hf_beam(hf, RAGGED, batched=False, **kw)
    got, _ = jax_beam(model, params, RAGGED, jaxgen.GenerationConfig(pad_token_id=PAD, **kw))
    assert_same(got, alone)


def _ban(token):
    return lambda scores, ctx: scores.at[:, token].set(-jnp.inf)


def _last_is(token):
    def criterion(ctx, scores):
        last = jnp.take_along_axis(ctx.tokens, (ctx.length - 1)[:, None], axis=1)[:, 0]
        return last == token
    return criterion


def test_history_processors_and_user_hooks_match_transformers(tiny):
    """Processors that read the history see each beam's own sequence; a user processor runs
    on every beam, a user stopping criterion on every candidate (HF's placement)."""
    from transformers import (
        LogitsProcessor,
        LogitsProcessorList,
        StoppingCriteria,
        StoppingCriteriaList,
    )

    hf, model, params, eos = tiny
    banned, stop_token = 17, pick_eos(hf, RAGGED[1])

    class Ban(LogitsProcessor):
        def __call__(self, input_ids, scores):
            scores[:, banned] = -float("inf")
            return scores

    class LastIs(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return input_ids[:, -1] == stop_token

    kw = dict(num_beams=3, max_new_tokens=MAX_NEW, num_return_sequences=3, eos_token_id=eos,
              repetition_penalty=1.3, no_repeat_ngram_size=2, min_new_tokens=2,
              length_penalty=0.8)
    expected, _ = hf_beam(hf, RAGGED, batched=False, logits_processor=LogitsProcessorList([Ban()]),
                          stopping_criteria=StoppingCriteriaList([LastIs()]), **kw)
    cfg = jaxgen.GenerationConfig(pad_token_id=PAD, **kw)
    ban, last_is = _ban(banned), _last_is(stop_token)
    out = jaxgen.generate(params, jaxgen.init_state(model, RAGGED, cfg), cfg,
                          logits_processor=[ban], stopping_criteria=[last_is])
    seqs, lengths = np.asarray(out.sequences), np.asarray(out.lengths)
    plen, scores = np.asarray(out.prompt_lengths), np.asarray(out.sequences_scores)
    got = [[(seqs[i, plen[i]:lengths[i]].tolist(), float(scores[i]))
            for i in range(3 * b, 3 * b + 3)] for b in range(len(RAGGED))]
    assert_same(got, expected)
    reasons = np.asarray(out.stop_reason)
    for i in range(len(seqs)):
        last = seqs[i, lengths[i] - 1]
        want = (stopping.EOS if last == eos else stopping.CUSTOM if last == stop_token
                else stopping.MAX_LENGTH)
        assert reasons[i] == want
    assert (reasons == stopping.CUSTOM).any()


def test_outputs_layout_and_stop_reasons(tiny):
    hf, model, params, eos = tiny
    cfg = jaxgen.GenerationConfig(num_beams=4, num_return_sequences=3, max_new_tokens=MAX_NEW,
                                  eos_token_id=eos, pad_token_id=PAD, output_scores=True,
                                  output_logits=True)
    out = jaxgen.generate(params, jaxgen.init_state(model, RAGGED, cfg), cfg)
    rows = len(RAGGED) * 3
    assert out.sequences.shape[0] == rows and out.sequences_scores.shape == (rows,)
    assert out.beam_indices is None  # HF returns them only with return_dict_in_generate
    assert out.scores.shape[:2] == (len(RAGGED) * 4, MAX_NEW)
    assert out.state is None
    np.testing.assert_array_equal(np.asarray(out.prompt_lengths),
                                  np.repeat([len(p) for p in RAGGED], 3))
    seqs, lengths = np.asarray(out.sequences), np.asarray(out.lengths)
    scores = np.asarray(out.sequences_scores).reshape(len(RAGGED), 3)
    assert (np.diff(scores, axis=1) <= 0).all()  # best first within each prompt
    for i in range(rows):
        assert (seqs[i, lengths[i]:] == PAD).all()
        ends_eos = seqs[i, lengths[i] - 1] == eos
        assert np.asarray(out.stop_reason)[i] == (stopping.EOS if ends_eos else stopping.MAX_LENGTH)
    # token_logprobs sum to the unpenalised score (length_penalty = 1: score * new length)
    new = lengths - np.asarray(out.prompt_lengths)
    np.testing.assert_allclose(np.asarray(out.token_logprobs).sum(1) / new,
                               np.asarray(out.sequences_scores), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------ SmolLM2
@pytest.fixture(scope="module")
def smollm2():
    from jaxgen.models.hf_export import hf_from_jaxgen

    model, params, tokenizer = jaxgen.models.load("smollm2-135m-instruct")
    hf = hf_from_jaxgen(model, params)  # the same (dequantized) weights in transformers
    chat = lambda text: tokenizer.apply_chat_template([{"role": "user", "content": text}])  # noqa
    prompts = [chat("What is 2+2? Answer with one number."), chat("Say hi.")]
    return hf, model, params, prompts, tuple(model.config.eos_token_id)


def scores_from_steps(out, length_penalty):
    """HF's rule: each returned row's score rebuilt as the sum of its transition scores
    (jaxgen.compute_transition_scores: the per-step running-beam scores [B*K, N, V] along
    its beam_indices) / new_len ** lp."""
    steps = np.asarray(jaxgen.compute_transition_scores(out))  # [B*R, N]
    new = np.asarray(out.lengths) - np.asarray(out.prompt_lengths)  # [B*R]
    return steps.sum(1) / (new.astype(np.float64) ** length_penalty).astype(np.float32)


# SmolLM2's logits (30 layers, XLA vs PyTorch CPU matmuls) differ from HF's by ~1e-5 per
# token (jaxgen's own cached and uncached forwards differ by as much); summed over a beam
# that is up to ~5e-5 in sequences_scores. The beam arithmetic itself is checked to 1e-5
# against the log-probs of the very run (HF's compute_transition_scores rule).
SMOLLM2_SCORE_ATOL = 1e-4


def _smollm2_case(smollm2, early_stopping, lp):
    hf, model, params, prompts, eos = smollm2
    kw = dict(num_beams=4, max_new_tokens=12, early_stopping=early_stopping,
              length_penalty=lp, num_return_sequences=4, eos_token_id=list(eos))
    cfg = jaxgen.GenerationConfig(pad_token_id=PAD, output_scores=True,
                                  return_dict_in_generate=True, **kw)
    alone, _ = hf_beam(hf, prompts, batched=False, **kw)
    got, out = jax_beam(model, params, prompts, cfg)
    assert_same(got, alone, f"lp={lp}", atol=SMOLLM2_SCORE_ATOL)
    np.testing.assert_allclose(np.asarray(out.sequences_scores), scores_from_steps(out, lp),
                               rtol=0, atol=1e-5)
    single, _ = jax_beam(model, params, prompts[1:], cfg)
    assert_same(single, alone[1:], f"batch 1, lp={lp}", atol=SMOLLM2_SCORE_ATOL)
    assert any(seq[-1] in eos and len(seq) < 12 for row in alone for seq, _ in row)


@pytest.mark.slow
@pytest.mark.parametrize("length_penalty", LENGTH_PENALTIES)
@pytest.mark.parametrize("early_stopping", [False, True, "never"])
def test_matches_transformers_on_smollm2_full_grid(smollm2, early_stopping, length_penalty):
    _smollm2_case(smollm2, early_stopping, length_penalty)


@pytest.mark.slow
def test_smollm2_two_beams_one_return_and_batched_hf(smollm2):
    hf, model, params, prompts, eos = smollm2
    kw = dict(num_beams=2, max_new_tokens=12, num_return_sequences=1, eos_token_id=list(eos))
    cfg = jaxgen.GenerationConfig(pad_token_id=PAD, **kw)
    batched, _ = hf_beam(hf, prompts, batched=True, **kw)
    got, _ = jax_beam(model, params, prompts, cfg)
    assert_same(got, batched, atol=SMOLLM2_SCORE_ATOL)


# ------------------------------------------------------------------- jit, vmap, compiles
def test_no_recompile_for_new_prompts_or_length_penalty(tiny):
    _, model, params, eos = tiny
    cfg = jaxgen.GenerationConfig(num_beams=3, max_new_tokens=6, eos_token_id=eos,
                                  pad_token_id=PAD, length_penalty=0.7)
    jaxgen.generate(params, jaxgen.init_state(model, [[1, 2, 3], [4, 5]], cfg), cfg)
    before = jaxgen.trace_count()
    for prompts, lp in (([[9, 9], [3, 1, 4, 1, 5]], 1.3), ([[8], [7, 7, 7]], 2.0)):
        cfg2 = cfg.replace(length_penalty=lp)
        jaxgen.generate(params, jaxgen.init_state(model, prompts, cfg2), cfg2)
    assert jaxgen.trace_count() == before


def test_vmap_over_length_penalty_equals_separate_calls(tiny):
    _, model, params, eos = tiny
    cfg = jaxgen.GenerationConfig(num_beams=3, max_new_tokens=MAX_NEW, eos_token_id=eos,
                                  pad_token_id=PAD, num_return_sequences=2,
                                  early_stopping="never", length_penalty=0.5)
    penalties = jnp.asarray(LENGTH_PENALTIES, jnp.float32)

    def run(lp):  # lp is traced: a config leaf, so the sweep is one batched program
        return jaxgen.generate(params, jaxgen.init_state(model, RAGGED, cfg),
                               cfg.replace(length_penalty=lp))

    swept = jax.vmap(run)(penalties)
    for i, lp in enumerate(LENGTH_PENALTIES):
        one = cfg.replace(length_penalty=lp)
        ref = jaxgen.generate(params, jaxgen.init_state(model, RAGGED, one), one)
        np.testing.assert_array_equal(np.asarray(swept.sequences[i]), np.asarray(ref.sequences))
        np.testing.assert_allclose(np.asarray(swept.sequences_scores[i]),
                                   np.asarray(ref.sequences_scores), atol=1e-6)


@pytest.mark.slow
def test_per_row_length_penalty(tiny):
    _, model, params, eos = tiny
    base = jaxgen.GenerationConfig(num_beams=3, max_new_tokens=MAX_NEW, eos_token_id=eos,
                                   pad_token_id=PAD, early_stopping="never")
    per_row = base.replace(length_penalty=np.asarray([0.5, 2.0, 1.0], np.float32))
    out = jaxgen.generate(params, jaxgen.init_state(model, RAGGED, per_row), per_row)
    for b, lp in enumerate((0.5, 2.0, 1.0)):
        c = base.replace(length_penalty=lp)
        ref = jaxgen.generate(params, jaxgen.init_state(model, RAGGED[b:b + 1], c), c)
        np.testing.assert_array_equal(np.asarray(out.sequences[b, :ref.sequences.shape[1]]),
                                      np.asarray(ref.sequences[0]))


def test_generate_inside_user_jit_equals_eager(tiny):
    _, model, params, eos = tiny
    cfg = jaxgen.GenerationConfig(num_beams=2, max_new_tokens=6, eos_token_id=eos,
                                  pad_token_id=PAD, num_return_sequences=2)
    eager = jaxgen.generate(params, jaxgen.init_state(model, RAGGED, cfg), cfg)
    jitted = jax.jit(lambda p, st: jaxgen.generate(p, st, cfg).sequences)(
        params, jaxgen.init_state(model, RAGGED, cfg))
    np.testing.assert_array_equal(np.asarray(jitted), np.asarray(eager.sequences))


@pytest.mark.parametrize("kind,options", [
    pytest.param("sliding_window", {"sliding_window": 64}, marks=pytest.mark.slow),
    ("offloaded", None), ("quantized", {"nbits": 8})])
def test_cache_kinds_are_reordered_by_beam(tiny, kind, options):
    """The beam reorder gathers every cache leaf with a batch axis, whatever the kind."""
    _, model, params, eos = tiny
    base = jaxgen.GenerationConfig(num_beams=3, max_new_tokens=MAX_NEW, eos_token_id=eos,
                                   pad_token_id=PAD, num_return_sequences=2)
    ref = jaxgen.generate(params, jaxgen.init_state(model, RAGGED, base), base)
    cfg = base.replace(cache_implementation=kind, cache_config=options)
    out = jaxgen.generate(params, jaxgen.init_state(model, RAGGED, cfg), cfg)
    if kind == "quantized":  # int8 keys/values: close scores, not bit-identical
        np.testing.assert_allclose(np.asarray(out.sequences_scores),
                                   np.asarray(ref.sequences_scores), atol=0.05)
    else:
        np.testing.assert_array_equal(np.asarray(out.sequences), np.asarray(ref.sequences))
        np.testing.assert_allclose(np.asarray(out.sequences_scores),
                                   np.asarray(ref.sequences_scores), atol=1e-5)


@pytest.mark.slow
def test_smollm2_stop_strings_finish_beams(smollm2):
    _, model, params, prompts, eos = smollm2
    tokenizer = jaxgen.models.load("smollm2-135m-instruct")[2]
    cfg = jaxgen.GenerationConfig(num_beams=3, max_new_tokens=6, num_return_sequences=3,
                                  eos_token_id=list(eos), pad_token_id=PAD, stop_strings=["4"])
    state = jaxgen.init_state(model, prompts[:1], cfg, tokenizer=tokenizer)
    out = jaxgen.generate(params, state, cfg)
    seqs, lengths = np.asarray(out.sequences), np.asarray(out.lengths)
    plen, reasons = np.asarray(out.prompt_lengths), np.asarray(out.stop_reason)
    for i in range(3):
        text = tokenizer.decode(seqs[i, plen[i]:lengths[i]].tolist())
        assert ("4" in text) == (reasons[i] == stopping.STOP_STRING), (text, reasons[i])
    assert (reasons == stopping.STOP_STRING).any()


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("fields,match", [
    (dict(num_beams=2, num_return_sequences=3), "smaller or equal to `num_beams`"),
    (dict(num_beams=0), "num_beams"),
    (dict(num_beams=-1), "num_beams"),
    (dict(num_beams=2.0), "num_beams"),
    (dict(num_return_sequences=2), "greedy decoding"),
    (dict(num_return_sequences=0, num_beams=2), "num_return_sequences"),
    (dict(num_beams=2, early_stopping="sometimes"), "early_stopping"),
    (dict(num_beams=2, length_penalty=float("nan")), "length_penalty"),
    (dict(num_beams=2, num_beam_groups=2), "num_beam_groups"),
    (dict(num_beams=2, diversity_penalty=0.5), "diversity_penalty"),
    (dict(num_beams=2, low_memory=True), "low_memory"),
    (dict(num_beams=2, constraints=[1]), "constraints"),
    (dict(num_beams=2, force_words_ids=[[1]]), "force_words_ids"),
])
def test_bad_beam_settings_raise_before_compiling(fields, match):
    before = jaxgen.trace_count()
    with pytest.raises(ValueError, match=match):
        jaxgen.GenerationConfig(**fields)
    assert jaxgen.trace_count() == before

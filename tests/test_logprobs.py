"""Log-probs people ask for: top_logprobs per new token, prompt_logprobs from the prefill, and
compute_transition_scores against transformers' (a tiny random HF Llama and its jaxgen twin)."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
import torch
from model_fixtures import make_hf_model, save_hf_model

import jaxgen

PAD = 0
K = 4
NEW = 12  # the greedy continuations repeat themselves: prompt lookup's drafts get accepted
RAGGED = [[5, 17, 33, 2, 60, 61, 8, 90, 44, 3, 12], [7, 8], [40, 41, 42, 43, 44, 45]]
REPEATING = [[11, 12, 13, 14, 11, 12, 13, 14, 11, 12, 13], [30, 31, 32, 30, 31, 32, 30, 31],
             [50, 51, 50, 51, 50, 51]]  # the same prompt bucket as RAGGED


def greedy_config(**changes):
    """The greedy program most tests share (one compile)."""
    return jaxgen.GenerationConfig(max_new_tokens=NEW, pad_token_id=PAD, top_logprobs=K,
                                   prompt_logprobs=True, output_scores=True).replace(**changes)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf = make_hf_model("llama", seed=5)
    folder = save_hf_model(hf, str(tmp_path_factory.mktemp("tiny_logprobs")))
    model, params, _ = jaxgen.models.load(folder)
    return hf, model, params


BEAM = dict(num_beams=3, num_return_sequences=2, length_penalty=0.6, max_new_tokens=7)


@pytest.fixture(scope="module")
def beam_run(tiny):
    """(EOS id, beam output with output_scores, beam_indices and prompt_logprobs)."""
    hf, model, params = tiny
    probe = hf_generate(hf, RAGGED[1], eos_token_id=None, **BEAM)
    eos = int(probe.sequences[1, len(RAGGED[1]) + 1])  # a token a returned beam emits early
    cfg = jaxgen.GenerationConfig(pad_token_id=PAD, eos_token_id=eos, output_scores=True,
                                  return_dict_in_generate=True, prompt_logprobs=True, **BEAM)
    return eos, run(model, params, RAGGED, cfg)


def run(model, params, prompts, cfg, key=None):
    return jaxgen.generate(params, jaxgen.init_state(model, prompts, cfg, key), cfg)


def log_softmax(x, axis=-1):
    x = np.asarray(x, np.float64)
    top = np.max(x, axis=axis, keepdims=True)
    return x - top - np.log(np.sum(np.exp(x - top), axis=axis, keepdims=True))


def new_counts(out):
    return np.asarray(out.lengths) - np.asarray(out.prompt_lengths)


# ------------------------------------------------------------------------- top_logprobs
@pytest.mark.parametrize("mode", ["greedy", "sample", "guidance"])
def test_top_logprobs_are_the_processed_scores_top_k(tiny, mode):
    _, model, params = tiny
    fields = dict(greedy={}, guidance=dict(guidance_scale=1.5),
                  # top_k = K: the drawn token is always one of the K listed
                  sample=dict(do_sample=True, temperature=0.7, top_k=K))[mode]
    cfg = greedy_config(**fields)
    out = run(model, params, RAGGED, cfg, jax.random.key(3))
    assert out.top_ids.shape == out.top_logprobs.shape == (3, NEW, K)
    assert out.top_ids.dtype == np.int32 and out.top_logprobs.dtype == np.float32
    want = log_softmax(out.scores)  # [B, N, V] the processed scores' log-probs
    ids, lps = np.asarray(out.top_ids), np.asarray(out.top_logprobs)
    chosen_lp = np.asarray(out.token_logprobs)
    seqs, plen = np.asarray(out.sequences), np.asarray(out.prompt_lengths)
    for b, count in enumerate(new_counts(out)):
        for j in range(count):
            order = np.argsort(-want[b, j], kind="stable")[:K]
            np.testing.assert_array_equal(ids[b, j], order, err_msg=f"{mode} row {b} step {j}")
            np.testing.assert_allclose(lps[b, j], want[b, j, order], atol=1e-5)
            token = seqs[b, plen[b] + j]
            assert token in ids[b, j]  # the chosen token is listed, with its log-prob
            np.testing.assert_allclose(lps[b, j][ids[b, j] == token], chosen_lp[b, j], atol=1e-6)
            assert lps[b, j, 0] >= chosen_lp[b, j]
            assert (np.diff(lps[b, j]) <= 0).all()
            if mode != "sample":
                assert ids[b, j, 0] == token


@pytest.mark.parametrize("tree", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_assisted_prompt_lookup_gives_plain_greedys_top_k(tiny, tree):
    _, model, params = tiny
    cfg = greedy_config()
    plain = run(model, params, REPEATING, cfg)
    assisted_cfg = cfg.replace(prompt_lookup_num_tokens=3, assistant_fallback=False,
                               **(dict(assistant_tree_nodes=4) if tree else {}))
    assisted = run(model, params, REPEATING, assisted_cfg)
    assert int(np.asarray(assisted.speculative.accepted).sum()) > 0  # drafts were accepted
    np.testing.assert_array_equal(np.asarray(assisted.sequences), np.asarray(plain.sequences))
    for b, count in enumerate(new_counts(plain)):
        np.testing.assert_array_equal(np.asarray(assisted.top_ids)[b, :count],
                                      np.asarray(plain.top_ids)[b, :count])
        np.testing.assert_allclose(np.asarray(assisted.top_logprobs)[b, :count],
                                   np.asarray(plain.top_logprobs)[b, :count], atol=1e-5)
    np.testing.assert_allclose(np.asarray(assisted.prompt_logprobs),
                               np.asarray(plain.prompt_logprobs), atol=1e-5)


# ----------------------------------------------------------------------- prompt_logprobs
def hf_prompt_logprobs(hf, prompt):
    """transformers on the row alone: log_softmax(logits)[t, ids[t + 1]], t = 0 .. len - 2."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].double().numpy()  # [S, V]
    lp = log_softmax(logits)
    return np.array([lp[t, prompt[t + 1]] for t in range(len(prompt) - 1)])


def test_prompt_logprobs_match_transformers_on_a_ragged_batch(tiny, beam_run):
    hf, model, params = tiny
    cfg = greedy_config()
    out = run(model, params, RAGGED, cfg)
    chunked = run(model, params, RAGGED, cfg.replace(prefill_chunk_size=5))  # 3 + remainder
    _, beams = beam_run
    got = np.asarray(out.prompt_logprobs)
    assert got.dtype == np.float32 and got.shape[0] == 3 and got.shape[1] >= len(RAGGED[0])
    for b, prompt in enumerate(RAGGED):
        assert got[b, 0] == 0.0 and (got[b, len(prompt):] == 0.0).all()  # position 0, padding
        np.testing.assert_allclose(got[b, 1:len(prompt)], hf_prompt_logprobs(hf, prompt),
                                   rtol=0, atol=2e-5, err_msg=f"row {b}")
    np.testing.assert_allclose(np.asarray(chunked.prompt_logprobs), got, atol=2e-5)
    np.testing.assert_allclose(np.asarray(beams.prompt_logprobs), np.repeat(got, 2, axis=0),
                               atol=2e-5)


# ------------------------------------------------------------- compute_transition_scores
def hf_generate(hf, prompt, **kw):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), pad_token_id=PAD, do_sample=False,
                          return_dict_in_generate=True, output_scores=True, **kw)
    return out


@pytest.mark.parametrize("normalize", [False, True])
def test_transition_scores_match_transformers_greedy(tiny, normalize):
    hf, model, params = tiny
    out = run(model, params, RAGGED, greedy_config())
    got = np.asarray(jaxgen.compute_transition_scores(out, normalize_logits=normalize))
    assert got.shape == (3, NEW)
    for b, prompt in enumerate(RAGGED):
        ref = hf_generate(hf, prompt, max_new_tokens=NEW, eos_token_id=None)
        assert np.asarray(out.sequences)[b, len(prompt):len(prompt) + NEW].tolist() == \
            ref.sequences[0, len(prompt):].tolist()
        want = hf.compute_transition_scores(ref.sequences, ref.scores,
                                            normalize_logits=normalize)[0].numpy()
        np.testing.assert_allclose(got[b], want, rtol=0, atol=1e-4, err_msg=f"row {b}")


def test_top_logprobs_equal_transformers_output_scores_top_k(tiny):
    """Greedy: jaxgen's top-k ids / log-probs are the top-k of log_softmax(HF's output_scores)
    on the same weights (HF's scores are its processed scores; greedy: the raw logits)."""
    hf, model, params = tiny
    out = run(model, params, RAGGED, greedy_config())
    ids, lps = np.asarray(out.top_ids), np.asarray(out.top_logprobs)
    for b, prompt in enumerate(RAGGED):
        ref = hf_generate(hf, prompt, max_new_tokens=NEW, eos_token_id=None,
                          output_logits=True)
        want = log_softmax(torch.stack(ref.scores, 1)[0].numpy())  # [N, V]
        raw = log_softmax(torch.stack(ref.logits, 1)[0].numpy())  # [N, V]
        np.testing.assert_allclose(want, raw, atol=1e-5)
        order = np.argsort(-want, axis=-1, kind="stable")[:, :K]  # [N, K]
        assert ids[b].tolist() == order.tolist(), f"row {b}"
        np.testing.assert_allclose(lps[b], np.take_along_axis(want, order, 1), atol=1e-4)


def hf_processed_scores(hf, sequence, prompt_len, warpers):
    """HF's processed scores for the new tokens of `sequence` (one row, no padding): its
    logits at every position from the last prompt token on, through HF's own warpers, as
    generate() would have produced them while sampling these very tokens."""
    ids = torch.tensor([sequence])
    with torch.no_grad():
        logits = hf(ids).logits[0, prompt_len - 1:-1].float()  # [N, V]
    return tuple(warpers(ids[:, :prompt_len + i], logits[i:i + 1])
                 for i in range(logits.shape[0]))


def test_sampling_top_logprobs_and_transition_scores_equal_transformers(tiny):
    """Sampling (temperature 0.7, top_k = K): on jaxgen's sampled tokens, HF's warpers give the
    processed scores; their top-k and HF's compute_transition_scores equal jaxgen's."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper
    hf, model, params = tiny
    cfg = greedy_config(do_sample=True, temperature=0.7, top_k=K)
    out = run(model, params, RAGGED, cfg, jax.random.key(11))
    warpers = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(K)])
    got = np.asarray(jaxgen.compute_transition_scores(out))
    ids, lps = np.asarray(out.top_ids), np.asarray(out.top_logprobs)
    seqs, lengths = np.asarray(out.sequences), np.asarray(out.lengths)
    for b, prompt in enumerate(RAGGED):
        sequence = seqs[b, :lengths[b]].tolist()
        scores = hf_processed_scores(hf, sequence, len(prompt), warpers)
        want = hf.compute_transition_scores(torch.tensor([sequence]), scores)[0].numpy()
        np.testing.assert_allclose(got[b, :len(want)], want, rtol=0, atol=1e-4,
                                   err_msg=f"row {b}")
        logp = log_softmax(torch.cat(scores).numpy())  # [N, V]
        top = np.take_along_axis(logp, ids[b, :len(want)], 1)  # [N, K] HF's at jaxgen's ids
        np.testing.assert_allclose(lps[b, :len(want)], top, atol=1e-4)
        assert np.isfinite(top).all()  # the K kept tokens are HF's top_k = K survivors


def test_transition_scores_match_transformers_beam(tiny, beam_run):
    hf, _, _ = tiny
    eos, out = beam_run
    seqs, plen = np.asarray(out.sequences), np.asarray(out.prompt_lengths)
    ends_early = False
    for normalize in (False, True):
        got = np.asarray(jaxgen.compute_transition_scores(out, normalize_logits=normalize))
        for b, prompt in enumerate(RAGGED):
            ref = hf_generate(hf, prompt, eos_token_id=eos, **BEAM)
            want = hf.compute_transition_scores(ref.sequences, ref.scores, ref.beam_indices,
                                                normalize_logits=normalize).numpy()  # [2, W]
            width = want.shape[1]
            for r in range(2):
                row = 2 * b + r
                new = int((ref.beam_indices[r] >= 0).sum())
                ends_early |= new < 7
                assert seqs[row, plen[row]:plen[row] + new].tolist() == \
                    ref.sequences[r, len(prompt):len(prompt) + new].tolist()
                np.testing.assert_allclose(got[row, :width], want[r], rtol=0, atol=1e-4,
                                           err_msg=f"row {row} normalize={normalize}")
                assert (got[row, width:] == 0).all()
            if not normalize:  # HF's sequences_scores: the sum / new_len ** length_penalty
                lengths = (ref.beam_indices >= 0).sum(1).numpy()
                np.testing.assert_allclose(want.sum(1) / lengths ** 0.6,
                                           ref.sequences_scores.numpy(), atol=1e-5)
    assert ends_early


def test_transition_scores_need_scores_and_beam_indices(tiny, beam_run):
    _, model, params = tiny
    out = run(model, params, RAGGED, greedy_config())
    with pytest.raises(ValueError, match="output_scores=True"):
        jaxgen.compute_transition_scores(dataclasses.replace(out, scores=None))
    np.testing.assert_allclose(  # `scores` given (e.g. out.logits) is read instead
        np.asarray(jaxgen.compute_transition_scores(out, scores=2 * out.scores)),
        2 * np.asarray(jaxgen.compute_transition_scores(out)), rtol=1e-6)
    _, beams = beam_run
    with pytest.raises(ValueError, match="return_dict_in_generate=True"):
        jaxgen.compute_transition_scores(dataclasses.replace(beams, beam_indices=None))


# --------------------------------------------------------------------- compiles, checks
def test_top_logprobs_is_in_the_program_key_prompts_are_not(tiny):
    _, model, params = tiny
    run(model, params, RAGGED, greedy_config())
    before = jaxgen.trace_count()
    off = run(model, params, RAGGED, greedy_config(top_logprobs=0, prompt_logprobs=False))
    assert jaxgen.trace_count() == before + 1
    assert off.top_ids is None and off.top_logprobs is None and off.prompt_logprobs is None
    out = run(model, params, REPEATING, greedy_config())  # new prompts, the same k
    assert jaxgen.trace_count() == before + 1
    assert out.top_ids.shape == (3, NEW, K)


@pytest.mark.parametrize("fields,match", [
    (dict(top_logprobs=-1), "`top_logprobs` must be an int >= 0"),
    (dict(top_logprobs=2.0), "`top_logprobs` must be an int >= 0"),
    (dict(top_logprobs=True), "`top_logprobs` must be an int >= 0"),
    (dict(top_logprobs=97), r"`top_logprobs`=97 is more than the vocabulary size \(allowed: "
                            r"0..96\)"),
    (dict(top_logprobs=2, num_beams=2), "`top_logprobs`=2 is not supported with beam search"),
    (dict(prompt_logprobs=1), "`prompt_logprobs` must be True or False"),
])
def test_bad_values_are_refused_naming_the_field(tiny, fields, match):
    _, model, _ = tiny
    with pytest.raises(ValueError, match=match):
        cfg = jaxgen.GenerationConfig(max_new_tokens=2, **fields)
        jaxgen.init_state(model, [[1, 2]], cfg)

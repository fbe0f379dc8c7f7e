"""Classifier-free guidance (guidance_scale, negative_prompt_ids): token-for-token and score
parity with transformers' generate on a random Llama in fp32, the guided sampling
distribution by chi-square, no recompilation for new scales, and bad input refused before
anything compiles."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from model_fixtures import make_hf_model, save_hf_model

import jaxgen
from jaxgen.api.plan import execute, make_plan
from jaxgen.loops.guidance import GuidedLoop
from jaxgen.models import load

PAD, EOS = 0, 2
PROMPTS = [[5, 17, 33, 60, 61, 8, 90, 44, 3, 12], [7, 8], [40, 41, 42, 43, 44, 45]]
NEGATIVES = [[9, 10, 11], [70, 71, 72, 73, 74, 75, 76], [20]]
NEW = 12


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf = make_hf_model("llama", seed=11)
    model, params, _ = load(save_hf_model(hf, str(tmp_path_factory.mktemp("cfg"))))
    return model, params, hf


def left_padded(rows):
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, width - len(row):] = torch.tensor(row)
        mask[b, width - len(row):] = 1
    return ids, mask


def hf_guided(hf, prompts, negatives, scale, eos):
    """transformers generate with CFG: (new ids per row up to its EOS, scores [B, N, V])."""
    ids, mask = left_padded(prompts)
    extra = {}
    if negatives is not None:
        extra["negative_prompt_ids"], extra["negative_prompt_attention_mask"] = left_padded(
            negatives)
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW,
                          do_sample=False, guidance_scale=scale, eos_token_id=eos,
                          pad_token_id=PAD, output_scores=True, return_dict_in_generate=True,
                          top_k=None, top_p=None, temperature=None, **extra)
    new = out.sequences[:, ids.shape[1]:].tolist()
    rows = []
    for row in new:
        rows.append(row[:row.index(eos) + 1] if eos in row else row)
    return rows, torch.stack(out.scores, dim=1).numpy()


def jax_guided(model, params, prompts, negatives, scale, eos):
    cfg = jaxgen.GenerationConfig(max_new_tokens=NEW, guidance_scale=scale, eos_token_id=eos,
                                  pad_token_id=PAD, output_scores=True)
    state = jaxgen.init_state(model, prompts, cfg, buffer_len=32)
    out = jaxgen.generate(params, state, cfg, negative_prompt_ids=negatives)
    rows = [out.sequences[b, len(p):int(out.lengths[b])].tolist() for b, p in enumerate(prompts)]
    return rows, np.asarray(out.scores)


def likely_eos(hf, prompts):
    """A token greedy guided decoding emits mid-way, so EOS stops some rows early."""
    rows, _ = hf_guided(hf, prompts, None, 2.0, eos=None)
    return rows[0][5]


SLOW = pytest.mark.slow


@pytest.mark.parametrize("case", ["single", "ragged_negative",
                                  pytest.param("ragged", marks=SLOW),
                                  pytest.param("single_negative", marks=SLOW)])
def test_greedy_tokens_and_scores_match_transformers(pair, case):
    model, params, hf = pair
    prompts = PROMPTS[:1] if case.startswith("single") else PROMPTS
    negatives = None
    if case.endswith("negative"):
        negatives = NEGATIVES[:len(prompts)]
    scale = 1.5 if case == "single" else 3.0
    eos = likely_eos(hf, prompts)
    expected, hf_scores = hf_guided(hf, prompts, negatives, scale, eos)
    got, scores = jax_guided(model, params, prompts, negatives, scale, eos)
    assert got == expected
    assert any(len(r) < NEW for r in got) or case.startswith("single")
    for b, row in enumerate(got):  # live steps of each row
        n = len(row)
        np.testing.assert_allclose(scores[b, :n], hf_scores[b, :n], rtol=1e-4, atol=1e-4)


@SLOW
def test_guidance_changes_tokens_and_scale_below_one(pair):
    """Guidance is not a no-op, and guidance_scale=0 with a negative prompt decodes as if the
    negative prompt were the prompt (HF's "positive prompt" use)."""
    model, params, hf = pair
    plain = jaxgen.generate_ids(model, params, PROMPTS, max_new_tokens=NEW, pad_token_id=PAD)
    guided = jaxgen.generate_ids(model, params, PROMPTS, max_new_tokens=NEW, pad_token_id=PAD,
                                 guidance_scale=3.0)
    assert plain != guided
    as_prompt = jaxgen.generate_ids(model, params, NEGATIVES, max_new_tokens=NEW,
                                    pad_token_id=PAD)
    swapped = jaxgen.generate_ids(model, params, PROMPTS, max_new_tokens=NEW, pad_token_id=PAD,
                                  guidance_scale=0.0, negative_prompt_ids=NEGATIVES)
    assert [r[len(p):] for r, p in zip(swapped, PROMPTS)] == \
        [r[len(n):] for r, n in zip(as_prompt, NEGATIVES)]


@SLOW
def test_stacked_and_separate_layouts_agree(pair):
    model, params, _ = pair
    cfg = jaxgen.GenerationConfig(max_new_tokens=NEW, guidance_scale=2.5, pad_token_id=PAD,
                                  do_sample=True, output_scores=True)
    outs = []
    for stacked in (True, False):
        state = jaxgen.init_state(model, PROMPTS, cfg, jax.random.key(4))
        plan = make_plan(state, cfg, negative_prompt_ids=NEGATIVES)
        assert isinstance(plan.loop, GuidedLoop) and plan.loop.stacked
        plan = dataclasses.replace(plan, loop=dataclasses.replace(plan.loop, stacked=stacked))
        outs.append(execute(plan, params, state, cfg))
    assert outs[0].sequences.tolist() == outs[1].sequences.tolist()
    np.testing.assert_allclose(outs[0].scores, outs[1].scores, rtol=1e-4, atol=1e-4)
    assert outs[0].state.cache.batch == len(PROMPTS)  # the prompts' rows only


@SLOW
def test_chunked_driver_gives_the_same_tokens(pair):
    model, params, _ = pair
    cfg = jaxgen.GenerationConfig(max_new_tokens=NEW, guidance_scale=2.0, pad_token_id=PAD)
    whole = jaxgen.generate(params, jaxgen.init_state(model, PROMPTS, cfg), cfg,
                            negative_prompt_ids=NEGATIVES)
    chunked = jaxgen.generate(params, jaxgen.init_state(model, PROMPTS, cfg), cfg,
                              negative_prompt_ids=NEGATIVES, stop_event=__import__(
                                  "threading").Event(), chunk_size=3)
    assert whole.sequences.tolist() == chunked.sequences.tolist()


def test_new_scales_and_negative_prompts_do_not_recompile(pair):
    model, params, _ = pair
    base = jaxgen.GenerationConfig(max_new_tokens=4, guidance_scale=1.5, pad_token_id=PAD)
    runs = [(base, [[3, 4]]), (base.replace(guidance_scale=4.0), [[5, 6, 7]]),
            (base.replace(guidance_scale=0.5), [[8]])]
    before = jaxgen.trace_count()
    outs = []
    for cfg, negative in runs:
        state = jaxgen.init_state(model, [[1, 2, 3]], cfg)
        outs.append(jaxgen.generate(params, state, cfg, negative_prompt_ids=negative)
                    .sequences.tolist())
    assert jaxgen.trace_count() - before == 1
    assert len({str(o) for o in outs}) > 1  # the scale and the negative prompt mattered


@SLOW
def test_per_row_scales_share_one_program(pair):
    model, params, _ = pair
    base = jaxgen.GenerationConfig(max_new_tokens=4, pad_token_id=PAD)
    before = jaxgen.trace_count()
    outs = []
    for scales in ([1.5, 3.0], [3.0, 1.5]):
        cfg = base.replace(guidance_scale=scales)
        outs.append(jaxgen.generate(params, jaxgen.init_state(model, [[1, 2], [1, 2]], cfg),
                                    cfg).sequences.tolist())
    assert jaxgen.trace_count() - before == 1
    assert outs[0][0] != outs[0][1] and outs[0] == outs[1][::-1]  # each row its own scale


# ------------------------------------------------------------------ sampling distribution
def test_sampled_first_tokens_follow_the_guided_distribution():
    """2000 rows, one sampled token each, against the exact guided softmax (chi-square)."""
    model, params = jaxgen.models.tiny_llama(vocab_size=12)
    params = jax.tree_util.tree_map(lambda w: 4.0 * w, params)  # sharper logits
    prompt, negative, scale, temperature = [3, 5, 7], [9, 4], 2.0, 1.3
    rows = 2000
    cfg = jaxgen.GenerationConfig(max_new_tokens=1, do_sample=True, guidance_scale=scale,
                                  temperature=temperature, top_k=0, pad_token_id=0)
    state = jaxgen.init_state(model, [prompt] * rows, cfg, jax.random.key(0))
    out = jaxgen.generate(params, state, cfg, negative_prompt_ids=[negative])
    drawn = np.asarray(out.sequences[:, len(prompt)])

    # exact: full forwards of both sequences (one program), guided in float64 numpy
    @jax.jit
    def last_logits(params):
        def last(ids):
            out = model(params, jnp.asarray([ids]), jnp.arange(len(ids))[None],
                        model.init_cache(1, 16))
            return out.logits[0, -1]  # [V]
        return last(prompt), last(negative)

    cond, uncond = (np.asarray(x, np.float64) for x in last_logits(params))
    log_softmax = lambda x: x - np.log(np.exp(x - x.max()).sum()) - x.max()  # noqa: E731
    guided = scale * (log_softmax(cond) - log_softmax(uncond)) + log_softmax(uncond)  # [V]
    probs = np.exp(guided / temperature)
    probs /= probs.sum()  # [V]
    counts = np.bincount(drawn, minlength=probs.size)
    small = probs * rows < 5  # pooled into one bin
    expected = np.append(probs[~small], probs[small].sum()) * rows
    observed = np.append(counts[~small], counts[small].sum())
    expected, observed = expected[expected > 0], observed[expected > 0]
    stat = ((observed - expected) ** 2 / expected).sum()
    from scipy.stats import chi2
    assert stat < chi2.ppf(0.999, expected.size - 1), (stat, counts, probs)
    # the guided distribution differs from the unguided one enough to be told apart
    plain = np.exp(cond / temperature - (cond / temperature).max())
    assert np.abs(plain / plain.sum() - probs).sum() > 0.3


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("value,match", [
    ("3", "`guidance_scale` must be a finite float"),
    (True, "`guidance_scale` must be a finite float"),
    (float("inf"), "`guidance_scale` must be a finite float"),
    ([1.5, "x"], "`guidance_scale` must be a number or a 1-D list"),
])
def test_bad_guidance_scale_is_refused(value, match):
    with pytest.raises(ValueError, match=match):
        jaxgen.GenerationConfig(guidance_scale=value)


def _refused(model, params, prompts, match, cfg=None, **kwargs):
    cfg = cfg or jaxgen.GenerationConfig(max_new_tokens=4, guidance_scale=2.0, pad_token_id=PAD)
    before = jaxgen.trace_count()
    with pytest.raises(ValueError, match=match):
        jaxgen.generate(params, jaxgen.init_state(model, prompts, cfg), cfg, **kwargs)
    assert jaxgen.trace_count() == before


def test_bad_negative_prompts_are_refused_before_compiling():
    model, params = jaxgen.models.tiny_llama()
    vocab = model.vocab_size
    two = [[1, 2], [3]]
    _refused(model, params, two, "negative_prompt_ids has 3 rows but the batch has 2",
             negative_prompt_ids=[[1], [2], [3]])
    _refused(model, params, two, "negative prompt 1 is empty", negative_prompt_ids=[[1], []])
    _refused(model, params, two, f"outside the vocabulary \\(allowed: 0..{vocab - 1}\\)",
             negative_prompt_ids=[[1], [vocab]])
    _refused(model, params, two, "must be a \\[B, S\\] array",
             negative_prompt_ids=np.zeros((2, 2, 2), np.int32))
    _refused(model, params, two, "must hold int token ids",
             negative_prompt_ids=np.zeros((2, 2), np.float32))
    _refused(model, params, two, "mask has shape \\(2, 3\\) but negative_prompt_ids has",
             negative_prompt_ids=np.ones((2, 2), np.int32),
             negative_prompt_attention_mask=np.ones((2, 3), np.int32))
    _refused(model, params, two, "row 0 ends in padding: pad negative prompts on the left",
             negative_prompt_ids=np.ones((2, 2), np.int32),
             negative_prompt_attention_mask=np.array([[1, 0], [1, 1]]))
    _refused(model, params, two, "needs negative_prompt_ids",
             negative_prompt_attention_mask=np.ones((2, 2), np.int32))
    # init_state's buffer: prompt bucket 16 + 64 new-token slots; 77 + 4 positions do not fit
    _refused(model, params, two, "negative prompt 0 .* needs 81 positions, more than the "
             "state's buffer of 80", negative_prompt_ids=[[1 + i % 20 for i in range(77)], [1]])
    off = jaxgen.GenerationConfig(max_new_tokens=4, guidance_scale=1.0)
    _refused(model, params, two, "only apply with classifier-free guidance: set "
             "guidance_scale", cfg=off, negative_prompt_ids=[[1], [2]])


def test_unsupported_modes_are_named_before_compiling():
    model, params = jaxgen.models.tiny_llama()
    base = dict(max_new_tokens=4, guidance_scale=2.0, pad_token_id=PAD)
    _refused(model, params, [[1, 2]], "guidance_scale=2.0 .* not supported with beam search",
             cfg=jaxgen.GenerationConfig(num_beams=2, **base))
    _refused(model, params, [[1, 2, 1]], "not supported with assisted decoding",
             cfg=jaxgen.GenerationConfig(prompt_lookup_num_tokens=2, **base))
    _refused(model, params, [[1, 2]], "not supported with assisted decoding",
             assistant_model=(model, params))
    _refused(model, params, [[1, 2]], "cannot be combined with custom_generate",
             custom_generate=lambda p, s, c: s)
    _refused(model, params, [[1, 2]], "cache_implementation='dynamic'",
             cfg=jaxgen.GenerationConfig(cache_implementation="dynamic", **base))


@SLOW
def test_generate_ids_sizes_the_buffer_for_long_negative_prompts(pair):
    model, params, hf = pair
    long_negative = list(range(3, 40))
    got = jaxgen.generate_ids(model, params, [[5, 6]], max_new_tokens=6, pad_token_id=PAD,
                              guidance_scale=2.0, negative_prompt_ids=[long_negative])
    expected, _ = hf_guided(hf, [[5, 6]], [long_negative], 2.0, eos=None)
    assert got[0][2:] == expected[0][:6]


@SLOW
def test_generate_text_takes_a_negative_prompt():
    from jaxgen.models import TINY_VOCAB, tiny_tokenizer

    model, params = jaxgen.models.tiny_llama(vocab_size=TINY_VOCAB)
    tokenizer = tiny_tokenizer()
    prompts, negative = ["the stop", "top of the"], "a long negative prompt about nothing"
    kwargs = dict(max_new_tokens=6, guidance_scale=3.0, pad_token_id=0)
    texts = jaxgen.generate_text(model, params, tokenizer, prompts, negative_prompt=negative,
                                 skip_special_tokens=False, **kwargs)
    rows = jaxgen.generate_ids(model, params, [tokenizer.encode(p) for p in prompts],
                               negative_prompt_ids=[tokenizer.encode(negative)], **kwargs)
    assert texts == [tokenizer.decode(r[len(tokenizer.encode(p)):], skip_special_tokens=False)
                     for r, p in zip(rows, prompts)]
    plain = jaxgen.generate_text(model, params, tokenizer, prompts, skip_special_tokens=False,
                                 **kwargs)
    assert plain != texts  # the negative prompt mattered


@pytest.mark.slow
@SLOW
@pytest.mark.parametrize("batch", ["single", "ragged"])
def test_smollm2_guided_greedy_matches_transformers(batch):
    from model_fixtures import smollm2_pair

    model, params, tokenizer, hf = smollm2_pair()
    questions = ["Write a story about a dragon.", "Describe the sea.", "Hi"]
    negatives = ["A sad and boring text.", "Mountains.", "Write in French, with many lists."]
    chat = lambda q: tokenizer.apply_chat_template([{"role": "user", "content": q}])  # noqa: E731
    prompts = [chat(q) for q in questions]
    negative_ids = [chat(n) for n in negatives]
    if batch == "single":
        prompts, negative_ids = prompts[:1], negative_ids[:1]
    eos = list(model.config.eos_token_id)
    ids, mask = left_padded(prompts)
    neg, neg_mask = left_padded(negative_ids)
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16,
                          do_sample=False, guidance_scale=1.5, negative_prompt_ids=neg,
                          negative_prompt_attention_mask=neg_mask, eos_token_id=eos,
                          pad_token_id=tokenizer.pad_token_id, top_k=None, top_p=None,
                          temperature=None)
    expected = []
    for row in out[:, ids.shape[1]:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        expected.append(row[:cut])
    got = jaxgen.generate_ids(model, params, prompts, max_new_tokens=16, guidance_scale=1.5,
                              negative_prompt_ids=neg.numpy(),
                              negative_prompt_attention_mask=neg_mask.numpy())
    assert [r[len(p):] for r, p in zip(got, prompts)] == expected

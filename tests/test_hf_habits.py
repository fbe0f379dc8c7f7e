"""Hugging Face habits: generation_config=, transformers' processor / criteria objects, Hub
names for custom_generate, top-H ties, and kwargs filtering in StoppingCriteriaList."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from model_fixtures import hf_generate_rows, make_hf_model, save_hf_model  # noqa: E402
from transformers.generation.logits_process import (  # noqa: E402
    LogitsProcessor,
    LogitsProcessorList,
    NoBadWordsLogitsProcessor,
    TopHLogitsWarper,
)
from transformers.generation.stopping_criteria import (  # noqa: E402
    MaxLengthCriteria as HFMaxLength,
    StoppingCriteria,
)

import jaxgen  # noqa: E402
from jaxgen import stopping  # noqa: E402
from jaxgen.drivers import host_hooks  # noqa: E402
from jaxgen.logits.chain import ProcessorContext, process_logits  # noqa: E402
from jaxgen.logits.warpers import top_h_filter  # noqa: E402
from jaxgen.models import load  # noqa: E402

PAD = 0
PROMPTS = [[5, 17, 33, 2, 60, 61, 8], [7, 8], [40, 41, 42, 43]]
NEW = 10
OURS = dict(max_new_tokens=NEW, pad_token_id=PAD, eos_token_id=None)  # greedy()'s settings


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf = make_hf_model("llama", seed=7)
    model, params, _ = load(save_hf_model(hf, str(tmp_path_factory.mktemp("hf_habits"))))
    return model, params, hf


def greedy(hf, prompts, **kwargs):
    kwargs = {"max_new_tokens": NEW, "do_sample": False, "eos_token_id": None, **kwargs}
    return hf_generate_rows(hf, prompts, PAD, **kwargs)


def until(rows, prompts, token):
    """Each row cut after the first `token` in its new part (HF pads a row stopped by a
    criterion; jaxgen ends it)."""
    out = []
    for row, prompt in zip(rows, prompts):
        new = row[len(prompt):]
        if token in new:
            new = new[:new.index(token) + 1]
        out.append(list(prompt) + new)
    return out


class LengthBias(LogitsProcessor):
    """Reads HF's layout: the width of input_ids and each row's last id."""

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        width = input_ids.shape[1]
        scores[:, (width * 7) % scores.shape[1]] += 30.0
        rows = torch.arange(scores.shape[0])
        scores[rows, (input_ids[:, -1] * 3 + 1) % scores.shape[1]] += 15.0
        return scores


class StopOnToken(StoppingCriteria):
    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


class StopAfter(StoppingCriteria):
    """Stops every row n tokens after the (left-padded) prompt."""

    def __init__(self, start, n):
        self.start, self.n = start, n

    def __call__(self, input_ids, scores):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.start + self.n)


# ------------------------------------------------------------------ generation_config=
def test_transformers_generation_config_matches_kwargs_and_transformers(pair):
    model, params, hf = pair
    eos = greedy(hf, PROMPTS[:1])[0][len(PROMPTS[0]) + 5]
    fields = dict(max_new_tokens=NEW, repetition_penalty=1.3, no_repeat_ngram_size=2,
                  eos_token_id=eos, pad_token_id=PAD)
    hf_cfg = transformers.GenerationConfig(**fields)
    expected = hf_generate_rows(hf, PROMPTS, PAD, generation_config=hf_cfg, eos_token_id=eos)
    by_config = jaxgen.generate_ids(model, params, PROMPTS, generation_config=hf_cfg)
    positional = jaxgen.generate_ids(model, params, PROMPTS, hf_cfg)
    by_kwargs = jaxgen.generate_ids(model, params, PROMPTS, **fields)
    assert by_config == positional == by_kwargs == expected
    # overrides apply on top, as in HF
    shorter = jaxgen.generate_ids(model, params, PROMPTS, generation_config=hf_cfg,
                                  max_new_tokens=3)
    assert shorter == jaxgen.generate_ids(model, params, PROMPTS, **{**fields,
                                                                     "max_new_tokens": 3})


def test_generate_takes_generation_config_keyword(pair):
    model, params, _ = pair
    hf_cfg = transformers.GenerationConfig(max_new_tokens=4, pad_token_id=PAD)
    cfg = jaxgen.GenerationConfig.from_transformers(hf_cfg)
    assert cfg == jaxgen.GenerationConfig(max_new_tokens=4, pad_token_id=PAD)
    first = jaxgen.generate(params, jaxgen.init_state(model, PROMPTS, cfg), cfg)
    second = jaxgen.generate(params, jaxgen.init_state(model, PROMPTS, cfg),
                             generation_config=hf_cfg)
    np.testing.assert_array_equal(first.sequences, second.sequences)
    with pytest.raises(ValueError, match="both given"):
        jaxgen.generate(params, jaxgen.init_state(model, PROMPTS, cfg), cfg,
                        generation_config=cfg)
    with pytest.raises(TypeError, match="needs a config"):
        jaxgen.generate(params, jaxgen.init_state(model, PROMPTS, cfg))


def test_generate_text_takes_generation_config():
    from jaxgen.models import TINY_VOCAB, tiny_llama, tiny_tokenizer
    tok = tiny_tokenizer()
    model, params = tiny_llama(vocab_size=TINY_VOCAB)
    hf_cfg = transformers.GenerationConfig(max_new_tokens=5, repetition_penalty=1.2)
    assert jaxgen.generate_text(model, params, tok, ["the stop"], generation_config=hf_cfg) \
        == jaxgen.generate_text(model, params, tok, ["the stop"], max_new_tokens=5,
                                repetition_penalty=1.2)


@pytest.mark.parametrize("field, value", [("penalty_alpha", 0.6), ("num_beam_groups", 2),
                                          ("dola_layers", "low")])
def test_transformers_config_field_jaxgen_lacks_is_refused_by_name(pair, field, value):
    model, params, _ = pair
    hf_cfg = transformers.GenerationConfig(max_new_tokens=4)
    setattr(hf_cfg, field, value)
    with pytest.raises(ValueError, match=f"`{field}`"):
        jaxgen.generate_ids(model, params, PROMPTS, generation_config=hf_cfg)
    with pytest.raises(ValueError, match=f"transformers.GenerationConfig.*`{field}`"):
        jaxgen.GenerationConfig.from_transformers(hf_cfg)


# ------------------------------------------------------------------ host processors
@pytest.mark.parametrize("kind", ["processor", "list"])
def test_transformers_logits_processors_match_transformers(pair, kind):
    model, params, hf = pair
    plain = greedy(hf, PROMPTS)
    banned = plain[0][len(PROMPTS[0]) + 1]
    bad = NoBadWordsLogitsProcessor(bad_words_ids=[[banned]], eos_token_id=2)
    given = LogitsProcessorList([bad, LengthBias()]) if kind == "list" else bad
    expected = greedy(hf, PROMPTS, logits_processor=LogitsProcessorList(
        [bad, LengthBias()] if kind == "list" else [bad]))
    assert expected != plain
    with pytest.warns(UserWarning, match="round trip"):
        got = jaxgen.generate_ids(model, params, PROMPTS, logits_processor=given, **OURS)
    assert got == expected
    assert all(banned not in row[len(p):] for row, p in zip(got, PROMPTS))


def test_host_processor_compiles_once_for_every_step(pair):
    model, params, _ = pair
    bias = LengthBias()
    cfg = jaxgen.GenerationConfig(**OURS)
    calls = []

    class Counting(LogitsProcessor):
        def __call__(self, input_ids, scores):
            calls.append(input_ids.shape[1])
            return bias(input_ids, scores)

    counting = Counting()
    before = jaxgen.trace_count()
    jaxgen.generate(params, jaxgen.init_state(model, PROMPTS, cfg), cfg,
                    logits_processor=[counting])
    assert jaxgen.trace_count() - before == 1
    assert calls == [len(PROMPTS[0]) + step for step in range(NEW)]  # one call a step
    jaxgen.generate(params, jaxgen.init_state(model, [[9, 10, 11], [4], [6, 5]], cfg), cfg,
                    logits_processor=[counting])  # same processor, new prompts: no compile
    assert jaxgen.trace_count() - before == 1


def test_transformers_stopping_criteria_match_transformers(pair):
    model, params, hf = pair
    plain = greedy(hf, PROMPTS)
    token = plain[1][len(PROMPTS[1]) + 3]
    expected = until(greedy(hf, PROMPTS, stopping_criteria=[StopOnToken(token)]), PROMPTS,
                     token)
    cfg = jaxgen.GenerationConfig(**OURS)
    out = jaxgen.generate(params, jaxgen.init_state(model, PROMPTS, cfg), cfg,
                          stopping_criteria=transformers.StoppingCriteriaList(
                              [StopOnToken(token)]))
    assert jaxgen.core.output.outputs_to_lists(out) == expected
    stopped = [token in row[len(p):] for row, p in zip(expected, PROMPTS)]
    assert any(stopped)
    reasons = np.asarray(out.stop_reason)
    assert all(r == stopping.CUSTOM for r, s in zip(reasons, stopped) if s)


@pytest.mark.parametrize("make", [lambda p: StopAfter(len(p), 4),
                                  lambda p: HFMaxLength(max_length=len(p) + 3)])
def test_criteria_without_scores_and_max_length_stop_as_transformers(pair, make):
    model, params, hf = pair
    prompt = PROMPTS[:1]
    expected = greedy(hf, prompt, stopping_criteria=[make(prompt[0])])
    got = jaxgen.generate_ids(model, params, prompt, stopping_criteria=[make(prompt[0])],
                              **OURS)
    assert got == expected and len(got[0]) < len(prompt[0]) + NEW


def test_host_hooks_are_refused_under_jit_beams_and_without_torch(pair, monkeypatch):
    model, params, _ = pair
    cfg = jaxgen.GenerationConfig(max_new_tokens=3, pad_token_id=PAD)
    state = jaxgen.init_state(model, PROMPTS, cfg)
    bias = LengthBias()
    with pytest.raises(ValueError, match=r"LengthBias.*jax.jit.*\(scores \[B, V\], ctx\)"):
        jax.jit(lambda st: jaxgen.generate(params, st, cfg, logits_processor=[bias]).sequences
                )(state)
    with pytest.raises(ValueError, match="StopOnToken.*jax.jit"):
        jax.jit(lambda st: jaxgen.generate(params, st, cfg,
                                           stopping_criteria=StopOnToken(3)).sequences)(state)
    with pytest.raises(ValueError, match="greedy decoding and sampling only"):
        jaxgen.generate_ids(model, params, PROMPTS, max_new_tokens=3, num_beams=2,
                            logits_processor=[bias])
    with pytest.raises(ValueError, match="pass it as `stopping_criteria`"):
        jaxgen.generate_ids(model, params, PROMPTS, max_new_tokens=3,
                            logits_processor=[StopOnToken(3)])
    monkeypatch.setattr(host_hooks, "torch_available", lambda: False)
    with pytest.raises(ValueError, match="torch is not installed"):
        jaxgen.generate_ids(model, params, PROMPTS, max_new_tokens=3, logits_processor=bias)


# ------------------------------------------------------------------ custom_generate
@pytest.mark.parametrize("name", ["transformers-community/dola", "org/repo"])
def test_hub_name_for_custom_generate_says_hub_code_is_not_fetched(pair, name):
    model, params, _ = pair
    with pytest.raises(ValueError, match="never downloads or runs remote code.*'pkg.module:"):
        jaxgen.generate_ids(model, params, PROMPTS, max_new_tokens=3, custom_generate=name)


# ------------------------------------------------------------------ top-H ties
TIE_ROWS = {
    "uniform": [0.5] * 8,
    "tie_after_top": [2.0, 1.0, 1.0, 1.0, 1.0, -1.0],
    "tied_top": [3.0, 3.0, 1.0, 0.0, 0.0, 0.0],
    "two_ties": [1.0, 2.0, 1.0, 2.0, 0.0, 1.0, 2.0, -3.0],
    "wide_tie": [0.0] * 150 + [1.0] * 3,  # past the 100 candidates
}


def test_top_h_keeps_what_transformers_keeps_on_ties():
    ctx = ProcessorContext(tokens=jnp.zeros((1, 4), jnp.int32), length=jnp.array([1]),
                           prompt_len=jnp.array([1]))
    search = jax.jit(top_h_filter)  # top_h is dynamic: one compile per row width
    chain = jax.jit(lambda scores, cfg: process_logits(cfg, scores, ctx))  # the default path
    for name, row in TIE_ROWS.items():
        scores = np.asarray([row], np.float32)
        for top_h in (0.1, 0.35, 0.6, 0.9):
            theirs = TopHLogitsWarper(top_h)(None, torch.from_numpy(scores.copy())).numpy()[0]
            cfg = jaxgen.GenerationConfig(do_sample=True, top_h=top_h, top_k=0)
            for ours in (np.asarray(search(jnp.asarray(scores), top_h))[0],
                         np.asarray(chain(jnp.asarray(scores), cfg))[0]):
                # the same kept scores, tie by tie (HF picks among equals in torch.topk's
                # order, jaxgen the lowest ids)
                assert sorted(ours[np.isfinite(ours)]) == sorted(theirs[np.isfinite(theirs)]), \
                    (name, top_h)


# ------------------------------------------------------------------ kwargs filtering
def test_stopping_criteria_list_passes_only_accepted_keywords():
    ctx = ProcessorContext(tokens=jnp.zeros((2, 4), jnp.int32), length=jnp.array([2, 3]),
                           prompt_len=jnp.array([1, 1]))
    seen = {}

    def no_scores(ctx):
        return ctx.length >= 3

    def named(ctx, scores, *, step):
        seen["named"] = (scores, step)
        return ctx.length >= step

    def anything(ctx, scores=None, **kwargs):
        seen["anything"] = sorted(kwargs)
        return jnp.zeros((2,), bool)

    criteria = jaxgen.StoppingCriteriaList([no_scores, named, anything])
    assert criteria(ctx, "S", step=3, extra=1).tolist() == [False, True]
    assert seen == {"named": ("S", 3), "anything": ["extra", "step"]}
    assert jaxgen.StoppingCriteriaList([no_scores])(ctx).tolist() == [False, True]

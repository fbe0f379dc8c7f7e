"""User hooks (logits_processor, stopping_criteria, custom_generate), vmap sweeps over the
config, recorded scores with the full chain, and eager ValueErrors for bad input."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from stubs import BigramStub, random_table

import jaxgen
from jaxgen import stopping
from jaxgen.config.generation import GenerationConfig
from jaxgen.logits.chain import ProcessorContext, process_logits

V = 32
MODEL = BigramStub(vocab_size=V)
PARAMS = random_table(V, seed=3)
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10]]


def run(cfg, prompts=PROMPTS, key=None, **hooks):
    state = jaxgen.init_state(MODEL, prompts, cfg, key)
    return jaxgen.generate(PARAMS, state, cfg, **hooks)


def as_lists(out):
    seq, lengths = np.asarray(out.sequences), np.asarray(out.lengths)
    return [seq[b, :lengths[b]].tolist() for b in range(seq.shape[0])]


# --------------------------------------------------------------------- processors
def ban_argmax(scores, ctx):
    return jnp.where(scores >= jnp.max(scores, axis=-1, keepdims=True), -jnp.inf, scores)


def test_user_processor_changes_greedy_choice():
    cfg = GenerationConfig(max_new_tokens=6)
    plain = run(cfg)
    banned = run(cfg, logits_processor=[ban_argmax])
    table = np.asarray(PARAMS["table"])
    for row in as_lists(banned):
        new = row[-6:]
        context = row[-7:-1]
        for prev, token in zip(context, new):
            order = np.argsort(-table[prev])
            assert token == order[1]  # the runner-up, since the best is banned
    assert as_lists(plain) != as_lists(banned)


def test_user_processor_runs_before_the_warpers():
    """HF merges custom processors before temperature / top-k: a processor that sees the
    scores must see them unscaled."""
    seen = {}

    def spy(scores, ctx):
        seen["max"] = jnp.max(scores)
        return scores

    cfg = GenerationConfig(do_sample=True, temperature=0.25, top_k=0)
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(2, V)).astype(np.float32))
    ctx = ProcessorContext(tokens=jnp.zeros((2, 8), jnp.int32), length=jnp.array([2, 3]),
                           prompt_len=jnp.array([2, 3]))

    def check(scores, ctx):
        return scores + 0.0 * jnp.asarray(np.float32(0))

    out = process_logits(cfg, logits, ctx, extra=(spy, check))
    np.testing.assert_allclose(seen["max"], jnp.max(logits))
    np.testing.assert_allclose(out, logits / 0.25, rtol=1e-6)


def test_user_processor_bad_shape_is_an_error():
    cfg = GenerationConfig(max_new_tokens=2)
    with pytest.raises(ValueError, match="must return scores of shape"):
        run(cfg, logits_processor=[lambda scores, ctx: scores[:, :3]])


def test_non_callable_hooks_are_rejected():
    cfg = GenerationConfig(max_new_tokens=2)
    with pytest.raises(ValueError, match="logits_processor"):
        run(cfg, logits_processor=[1])
    with pytest.raises(ValueError, match="stopping_criteria"):
        run(cfg, stopping_criteria=["x"])


# ---------------------------------------------------------------------- stopping
def three_new(ctx, scores):
    return ctx.length - ctx.prompt_len >= 3


def test_custom_stopping_criterion_and_reason():
    cfg = GenerationConfig(max_new_tokens=8)
    out = run(cfg, stopping_criteria=[three_new])
    np.testing.assert_array_equal(out.lengths - out.prompt_lengths, [3, 3, 3])
    assert set(np.asarray(out.stop_reason).tolist()) == {stopping.CUSTOM}
    full = run(cfg)
    for a, b in zip(as_lists(out), as_lists(full)):
        assert b[:len(a)] == a


def test_custom_criterion_per_row_and_eos_priority():
    plain = as_lists(run(GenerationConfig(max_new_tokens=6)))
    eos = plain[0][len(PROMPTS[0]) + 1]  # row 0's second new token becomes EOS
    cfg = GenerationConfig(max_new_tokens=6, eos_token_id=eos)

    def only_row_2(ctx, scores):
        return (jnp.arange(ctx.length.shape[0]) == 2) & (ctx.length - ctx.prompt_len >= 1)

    out = run(cfg, stopping_criteria=[only_row_2])
    reasons = [stopping.STOP_REASONS[int(r)] for r in np.asarray(out.stop_reason)]
    assert reasons[0] == "eos" and reasons[2] == "custom"
    assert int(out.lengths[2] - out.prompt_lengths[2]) == 1


# -------------------------------------------------------------------- custom_generate
def my_generate(params, state, cfg):
    """A loop replacement: writes token 0 once to every row."""
    rows_ = jnp.arange(state.batch)
    tokens = state.tokens.at[rows_, state.length].set(0)
    return state.replace(tokens=tokens, length=state.length + 1, done=jnp.ones_like(state.done))


def generate(params, state, cfg, *, logits_processor=(), stopping_criteria=()):
    """Module-level `generate` for the dotted-path form; accepts the hooks."""
    generate.hooks = (logits_processor, stopping_criteria)
    return my_generate(params, state, cfg)


def test_custom_generate_callable_and_dotted_path():
    cfg = GenerationConfig(max_new_tokens=4)
    out = run(cfg, custom_generate=my_generate)
    assert [r[-1] for r in as_lists(out)] == [0, 0, 0]
    out = run(cfg, custom_generate=f"{__name__}:my_generate")
    assert [r[-1] for r in as_lists(out)] == [0, 0, 0]
    out = run(cfg, custom_generate=__name__, logits_processor=[ban_argmax])
    assert [r[-1] for r in as_lists(out)] == [0, 0, 0]
    import sys
    assert sys.modules[__name__].generate.hooks[0] == (ban_argmax,)


def test_custom_generate_never_drops_hooks_silently():
    cfg = GenerationConfig(max_new_tokens=4)
    with pytest.raises(ValueError, match="dropped"):
        run(cfg, custom_generate=my_generate, logits_processor=[ban_argmax])
    with pytest.raises(ValueError, match="cannot import"):
        run(cfg, custom_generate="no_such_module_xyz")
    with pytest.raises(ValueError, match="no callable"):
        run(cfg, custom_generate=f"{__name__}:nothing_here")


def test_generate_ids_passes_hooks():
    ids = jaxgen.generate_ids(MODEL, PARAMS, PROMPTS, max_new_tokens=8,
                              stopping_criteria=[three_new])
    assert [len(r) - len(p) for r, p in zip(ids, PROMPTS)] == [3, 3, 3]


# --------------------------------------------------------------------------- vmap
def test_vmap_over_temperature_top_p_and_keys_compiles_once():
    base = dict(do_sample=True, max_new_tokens=6, top_k=0)
    temps = jnp.array([0.5, 1.0, 2.0])
    top_ps = jnp.array([0.3, 0.9, 1.0])
    keys = jax.vmap(lambda i: jax.random.split(jax.random.key(i), len(PROMPTS)))(jnp.arange(3))
    cfg = GenerationConfig(**base, temperature=temps, top_p=top_ps)
    axes = cfg.vmap_axes(temperature=0, top_p=0)

    def sweep(c, k):
        state = jaxgen.init_state(MODEL, PROMPTS, GenerationConfig(**base))
        fn = lambda c_, k_: jaxgen.generate(PARAMS, state.replace(key=k_), c_).sequences  # noqa
        return jax.vmap(fn, in_axes=(axes, 0))(c, k)

    before = jaxgen.trace_count()
    swept = np.asarray(sweep(cfg, keys))
    after_first = jaxgen.trace_count()
    swept2 = np.asarray(sweep(cfg.replace(temperature=temps * 0.9), keys))
    assert after_first - before == 1 and jaxgen.trace_count() == after_first
    assert swept.shape == swept2.shape == (3, len(PROMPTS), swept.shape[-1])
    for i in range(3):
        single = GenerationConfig(**base, temperature=float(temps[i]), top_p=float(top_ps[i]))
        state = jaxgen.init_state(MODEL, PROMPTS, single, keys[i])
        np.testing.assert_array_equal(swept[i], jaxgen.generate(PARAMS, state, single).sequences)


def test_vmap_axes_helper():
    cfg = GenerationConfig(do_sample=True, temperature=jnp.array([0.5, 1.0]))
    axes = cfg.vmap_axes(temperature=0)
    assert axes.temperature == 0 and axes.top_p is None
    assert jax.tree_util.tree_leaves(axes) == [0]
    # usable as an in_axes prefix of the config
    out = jax.vmap(lambda c: c.temperature * 2, in_axes=(axes,))(cfg)
    np.testing.assert_allclose(out, [1.0, 2.0])
    with pytest.raises(ValueError, match="not a dynamic field"):
        cfg.vmap_axes(max_new_tokens=0)
    with pytest.raises(ValueError, match="min_p"):
        cfg.vmap_axes(min_p=0)


def test_new_penalty_values_do_not_recompile():
    cfg = GenerationConfig(max_new_tokens=4, repetition_penalty=1.3, presence_penalty=0.2,
                           frequency_penalty=0.1, min_new_tokens=2, eos_token_id=5, do_sample=True,
                           min_p=0.1, typical_p=0.9, epsilon_cutoff=0.01, eta_cutoff=0.01)
    run(cfg)
    before = jaxgen.trace_count()
    run(cfg.replace(repetition_penalty=1.7, presence_penalty=-0.5, frequency_penalty=0.4,
                    min_new_tokens=3, temperature=0.8, top_p=0.5, top_k=7, min_p=0.2,
                    typical_p=0.5, epsilon_cutoff=0.02, eta_cutoff=0.001))
    assert jaxgen.trace_count() == before


# ----------------------------------------------------------------- recorded scores
def test_recorded_scores_are_the_full_chain_of_the_recorded_logits():
    cfg = GenerationConfig(max_new_tokens=6, repetition_penalty=1.5, no_repeat_ngram_size=2,
                           presence_penalty=0.3, bad_words_ids=[[3, 4], [9]],
                           sequence_bias=[[[1], 0.5]], min_new_tokens=2, eos_token_id=7,
                           suppress_tokens=[11], begin_suppress_tokens=[12],
                           forced_eos_token_id=7, output_scores=True, output_logits=True,
                           renormalize_logits=True)
    out = run(cfg)
    seq, lengths, plen = (np.asarray(out.sequences), np.asarray(out.lengths),
                          np.asarray(out.prompt_lengths))
    scores, logits, logprobs = (np.asarray(out.scores), np.asarray(out.logits),
                                np.asarray(out.token_logprobs))
    table = np.asarray(PARAMS["table"])
    chain = jax.jit(lambda logits_, ctx_: process_logits(cfg, logits_, ctx_))
    for b in range(len(PROMPTS)):
        for i in range(lengths[b] - plen[b]):
            pos = plen[b] + i
            np.testing.assert_allclose(logits[b, i], table[seq[b, pos - 1]], rtol=1e-6)
            ctx = ProcessorContext(tokens=jnp.asarray(seq[b:b + 1]), length=jnp.array([pos]),
                                   prompt_len=jnp.array([plen[b]]), max_new=jnp.array([6]))
            want = np.asarray(chain(logits[b:b + 1, i], ctx))[0]
            np.testing.assert_allclose(scores[b, i], want, rtol=1e-6, atol=1e-6)
            assert seq[b, pos] == np.argmax(want)
            np.testing.assert_allclose(logprobs[b, i], want[seq[b, pos]], rtol=1e-5, atol=1e-6)
        assert seq[b, lengths[b] - 1] == 7  # forced EOS at the last slot (or earlier EOS)


# -------------------------------------------------------------------- bad input
@pytest.mark.parametrize("fields,match", [
    (dict(repetition_penalty=-1.0), r"`repetition_penalty` must be a float > 0"),
    (dict(repetition_penalty=0.0), r"`repetition_penalty`"),
    (dict(presence_penalty=3.0), r"`presence_penalty` must be a float in \[-2, 2\]"),
    (dict(frequency_penalty=float("nan")), r"`frequency_penalty`"),
    (dict(min_p=1.5), r"`min_p` must be a float in \[0, 1\]"),
    (dict(min_p=-0.1), r"`min_p`"),
    (dict(typical_p=0.0), r"`typical_p` must be a float in \(0, 1\]"),
    (dict(epsilon_cutoff=1.0), r"`epsilon_cutoff` must be a float in \[0, 1\)"),
    (dict(eta_cutoff=-0.5), r"`eta_cutoff`"),
    (dict(no_repeat_ngram_size=-1), r"`no_repeat_ngram_size` must be an int >= 0"),
    (dict(min_new_tokens=-2), r"`min_new_tokens` must be an int >= 0"),
    (dict(min_length=1.5), r"`min_length` must be an int >= 0"),
    (dict(bad_words_ids=[[1], []]), r"`bad_words_ids` must be a non-empty list"),
    (dict(bad_words_ids=[1, 2]), r"`bad_words_ids`"),
    (dict(bad_words_ids=[[-1]]), r"`bad_words_ids`"),
    (dict(sequence_bias=[[[1], "x"]]), r"`sequence_bias`"),
    (dict(sequence_bias={(): 1.0}), r"`sequence_bias`"),
    (dict(suppress_tokens=[1, -3]), r"`suppress_tokens`"),
    (dict(begin_suppress_tokens="ab"), r"`begin_suppress_tokens`"),
    (dict(forced_eos_token_id=[-1]), r"`forced_eos_token_id`"),
    (dict(forced_bos_token_id=1.0), r"`forced_bos_token_id`"),
    (dict(exponential_decay_length_penalty=(1,)), r"`exponential_decay_length_penalty`"),
    (dict(exponential_decay_length_penalty=(2, -1.0)), r"`exponential_decay_length_penalty`"),
    (dict(stop_strings=["ok", ""]), r"`stop_strings`"),
    (dict(stop_strings=5), r"`stop_strings`"),
    (dict(max_time=-3.0), r"`max_time` must be a number of seconds > 0"),
    (dict(filter_impl="fast"), r"`filter_impl` must be one of \('search', 'sort'\)"),
    (dict(remove_invalid_values="yes"), r"`remove_invalid_values`"),
])
def test_bad_config_values(fields, match):
    with pytest.raises(ValueError, match=match):
        GenerationConfig(**fields)


@pytest.mark.parametrize("fields,name", [
    (dict(bad_words_ids=[[1, V + 3]]), "bad_words_ids"),
    (dict(sequence_bias=[[[V], 1.0]]), "sequence_bias"),
    (dict(suppress_tokens=[V]), "suppress_tokens"),
    (dict(begin_suppress_tokens=[0, V + 1]), "begin_suppress_tokens"),
    (dict(forced_bos_token_id=V), "forced_bos_token_id"),
    (dict(forced_eos_token_id=[1, V]), "forced_eos_token_id"),
])
def test_ids_outside_the_vocabulary(fields, name):
    cfg = GenerationConfig(max_new_tokens=2, **fields)
    before = jaxgen.trace_count()
    with pytest.raises(ValueError, match=rf"`{name}`.*outside the vocabulary \(allowed: 0..{V - 1}\)"):
        jaxgen.init_state(MODEL, PROMPTS, cfg)
    assert jaxgen.trace_count() == before


def test_stop_strings_without_tokenizer():
    cfg = GenerationConfig(max_new_tokens=2, stop_strings=["\n"])
    with pytest.raises(ValueError, match="tokenizer"):
        jaxgen.init_state(MODEL, PROMPTS, cfg)
    with pytest.raises(ValueError, match="tokenizer"):
        jaxgen.generate_ids(MODEL, PARAMS, PROMPTS, cfg)
    state = jaxgen.init_state(MODEL, PROMPTS, GenerationConfig(max_new_tokens=2))
    with pytest.raises(ValueError, match="tokenizer"):
        jaxgen.generate(PARAMS, state, cfg)

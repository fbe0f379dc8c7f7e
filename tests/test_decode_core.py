"""The greedy / sampling loop on stub models with exactly known logits."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats
from stubs import BigramStub, random_table

import jaxgen
from jaxgen import stopping

VOCAB = 8


def reference_greedy(table, prompt, max_new, eos=()):
    """Numpy reference: bigram greedy decoding with HF's EOS rule (EOS kept, then stop)."""
    row = list(prompt)
    for _ in range(max_new):
        nxt = int(np.argmax(table[row[-1]]))
        row.append(nxt)
        if nxt in eos:
            break
    return row


@pytest.fixture(scope="module")
def stub():
    return BigramStub(VOCAB), random_table(VOCAB, seed=3)


def test_greedy_matches_reference_on_ragged_batch(stub):
    model, params = stub
    table = np.asarray(params["table"])
    prompts = [[1, 2, 3], [4], [5, 6, 7, 0, 1], [2, 2]]
    cfg = jaxgen.GenerationConfig(max_new_tokens=7, eos_token_id=[3, 6])
    got = jaxgen.generate_ids(model, params, prompts, cfg)
    assert got == [reference_greedy(table, p, 7, (3, 6)) for p in prompts]


def test_eos_kept_then_padding_and_stop_reasons(stub):
    model, params = stub
    table = np.asarray(params["table"])
    first = int(np.argmax(table[1]))  # the token greedy emits after token 1
    cfg = jaxgen.GenerationConfig(max_new_tokens=5, eos_token_id=first, pad_token_id=0)
    state = jaxgen.init_state(model, [[1], [first if first != 1 else 2, 4]], cfg)
    out = jaxgen.generate(params, state, cfg)
    seqs, lengths = np.asarray(out.sequences), np.asarray(out.lengths)
    assert lengths[0] == 2 and seqs[0, 1] == first
    assert (seqs[0, 2:] == 0).all()  # padding after EOS
    assert np.asarray(out.stop_reason)[0] == stopping.EOS
    row1 = reference_greedy(table, seqs[1, :2].tolist(), 5, (first,))
    assert seqs[1, :lengths[1]].tolist() == row1
    expected_reason = stopping.EOS if row1[-1] == first else stopping.MAX_LENGTH
    assert np.asarray(out.stop_reason)[1] == expected_reason


def test_max_length_counts_the_prompt_per_row(stub):
    model, params = stub
    cfg = jaxgen.GenerationConfig(max_length=6)
    got = jaxgen.generate_ids(model, params, [[1, 2, 3, 4], [5]], cfg)
    assert [len(r) for r in got] == [6, 6]


def test_per_row_budgets(stub):
    model, params = stub
    cfg = jaxgen.GenerationConfig(max_new_tokens=6)
    state = jaxgen.init_state(model, [[1], [2], [3]], cfg, max_new_tokens=[1, 6, 3])
    out = jaxgen.generate(params, state, cfg)
    assert np.asarray(out.lengths).tolist() == [2, 7, 4]


def test_token_logprobs_and_scores_are_consistent(stub):
    model, params = stub
    table = np.asarray(params["table"])
    cfg = jaxgen.GenerationConfig(max_new_tokens=3, output_scores=True, output_logits=True)
    out = jaxgen.generate(params, jaxgen.init_state(model, [[1]], cfg), cfg)
    seq = np.asarray(out.sequences)[0]
    raw = np.asarray(out.logits)[0]
    np.testing.assert_allclose(raw[0], table[1], rtol=0, atol=0)
    for i in range(3):
        logp = raw[i] - np.log(np.exp(raw[i] - raw[i].max()).sum()) - raw[i].max()
        np.testing.assert_allclose(np.asarray(out.token_logprobs)[0, i], logp[seq[1 + i]], atol=1e-5)


def exact_processed_distribution(logits, temperature, top_k, top_p):
    """Independent numpy version of HF's temperature -> top-k -> top-p warpers."""
    scores = logits / temperature
    kth = np.sort(scores)[::-1][top_k - 1]
    scores = np.where(scores < kth, -np.inf, scores)
    probs = np.exp(scores - scores.max())
    probs /= probs.sum()
    order = np.argsort(-probs)
    above = np.concatenate([[0.0], np.cumsum(probs[order])[:-1]])
    keep = np.zeros_like(probs, bool)
    keep[order] = above < top_p
    probs = np.where(keep, probs, 0.0)
    return probs / probs.sum()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 4, 1.0),
                                                     (1.3, 6, 0.8), (0.9, 5, 0.6)])
def test_sampling_frequencies_match_exact_distribution(temperature, top_k, top_p):
    vocab = 6
    logits = np.array([1.2, 0.3, -0.5, 2.0, 0.9, -1.5], np.float32)
    table = np.tile(logits, (vocab, 1))
    model, params = BigramStub(vocab), {"table": jnp.asarray(table)}
    samples = 12000
    cfg = jaxgen.GenerationConfig(do_sample=True, temperature=temperature, top_k=top_k,
                                  top_p=top_p, max_new_tokens=1)
    state = jaxgen.init_state(model, [[0]] * samples, cfg, jax.random.key(11))
    out = jaxgen.generate(params, state, cfg)
    drawn = np.asarray(out.sequences)[:, 1]
    counts = np.bincount(drawn, minlength=vocab)
    expected = exact_processed_distribution(logits.astype(np.float64), temperature,
                                            top_k if top_k else vocab, top_p)
    assert counts[expected == 0].sum() == 0, "sampled a token the warpers remove"
    support = expected > 0
    chi2 = stats.chisquare(counts[support], expected[support] * samples)
    assert chi2.pvalue > 1e-3, (counts, expected * samples)


def test_compiles_once_for_new_prompts_temperatures_top_p_and_keys(stub):
    model, params = stub
    rng = np.random.default_rng(0)
    before = None
    for i in range(20):
        lengths = rng.integers(1, 16, size=3)  # all in the 16-token bucket
        prompts = [rng.integers(0, VOCAB, size=n).tolist() for n in lengths]
        cfg = jaxgen.GenerationConfig(do_sample=True, temperature=float(rng.uniform(0.2, 2.0)),
                                      top_p=float(rng.uniform(0.1, 1.0)), top_k=int(rng.integers(0, 8)),
                                      max_new_tokens=5)
        state = jaxgen.init_state(model, prompts, cfg, jax.random.key(i))
        jaxgen.generate(params, state, cfg)
        if before is None:
            before = jaxgen.trace_count()
    assert jaxgen.trace_count() == before


@pytest.mark.parametrize("do_sample", [False, True])
def test_batch_invariance(stub, do_sample):
    """A row's output depends only on its own prompt and key, not on neighbours or padding."""
    model, params = stub
    cfg = jaxgen.GenerationConfig(do_sample=do_sample, max_new_tokens=8, top_k=0)
    keys = jax.random.split(jax.random.key(5), 3)
    target = [3, 1, 4]
    alone = jaxgen.generate_ids(model, params, [target], cfg, key=keys[1][None])
    mixed = jaxgen.generate_ids(model, params, [[2], target, [1, 5, 2, 6, 0, 7, 7, 1, 2, 3]],
                                cfg, key=keys)
    other_keys = jnp.stack([jax.random.key(9), keys[1]])
    padded_more = jaxgen.generate_ids(model, params, [list(range(8)) * 3, target], cfg,
                                      key=other_keys)  # a bigger prompt bucket (32)
    assert alone[0] == mixed[1] == padded_more[1]


@pytest.mark.parametrize("fields,needle", [
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_length=0), "max_length"),
    (dict(do_sample="yes"), "do_sample"),
    (dict(not_a_field=1), "not_a_field"),
    (dict(penalty_alpha=0.6), "penalty_alpha"),
])
def test_bad_config_values_raise_clear_errors(fields, needle):
    with pytest.raises(ValueError, match=needle):
        jaxgen.GenerationConfig(**fields)


def test_bad_prompts_raise_before_compiling(stub):
    model, params = stub
    cfg = jaxgen.GenerationConfig(max_new_tokens=2)
    traces = jaxgen.trace_count()
    with pytest.raises(ValueError, match="empty"):
        jaxgen.init_state(model, [[1], []], cfg)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        jaxgen.init_state(model, [[1, VOCAB]], cfg)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        jaxgen.init_state(model, [[1, -1]], cfg)
    with pytest.raises(ValueError, match="longer than the buffer"):
        jaxgen.init_state(model, [[1] * 10], jaxgen.GenerationConfig(max_length=10))
    with pytest.raises(ValueError, match="does not fit the buffer"):
        jaxgen.init_state(model, [[1] * 10], cfg, buffer_len=11)
    with pytest.raises(ValueError, match="eos_token_id"):
        jaxgen.init_state(model, [[1]], cfg.replace(eos_token_id=VOCAB + 3))
    assert jaxgen.trace_count() == traces


def test_config_speaks_hf_names_and_precedence(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        '{"do_sample": true, "temperature": 0.6, "top_p": 0.9, "eos_token_id": [2, 7],'
        ' "transformers_version": "4.42.0"}')
    cfg = jaxgen.GenerationConfig.from_pretrained(tmp_path)
    assert cfg.mode == "sample" and cfg.eos_ids == (2, 7) and cfg.top_k == 50
    assert cfg.replace(do_sample=False).mode == "greedy"
    assert jaxgen.GenerationConfig.from_pretrained(tmp_path, temperature=0.3).temperature == 0.3
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation_config.json"):
        jaxgen.GenerationConfig.from_pretrained(tmp_path)

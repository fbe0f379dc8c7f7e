"""Universal assisted decoding with a Gemma 2 target: a tiny Llama assistant with another
tokenizer (the byte-level BPEs of tests/test_uad.py), jaxgen's tokens against transformers'
UAD (`generate(..., assistant_model=, tokenizer=, assistant_tokenizer=)`), fp32, and UAD
sampling against the target's exact distribution (chi-square)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from exact_sampling import chi_square
from model_fixtures import make_hf_model
from test_gemma import make_hf_gemma
from test_uad import FEWER_RAW, FEWER_TOK, TARGET_RAW, TARGET_TOK, TEXTS

import jaxgen
from jaxgen.models import load

transformers = pytest.importorskip("transformers")

PROMPTS = [TARGET_TOK.encode(t) for t in TEXTS]
EOS = TARGET_TOK.eos_token_id
GREEDY = dict(max_new_tokens=16, num_assistant_tokens=3, eos_token_id=EOS, pad_token_id=0)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(jaxgen target, params, HF target, jaxgen assistant, HF assistant)."""
    hf_target = make_hf_gemma("gemma2", seed=3, vocab_size=len(TARGET_TOK), eos_token_id=EOS)
    hf_assistant = make_hf_model("llama", seed=4, vocab_size=len(FEWER_TOK),
                                 eos_token_id=FEWER_TOK.eos_token_id, bos_token_id=None,
                                 num_hidden_layers=1)
    folders = [str(tmp_path_factory.mktemp(name)) for name in ("target", "assistant")]
    hf_target.save_pretrained(folders[0])
    hf_assistant.save_pretrained(folders[1])
    target, params, _ = load(folders[0])
    assistant, assistant_params, _ = load(folders[1])
    return target, params, hf_target, (assistant, assistant_params), hf_assistant


def fast(raw):
    return transformers.PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>")


@pytest.mark.slow  # about 90 s on 2 cores: UAD's four programs, transformers' UAD
def test_uad_tokens_equal_transformers_uad_and_plain_greedy(models):
    target, params, hf_target, assistant, hf_assistant = models
    ours = jaxgen.generate_ids(target, params, PROMPTS, assistant_model=assistant,
                               tokenizer=TARGET_TOK, assistant_tokenizer=FEWER_TOK,
                               assistant_confidence_threshold=0.0, **GREEDY)
    plain = jaxgen.generate_ids(target, params, PROMPTS, **{
        k: v for k, v in GREEDY.items() if k != "num_assistant_tokens"})
    assert ours == plain
    for b in (0, 3):  # HF's UAD runs one row at a time
        prompt = PROMPTS[b]
        with torch.no_grad():
            hf = hf_target.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                                                  dtype=torch.long),
                assistant_model=hf_assistant, tokenizer=fast(TARGET_RAW),
                assistant_tokenizer=fast(FEWER_RAW), do_sample=False, **GREEDY)
        row = hf[0].tolist()
        if EOS in row[len(prompt):]:
            row = row[:row.index(EOS, len(prompt)) + 1]
        assert ours[b] == row, f"row {b}"


@pytest.mark.slow
def test_uad_sampling_keeps_the_target_distribution(models):
    """Sampling (top_k=0, temperature 0.5: peaked enough for the test to tell the two
    marginals apart) with the Llama assistant of another tokenizer: the first and the second
    new tokens (drawn by UAD's accept / resample steps) follow the target's exact marginals
    p(. | prompt) and sum_a p(a | prompt) p(. | prompt, a) (chi-square, 1000 rows)."""
    target, params, _, assistant, _ = models
    prompt, rows, vocab, temperature = PROMPTS[1], 1000, target.vocab_size, 0.5

    def probs(prefixes):
        tokens = jnp.asarray(prefixes, jnp.int32)  # [N, S]
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)  # [N, S]
        logits = target(params, tokens, positions, target.init_cache(*tokens.shape)).logits
        return np.asarray(jax.nn.softmax(logits[:, -1] / temperature), np.float64)  # [N, V]

    first = probs([prompt])[0]  # [V]
    second = first @ probs([prompt + [a] for a in range(vocab)])  # [V]
    cfg = jaxgen.GenerationConfig(do_sample=True, top_k=0, temperature=temperature,
                                  max_new_tokens=3, pad_token_id=0, num_assistant_tokens=3,
                                  assistant_confidence_threshold=0.0)
    out = jaxgen.generate(params, jaxgen.init_state(target, [prompt] * rows, cfg,
                                                    jax.random.key(11)), cfg,
                          assistant_model=assistant, tokenizer=TARGET_TOK,
                          assistant_tokenizer=FEWER_TOK)
    new = np.asarray(out.sequences)[:, len(prompt):len(prompt) + 2]  # [rows, 2]
    assert (np.asarray(out.lengths) == len(prompt) + 3).all()
    assert chi_square(np.bincount(new[:, 0], minlength=vocab), first) > 1e-3
    assert chi_square(np.bincount(new[:, 1], minlength=vocab), second) > 1e-3
    stats = out.speculative  # both the accept and the resample paths ran
    assert 0 < int(np.sum(stats.accepted)) < int(np.sum(stats.drafted))

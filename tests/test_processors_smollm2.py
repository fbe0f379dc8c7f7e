"""Greedy generation on SmolLM2-135M-Instruct with the history / position processors on, and
stop strings, token for token against transformers' generate() on the same weights
(batch 1 and a ragged batch; HF runs the batch left-padded with an attention mask).

Marked slow (about 4 minutes on 2 CPU cores: three SmolLM2 compiles plus HF generate);
run with `pytest -m slow tests/test_processors_smollm2.py`."""
from __future__ import annotations

import model_fixtures
import numpy as np
import pytest

import jaxgen
from jaxgen import stopping

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "Write a short poem about the sea.",
             "List three colors."]
EOS = 2  # <|im_end|>
PAD = 0  # <|endoftext|>: never generated here, so HF's post-stop padding is easy to strip


@pytest.fixture(scope="module")
def smollm2():
    model, params, tokenizer, hf_model = model_fixtures.smollm2_pair()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                             add_generation_prompt=True, tokenize=True)
               for q in QUESTIONS]
    return model, params, tokenizer, hf_model, [list(p) for p in prompts]


def processor_settings(tokenizer):
    enc = lambda text: tokenizer.encode(text)  # noqa: E731
    return dict(
        max_new_tokens=14, eos_token_id=EOS, repetition_penalty=1.3, no_repeat_ngram_size=2,
        bad_words_ids=[enc(" Paris"), enc(" blue"), enc("The capital")],
        min_new_tokens=4, suppress_tokens=enc(" red") + enc(" waves"),
        begin_suppress_tokens=enc("The") + enc("Here"),
        sequence_bias=[[enc(" green"), 4.0], [enc(" the sea"), -3.0], [enc(" is"), 1.5]],
        forced_eos_token_id=EOS)


def hf_rows(hf_model, prompts, **kwargs):
    """HF generate on a left-padded batch: prompt + new ids per row, post-stop padding cut."""
    rows = []
    for prompt, row in zip(prompts, model_fixtures.hf_generate_rows(hf_model, prompts, PAD,
                                                                    do_sample=False, **kwargs)):
        new = row[len(prompt):]
        if EOS in new:
            new = new[:new.index(EOS) + 1]
        while new and new[-1] == PAD:
            new.pop()
        rows.append(list(prompt) + new)
    return rows


@pytest.mark.parametrize("which", [[0], [0, 1, 2]], ids=["batch1", "ragged3"])
def test_greedy_with_processors_matches_transformers(smollm2, which):
    model, params, tokenizer, hf_model, prompts = smollm2
    prompts = [prompts[i] for i in which]
    settings = processor_settings(tokenizer)
    ours = jaxgen.generate_ids(model, params, prompts, pad_token_id=PAD, **settings)
    theirs = hf_rows(hf_model, prompts, **settings)
    assert ours == theirs
    assert all(row[-1] == EOS for row in ours)  # forced EOS (or an earlier EOS)


def test_stop_strings_match_transformers(smollm2):
    model, params, tokenizer, hf_model, prompts = smollm2
    plain = jaxgen.generate_ids(model, params, prompts, max_new_tokens=20, eos_token_id=EOS,
                                pad_token_id=PAD)
    # Stop strings taken from each row's own greedy text: a mid-token piece spanning two
    # tokens, so that different rows stop at different steps (or not at all).
    stops = []
    for prompt, row in zip(prompts, plain):
        text = tokenizer.decode(row[len(prompt):][3:6])
        stops.append(text[1:-1] if len(text) > 3 else text)
    cfg = dict(max_new_tokens=20, eos_token_id=EOS, stop_strings=stops)
    import transformers

    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
    theirs = hf_rows(hf_model, prompts, tokenizer=hf_tok, **cfg)
    state = jaxgen.init_state(model, prompts, jaxgen.GenerationConfig(pad_token_id=PAD, **cfg),
                              tokenizer=tokenizer)
    out = jaxgen.generate(params, state, jaxgen.GenerationConfig(pad_token_id=PAD, **cfg))
    seq, lengths = np.asarray(out.sequences), np.asarray(out.lengths)
    ours = [seq[b, :lengths[b]].tolist() for b in range(len(prompts))]
    assert ours == theirs
    reasons = [stopping.STOP_REASONS[int(r)] for r in np.asarray(out.stop_reason)]
    assert "stop_string" in reasons
    for b, reason in enumerate(reasons):
        if reason == "stop_string":
            assert len(ours[b]) < len(plain[b]) or ours[b] == plain[b]

"""Constrained generation on SmolLM2-135M-Instruct (slow set): 200 sampled outputs per
pattern all validate, and greedy constrained output equals transformers' generate with an
equivalent prefix_allowed_tokens_fn (batch 1)."""
from __future__ import annotations

import json
import re

import jax
import jsonschema
import pytest
from constraint_fixtures import DATE, EMAIL, PERSON, HostAutomaton, new_ids
from model_fixtures import smollm2_pair

import jaxgen
from jaxgen.constraints.compile import compile_constraint

pytestmark = pytest.mark.slow

QUESTIONS = {
    "date": "When did the first person walk on the moon? Answer with the date.",
    "email": "Write an e-mail address for a bakery.",
    "json": "Describe a fictional person as JSON with name, age, address and hobbies.",
}
SAMPLES, PER_CALL = 200, 50


def chat(tokenizer, question):
    return tokenizer.apply_chat_template([{"role": "user", "content": question}])


def sampled_texts(kind, budget, **constraint):
    model, params, tokenizer, _ = smollm2_pair()
    prompt = chat(tokenizer, QUESTIONS[kind])
    eos = set(model.config.eos_token_id)
    out = []
    for call in range(SAMPLES // PER_CALL):
        rows = jaxgen.generate_ids(model, params, [prompt], tokenizer=tokenizer,
                                   max_new_tokens=budget, do_sample=True, temperature=1.0,
                                   num_return_sequences=PER_CALL, key=jax.random.key(call),
                                   **constraint)
        for row in rows:
            ids, ended = new_ids(row, len(prompt), eos)
            assert ended, f"row ran out of budget: {tokenizer.decode(ids)!r}"
            out.append(tokenizer.decode(ids))
    assert len(out) == SAMPLES
    return out


def test_200_sampled_dates_match():
    texts = sampled_texts("date", 16, regex=DATE)
    assert all(re.fullmatch(DATE, t) for t in texts), [t for t in texts
                                                        if not re.fullmatch(DATE, t)][:5]
    assert len(set(texts)) > 1


def test_200_sampled_emails_match():
    texts = sampled_texts("email", 48, regex=EMAIL)
    assert all(re.fullmatch(EMAIL, t) for t in texts), [t for t in texts
                                                         if not re.fullmatch(EMAIL, t)][:5]


def test_200_sampled_nested_json_validate():
    for text in sampled_texts("json", 192, json_schema=PERSON):
        jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize("kind", ["date", "json"])
def test_greedy_constrained_equals_transformers_prefix_fn(kind):
    torch = pytest.importorskip("torch")
    model, params, tokenizer, hf = smollm2_pair()
    constraint = dict(regex=DATE) if kind == "date" else dict(json_schema=PERSON)
    prompt = chat(tokenizer, QUESTIONS[kind])
    eos = list(model.config.eos_token_id)
    built = compile_constraint(tokenizer, model.vocab_size, **constraint)
    fn = HostAutomaton(built.automaton).prefix_fn([len(prompt)], eos)
    budget = 16 if kind == "date" else 128
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor([prompt]), max_new_tokens=budget,
                          do_sample=False, prefix_allowed_tokens_fn=fn, eos_token_id=eos,
                          pad_token_id=tokenizer.pad_token_id, top_k=None, top_p=None,
                          temperature=None)
    expected = out[0].tolist()
    compiled = jaxgen.generate_ids(model, params, [prompt], tokenizer=tokenizer,
                                   max_new_tokens=budget, **constraint)[0]
    hosted = jaxgen.generate_ids(model, params, [prompt], max_new_tokens=budget,
                                 prefix_allowed_tokens_fn=fn)[0]
    assert compiled == expected and hosted == expected
    assert expected[-1] in eos

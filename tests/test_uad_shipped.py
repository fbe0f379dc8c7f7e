"""The shipped other-tokenizer draft for SmolLM2-135M-Instruct (jaxgen.train.fit_uad_draft):
it loads by name with its own tokenizer (another vocabulary, other merges, text round-trips),
and greedy universal assisted decoding with it equals plain greedy on SmolLM2 (slow set)."""
from __future__ import annotations

import os

import numpy as np
import pytest

import jaxgen
from jaxgen.models.shipped_drafters import UAD_DRAFT_NAME, WEIGHTS, default_tokenizer

FOLDER = os.path.join(WEIGHTS, UAD_DRAFT_NAME)
pytestmark = pytest.mark.skipif(not os.path.isdir(FOLDER), reason="UAD draft not shipped")
TEXTS = ["Hello, world! The year 2024 had 366 days.",
         "Naïve café crème — 東京 🙂\n\n  indented\tand tabbed",
         "def f(x):\n    return x ** 2  # squares"]


@pytest.fixture(scope="module")
def uad_draft():
    return jaxgen.models.load(UAD_DRAFT_NAME)


def test_loads_with_its_own_tokenizer_that_round_trips_text(uad_draft):
    model, params, tokenizer = uad_draft
    smollm_tokenizer = default_tokenizer()  # SmolLM2's
    assert len(tokenizer) == model.vocab_size == params["embed"].shape[0]
    assert len(tokenizer) != len(smollm_tokenizer)
    assert len(tokenizer) < 10_000
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
        assert ids != smollm_tokenizer.encode(text)
    # other merges: a common sentence splits into other token strings
    sentence = " Photosynthesis converts sunlight into chemical energy stored in glucose."
    pieces = lambda tok: tok.backend.encode(sentence, add_special_tokens=False).tokens  # noqa
    assert pieces(tokenizer) != pieces(smollm_tokenizer)
    # the chat markers are single special tokens, skipped on decode
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert chat.count(tokenizer.backend.token_to_id("<|im_start|>")) == 3  # system, user, asst
    assert "<|im_start|>" not in tokenizer.decode(chat, skip_special_tokens=True)
    # small enough to ship: a few MB of fp16
    size = os.path.getsize(os.path.join(FOLDER, "model.safetensors"))
    assert size < 8 * 2 ** 20, size


def _greedy_pair(uad_draft, texts, new_tokens):
    model, params, tokenizer = jaxgen.models.load("smollm2-135m-instruct")
    draft, draft_params, draft_tokenizer = uad_draft
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    cfg = jaxgen.default_config(model, None, max_new_tokens=new_tokens, do_sample=False)
    plain = jaxgen.generate(params, jaxgen.init_state(model, prompts, cfg), cfg)
    uad_cfg = cfg.replace(num_assistant_tokens=4, assistant_confidence_threshold=0.0)
    out = jaxgen.generate(params, jaxgen.init_state(model, prompts, uad_cfg), uad_cfg,
                          assistant_model=(draft, draft_params), tokenizer=tokenizer,
                          assistant_tokenizer=draft_tokenizer)
    return plain, out


@pytest.mark.slow
@pytest.mark.parametrize("texts", [
    ["Write a short poem about the sea."],
    ["How do I boil an egg?", "Name three planets.", "Hi", "Write a haiku about the sea."]],
    ids=["batch1", "ragged4"])
def test_greedy_uad_with_the_shipped_draft_equals_plain_greedy(uad_draft, texts):
    from jaxgen.api.generate import outputs_to_lists

    plain, out = _greedy_pair(uad_draft, texts, new_tokens=32)
    assert outputs_to_lists(out) == outputs_to_lists(plain)
    stats = out.speculative
    assert int(np.sum(stats.drafted)) > 0
    assert int(np.sum(stats.accepted)) > 0  # the trained draft is often right
    assert float(np.mean(stats.tokens_per_round)) > 1.0

"""Two places where jaxgen differed from Hugging Face (found by porting HF's processor tests):
min-p's min_tokens_to_keep ranks by logits with ties by index, and "<0xHH>" byte-fallback
tokens parse strictly, as the tokenizers decoder does."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
import torch
from tokenizers import decoders, models

from jaxgen.logits.warpers import min_p_filter
from jaxgen.stopping.strings import token_texts


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("logits, keep", [
    ([[2.0, 1.0, 0.5, -3.0, -40.0, 1.9]], 2),
    ([[2.0, 1.0, 0.5, -3.0, -40.0, 1.9]], 4),
    ([[1.0, 1.0, 1.0, 1.0]], 2),  # no token removed by min_p itself
])
def test_min_p_matches_hugging_face(logits, keep, exact):
    from transformers.generation.logits_process import MinPLogitsWarper
    ours = np.asarray(min_p_filter(jnp.asarray(logits, jnp.float32), 0.5, keep, exact=exact))
    theirs = MinPLogitsWarper(min_p=0.5, min_tokens_to_keep=keep)(
        torch.zeros((1, 1), dtype=torch.long), torch.tensor(logits)).numpy()
    np.testing.assert_array_equal(np.isinf(ours), np.isinf(theirs))
    np.testing.assert_array_equal(ours[np.isfinite(ours)], theirs[np.isfinite(theirs)])


@pytest.mark.parametrize("exact", [False, True])
def test_min_p_keeps_exactly_min_tokens_to_keep_when_probabilities_underflow(exact):
    """Probabilities of -1000.. underflow to equal zeros: jaxgen (like HF) keeps exactly
    min_tokens_to_keep tokens; it ranks them by logits (HF's topk over the tied zero
    probabilities picks arbitrarily among them)."""
    from transformers.generation.logits_process import MinPLogitsWarper
    logits = [[0.0, -1000.0, -1001.0, -1002.0, 5.0]]
    ours = np.asarray(min_p_filter(jnp.asarray(logits, jnp.float32), 0.5, 3, exact=exact))[0]
    theirs = MinPLogitsWarper(min_p=0.5, min_tokens_to_keep=3)(
        torch.zeros((1, 1), dtype=torch.long), torch.tensor(logits)).numpy()[0]
    assert np.isfinite(ours).tolist() == [True, True, False, False, True]
    assert np.isfinite(theirs).sum() == np.isfinite(ours).sum() == 3


def test_min_p_ties_at_the_cut_go_to_the_lower_index():
    scores = jnp.array([[5.0, -900.0, -900.0, -900.0]])
    kept = np.isfinite(np.asarray(min_p_filter(scores, 0.5, 3)))[0]
    assert kept.tolist() == [True, True, True, False]


def test_byte_fallback_tokens_parse_strictly():
    vocab = {"<unk>": 0, "<0x41>": 1, "<0x 1>": 2, "<0x+1>": 3, "<0xZZ>": 4, "abcdef": 5}
    backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    texts, mode = token_texts(backend)
    assert mode == "byte_fallback"
    assert texts[1] == b"A"
    for index in (2, 4):  # not bytes: their text, as the tokenizers decoder gives it
        assert texts[index] == backend.decode([index]).encode("utf-8")
        assert texts[index] == list(vocab)[index].encode("utf-8")
    assert texts[3] == backend.decode([3]).encode("utf-8")  # Rust parses "+1" as a byte
